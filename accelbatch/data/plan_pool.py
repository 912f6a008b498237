"""PlanPool: data worker processes that collate a map-style loader's planned batches, delivered in plan order.

The async accessor's source when it has data workers (``--dataloader-mode async`` or ``async-rebatched`` with
``--num-workers`` W > 0 on in-memory data), in place of a torch DataLoader. Every batch is planned before
any worker sees it (:class:`~accelbatch.data.loader._PlanSampler`), so the workers need no index queue and
the accessor no sampler thread: batch k of a pass goes to worker k mod W over that worker's own pipe and
comes back on the same pipe as one packed payload (``pickle_batch``), at most ``prefetch`` batches
outstanding per worker. Per batch that is one small message out and one payload back, where torch's
DataLoader adds queue feeder threads, an index queue and its iterator's bookkeeping (bench/throughput.py
``--parts async``: the data processes' CPU per example went from 72-81 us to 62-72 us, bag model bs 32).

Workers start at the first pass, from the accessor process with the default start method, and stay up
across passes. A pass left early (the consumer restarted or stopped) collects the batches still out, so
the next pass starts clean. In a worker, ``torch.utils.data.get_worker_info()`` answers as in a DataLoader
worker (id, num_workers, seed, dataset), ``random`` and torch are seeded with ``seed`` (drawn from the
accessor's torch generator, plus the worker's id), Ctrl-C is ignored (the run handles it) and what the
worker inherited is frozen out of the garbage collector's reach (:func:`init_data_worker`).

Errors: an exception in the dataset or the collate reaches the caller with its type when it can be
pickled, and the worker's traceback (``worker_traceback``, which the accessor forwards instead of its own);
a worker that dies raises :class:`DataWorkerDiedError` naming its pid and how it ended; no batch within
``timeout_s`` raises :class:`DataWorkerTimeoutError` naming ``--data-timeout-s``. In both cases the pool
stops its workers first. Workers exit by themselves when the accessor is gone: a forked worker closes the
pool's pipe ends it inherited, so the accessor's end is the only one, and its closing ends the worker.
"""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import pickle
import random
import signal
import time
import traceback
from multiprocessing.connection import wait
from typing import Any, Iterator

import torch

from accelbatch.data.accessor import AccessorError, pickle_exception, unpickle_exception

_ERROR = b"E"      # first byte of an error message; a payload starts with pickle's protocol byte
_WATCH_S = 5.0     # a worker idle this long checks that the accessor is still its parent


class DataWorkerDiedError(AccessorError):
    """A data worker ended while the accessor waited for its batch."""


class DataWorkerTimeoutError(AccessorError, TimeoutError):
    """A data worker sent no batch within ``timeout_s``."""


def init_data_worker(worker_id: int) -> None:
    """Set up a data worker process (a PlanPool's or a torch DataLoader's): it leaves Ctrl-C to the run
    (which saves, then stops the workers), so no handler of the run's inherited by a forked worker prints or
    acts on it; and it freezes what it inherited from its parent (the dataset among it), which lives as long
    as the worker, out of the garbage collector's reach: otherwise every full collection walks it and, in a
    forked worker, copies each page it touches (bench: 2 async workers spent 95 us of CPU per example, 58 us
    frozen)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gc.freeze()


def _set_worker_info(worker_id: int, num_workers: int, seed: int, dataset: Any) -> None:
    """What torch.utils.data.get_worker_info() returns in a DataLoader worker, for code that asks for it."""
    try:
        from torch.utils.data._utils import worker as torch_worker

        torch_worker._worker_info = torch_worker.WorkerInfo(id=worker_id, num_workers=num_workers, seed=seed,
                                                            dataset=dataset)
    except (ImportError, AttributeError, TypeError):  # a torch without it: get_worker_info() stays None
        pass


def _error_message(exc: BaseException) -> bytes:
    return _ERROR + pickle.dumps((pickle_exception(exc), f"{type(exc).__name__}: {exc}", traceback.format_exc()))


def _worker_main(dataset: Any, conn: Any, worker_id: int, num_workers: int, seed: int,
                 inherited: list[int]) -> None:
    for fd in inherited:  # a forked worker's copies of the pool's other pipe ends
        try:
            os.close(fd)
        except OSError:
            pass
    init_data_worker(worker_id)
    torch.set_num_threads(1)
    random.seed(seed)
    torch.manual_seed(seed)
    _set_worker_info(worker_id, num_workers, seed, dataset)
    parent = os.getppid()
    try:
        while True:
            if not conn.poll(_WATCH_S):
                if os.getppid() != parent:  # the accessor is gone
                    return
                continue
            task = conn.recv()
            if task is None:
                return
            try:
                payload = dataset[task]
            except Exception as exc:  # noqa: BLE001 - reported to the accessor, which raises it
                conn.send_bytes(_error_message(exc))
                continue
            conn.send_bytes(payload)
    except (EOFError, OSError):  # the accessor closed its end
        return


class PlanPool:
    """Re-iterable source of packed batches: ``dataset[planned]`` for each ``planned`` item of a pass of
    ``sampler`` (see the module docstring). ``dataset`` must return bytes (a packed LoadedBatch).

    ``prefetch``: batches out per worker. 4 rather than torch's 2: a worker then still has work when the
    accessor is off the CPU for a while (2 cores, 4 processes: 3-7% faster in 4 of 4 alternating rounds,
    bag bs 32; 8 was no better than 4)."""

    def __init__(self, dataset: Any, sampler: Any, num_workers: int, timeout_s: float = 60.0, prefetch: int = 4):
        if num_workers < 1:
            raise ValueError(f"PlanPool: num_workers must be at least 1, got {num_workers}")
        self.dataset, self.sampler = dataset, sampler
        self.num_workers, self.timeout_s, self.prefetch = num_workers, timeout_s, prefetch
        self._procs: list[Any] | None = None
        self._conns: list[Any] = []

    def __getstate__(self) -> dict[str, Any]:  # sent to the accessor before any worker runs
        state = dict(self.__dict__)
        state["_procs"], state["_conns"] = None, []
        return state

    def __len__(self) -> int:
        return len(self.sampler)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self._procs or []]

    # workers ---------------------------------------------------------------------------------------
    def _start(self) -> None:
        ctx = mp.get_context()
        seed = int(torch.empty((), dtype=torch.int64).random_().item())
        pipes = [ctx.Pipe() for _ in range(self.num_workers)]
        forked = ctx.get_start_method() == "fork"
        self._procs, self._conns = [], [mine for mine, _ in pipes]
        for k, (_, theirs) in enumerate(pipes):
            others = [c.fileno() for c in self._conns] + [t.fileno() for i, (_, t) in enumerate(pipes) if i > k]
            proc = ctx.Process(target=_worker_main, name=f"accelbatch-data-worker-{k}", daemon=True,
                               args=(self.dataset, theirs, k, self.num_workers, seed + k, others if forked else []))
            proc.start()
            theirs.close()
            self._procs.append(proc)

    def close(self) -> None:
        """Stop the workers (a request, then SIGTERM, then SIGKILL); the next pass starts new ones."""
        procs, conns = self._procs or [], self._conns
        self._procs, self._conns = None, []
        for conn in conns:
            try:
                conn.send(None)
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 1.0
        for proc in procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            if proc.is_alive():
                proc.terminate()
                proc.join(2.0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        for conn in conns:
            conn.close()

    # passes ----------------------------------------------------------------------------------------
    def __iter__(self) -> Iterator[bytes]:
        if self._procs is None:
            self._start()
        self.sampler.begin_pass()
        return self._pass(list(self.sampler))

    def _pass(self, planned: list[Any]) -> Iterator[bytes]:
        sent = received = 0
        try:
            while sent < min(len(planned), self.num_workers * self.prefetch):
                self._send(sent % self.num_workers, planned[sent])
                sent += 1
            while received < len(planned):
                payload = self._receive(received % self.num_workers)
                received += 1
                if payload[:1] == _ERROR:
                    raise self._worker_error(received - 1, payload[1:])
                if sent < len(planned):
                    self._send(sent % self.num_workers, planned[sent])
                    sent += 1
                yield payload
        finally:
            if self._procs is not None and received < sent:  # left early: collect what is still out
                try:
                    for k in range(received, sent):
                        self._receive(k % self.num_workers)
                except AccessorError:
                    self.close()

    def _receive(self, worker: int) -> bytes:
        """The next message of ``worker``: a payload, or an error (see :data:`_ERROR`) for the caller to raise."""
        k = worker
        conn, proc = self._conns[k], self._procs[k]
        deadline = time.monotonic() + self.timeout_s
        while True:
            ready = wait([conn, proc.sentinel], timeout=max(0.0, deadline - time.monotonic()))
            if conn in ready:
                try:
                    message = conn.recv_bytes()
                except (EOFError, OSError):
                    message = None
                if message is not None:
                    return message
            if ready:  # the worker's end closed or it exited, with nothing more to read
                raise self._died(k)
            if time.monotonic() >= deadline:
                pid = proc.pid
                self.close()
                raise DataWorkerTimeoutError(
                    f"no batch from data worker {k} (pid {pid}) within --data-timeout-s={self.timeout_s:g} s: a "
                    "worker hangs, or one batch takes longer than that (raise it if so); the workers were stopped")

    def _send(self, worker: int, planned: Any) -> None:
        try:
            self._conns[worker].send(planned)
        except OSError:  # its end is closed: it died
            raise self._died(worker) from None

    def _died(self, k: int) -> DataWorkerDiedError:
        """Stop the pool after worker ``k`` ended; the error to raise, naming it and how it ended."""
        proc = self._procs[k]
        proc.join(1.0)
        code = proc.exitcode
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited with code {code}" if code is not None else "closed its pipe")
        self.close()
        return DataWorkerDiedError(
            f"data worker {k} (pid {proc.pid}) {how} while loading a batch (--num-workers; killed from outside, "
            "out of memory, or a crash in native code?); the workers were stopped")

    def _worker_error(self, index: int, message: bytes) -> BaseException:
        """The exception a worker reported for batch ``index`` of the pass, with its traceback attached."""
        k = index % self.num_workers
        data, summary, text = pickle.loads(message)
        where = f"(in data worker {k}, pid {self._procs[k].pid})\n{text}"
        exc = unpickle_exception(data, f"data worker {k} raised {summary}")
        try:
            exc.worker_traceback = where  # type: ignore[attr-defined]
            return exc
        except AttributeError:  # an exception type that takes no attributes
            error = AccessorError(f"data worker {k} raised {summary}")
            error.worker_traceback = where  # type: ignore[attr-defined]
            return error
