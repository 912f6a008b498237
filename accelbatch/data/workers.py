"""Where a step's batch is built (a data worker, the accessor process, or the caller's): the collate, padding to
a planned shape, and torch's DataLoader around it with its workers' failures named."""

from __future__ import annotations

import functools
import gc
import multiprocessing
import os
import pickle
import signal
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from accelbatch.data.accessor import pickle_batch
from accelbatch.data.datasets import Store
from accelbatch.data.rebatch import tree_map
from accelbatch.data.steps import Step
from accelbatch.layout import PlanError
from accelbatch.messages import Message
from accelbatch.orphans import end_with_parent
from accelbatch.procs import FailureRecord, ProcessDied, ProcessTimeout, describe_exit, raised_as

__all__ = ["AgentCollate", "BuildStep", "LoadedBatch", "PassLoader", "identity", "init_data_worker", "pad_to_shape",
           "unpacked"]


@dataclass
class LoadedBatch:
    """One step as the loader delivers it: collated ``tensors`` with ``rows`` rows (rows ``num_real`` on are
    padding), the real rows' observations, their flat indices in the store (``ids``) and lengths, the planned
    padded length, and ``step`` = (pass, index in the pass)."""

    tensors: Any
    messages: list[Message]
    ids: list[int]
    lengths: list[int]
    rows: int
    padded_len: int
    step: tuple[int, int] = (0, 0)

    @property
    def num_real(self) -> int:
        return len(self.messages)

    @property
    def pad_fraction(self) -> float:
        total = self.rows * self.padded_len
        return (total - sum(self.lengths)) / total if total else 0.0


class AgentCollate:
    """``collate(messages) = batchify([vectorize(m) for m in messages])``; picklable if both are."""

    def __init__(self, vectorize: Callable[[Message], Message], batchify: Callable[[list[Message]], Any]):
        self.vectorize, self.batchify = vectorize, batchify

    def __call__(self, messages: list[Message]) -> Any:
        return self.batchify([self.vectorize(Message(m)) for m in messages])


def init_data_worker(worker_id: int, spawned_by: int | None = None) -> None:
    """Set up a data worker: Ctrl-C and SIGTERM are the run's (it saves, then stops the workers), so the worker
    ignores SIGINT and leaves the process group, which a terminal, ``timeout`` or a job scheduler signals as a
    whole (SIGTERM sent to it alone still ends it, as torch's shutdown of a hung worker does); if the process
    that forked it dies, the kernel ends it (:func:`~accelbatch.orphans.end_with_parent`); what the worker
    inherited (the store among it) lives as long as it does, so it is frozen out of the collector's reach:
    otherwise every full collection walks it and, in a forked worker, copies each page it touches.
    ``spawned_by``: the loader's process when its main thread started the worker (a spawned worker cannot
    tell which thread started it: :class:`PassLoader` says)."""
    end_with_parent(_data_worker_parent(spawned_by))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(os, "setpgid"):
        os.setpgid(0, 0)
    torch.set_num_threads(1)
    gc.freeze()


def _data_worker_parent(spawned_by: int | None = None) -> int | None:
    """In a data worker, what :func:`~accelbatch.orphans.end_with_parent` takes: the loader's process when it
    forked the worker from its main thread (the forking thread keeps its name in the child), 0 for a
    forkserver's child, ``spawned_by`` for a spawned one, None otherwise."""
    method = multiprocessing.get_start_method()
    parent = multiprocessing.parent_process()
    if method == "forkserver":
        return 0
    if method == "spawn":
        return spawned_by
    forked_by_main = method == "fork" and threading.current_thread().name == "MainThread"
    return parent.pid if forked_by_main and parent is not None else None


def pad_to_shape(tensors: Any, num_real: int, rows: int, padded_len: int | None = None,
                 seq_keys: Sequence[str] = ("text_vec",)) -> Any:
    """Zero-pad a collated batch to ``rows`` rows, and its ``seq_keys`` tensors along dim 1 to ``padded_len``."""
    def pad_rows(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == num_real and rows > num_real:
            return torch.cat([t, t.new_zeros((rows - num_real, *t.shape[1:]))], dim=0)
        return t

    if padded_len is not None and isinstance(tensors, dict):
        tensors = dict(tensors)
        for key in seq_keys:
            t = tensors.get(key)
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] != padded_len:
                if t.shape[1] > padded_len:
                    raise PlanError(f"static shapes (--dynamic-batching buckets): '{key}' has {t.shape[1]} tokens "
                                    f"where the batch was planned for {padded_len}: the agent's example_length "
                                    "(make_loader's length_fn) counts fewer tokens than its batchify makes; give "
                                    "the agent an example_length(message) that counts the tokens it vectorizes")
                extra = t.new_zeros((t.shape[0], padded_len - t.shape[1], *t.shape[2:]))
                tensors[key] = torch.cat([t, extra], dim=1)
    return tree_map(pad_rows, tensors)


@dataclass
class BuildStep(Dataset):
    """Builds a step's batch from the store (in a data worker, the accessor, or here)."""

    store: Store
    collate: Callable[[list[Message]], Any] | None
    context_length: int
    include_labels: bool
    length_fn: Callable[[Message], int]
    static_len: bool
    static_rows: bool
    seq_keys: tuple[str, ...]
    pack: bool

    def __getitem__(self, step: Step) -> LoadedBatch | bytes:
        if not self.pack:  # here or in the accessor: an exception is raised where it happens
            return self._build(step)
        try:
            return pickle_batch(self._build(step))
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - a data worker reports it: torch would wrap an Exception in
            # a RuntimeError and swallow a KeyboardInterrupt (the worker ignores SIGINT: this one is the user's)
            info = get_worker_info()
            return pickle_batch(_Failed(FailureRecord.capture(exc), info.id if info else 0, os.getpid()))

    def _build(self, step: Step) -> LoadedBatch:
        messages = self.store.observations(step.ids, self.context_length, self.include_labels)
        lengths = [int(self.length_fn(m)) for m in messages]
        rows = step.rows
        tensors = None
        if self.collate is not None and messages:  # a replica's rows of an evaluation batch may all be padding
            tensors = self.collate(messages)
            padded = step.padded_len if self.static_len else None
            if rows > len(messages) or padded is not None:
                tensors = pad_to_shape(tensors, len(messages), rows, padded, self.seq_keys)
        # the length the rows are padded to: the planned one for static shapes, else the longest of these rows (a
        # replica's rows of a combined batch are padded to their own longest, not the combined batch's)
        padded_len = step.padded_len if self.static_len and step.padded_len else max(lengths, default=0)
        return LoadedBatch(tensors, messages, list(step.ids), lengths, rows, padded_len, (step.pass_, step.index))

    def __len__(self) -> int:
        return self.store.pad


@dataclass(frozen=True)
class _Failed:
    """What a data worker sends instead of a batch when building it raised."""

    record: FailureRecord
    worker: int
    pid: int


class _WorkerDeaths:
    """torch's SIGCHLD handler, which raises a bare RuntimeError wherever the main thread is when a data worker
    dies (a kill, out of memory), wrapped to raise :class:`ProcessDied` naming the worker and its signal.

    The raise can be lost: ``threading.Condition.notify`` drops a RuntimeError raised inside it (CPython
    gh-92530), and torch's queue puts notify; the worker, reaped by then, would be noticed only when the next
    get times out. So the death is also kept in ``failure``, which the iterator checks after each batch."""

    def __init__(self, torch_handler: Callable[[int, Any], None], workers: Sequence[Any]):
        self.torch_handler, self.workers = torch_handler, workers
        self.failure: ProcessDied | None = None

    @classmethod
    def install(cls, batches: Any) -> "_WorkerDeaths | None":
        """Wrap the SIGCHLD handler for the workers of ``batches`` (torch's multi-process iterator, which set
        the handler); None without workers, or outside the main thread (handlers are set there only)."""
        workers = getattr(batches, "_workers", None)
        current = signal.getsignal(signal.SIGCHLD)
        if not workers or threading.current_thread() is not threading.main_thread():
            return None
        deaths = cls(current.torch_handler if isinstance(current, cls) else current, workers)
        if callable(deaths.torch_handler):
            signal.signal(signal.SIGCHLD, deaths)
        return deaths

    def died(self) -> ProcessDied | None:
        """A worker that ended with a non-zero code, named; None while all are fine."""
        for index, worker in enumerate(self.workers):
            code = worker.exitcode
            if code:
                return ProcessDied(f"a data worker (--num-workers: worker {index}, pid {worker.pid}) "
                                   f"{describe_exit(code)} (killed from outside, out of memory, or a crash in "
                                   "native code?); the workers were stopped", role="data worker", index=index,
                                   pid=worker.pid, exitcode=code)
        return None

    def __call__(self, signum: int, frame: Any) -> None:
        try:
            self.torch_handler(signum, frame)
        except RuntimeError:
            self.failure = self.died()
            if self.failure is None:
                raise
            raise self.failure from None


def _named_failures(batches: Iterator[Any], timeout_s: float) -> Iterator[Any]:
    """torch's DataLoader iterator, its workers' failures raised as the process family: a worker's exception
    (sent as :class:`_Failed`) with its own types and traceback, a dead or silent worker named."""
    deaths = _WorkerDeaths.install(batches)
    try:
        while True:
            if deaths is not None and deaths.failure is not None:  # raised in the handler and lost on the way
                raise deaths.failure from None
            try:
                item = next(batches)
            except StopIteration:
                return
            yield item
    except RuntimeError as exc:  # torch reports a worker's death or silence as a RuntimeError
        failure = (deaths.failure or deaths.died()) if deaths is not None else None
        if failure is not None:
            raise failure from None
        if str(exc).startswith("DataLoader timed out after"):
            raise ProcessTimeout(f"no batch from the data workers (--num-workers) within --data-timeout-s="
                                 f"{timeout_s:g} s: a worker hangs, or one batch takes longer than that (raise it "
                                 "if so); the workers were stopped", role="data worker") from None
        raise
    finally:  # torch's handler back: the wrapper holds the workers (their pipes) for as long as it is set
        if deaths is not None and threading.current_thread() is threading.main_thread() \
                and signal.getsignal(signal.SIGCHLD) is deaths:
            signal.signal(signal.SIGCHLD, deaths.torch_handler)


class PassLoader(DataLoader):
    """A DataLoader that starts one pass of its sampler per iteration (wherever it is iterated), its workers'
    seeds drawn from a generator of its own (made where it is iterated: a generator does not pickle), so
    starting workers draws nothing from the run's torch generator."""

    seed: int = 0

    def __iter__(self):  # type: ignore[override]
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)
        if self.num_workers and getattr(self, "_iterator", None) is None:  # its workers start now, in this thread
            main = threading.current_thread() is threading.main_thread()
            self.worker_init_fn = functools.partial(init_data_worker, spawned_by=os.getpid() if main else None)
        self.sampler.begin_pass()
        return _named_failures(super().__iter__(), self.timeout)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["generator"] = None
        return state


def identity(x: Any) -> Any:
    return x


def unpickled(items: Iterator[Any]) -> Iterator[Any]:
    """The data workers' pickled batches as objects: the async accessor's transform, so that its process, not
    the consumer, unpickles them, and its shared-memory ring carries their tensors to the consumer uncopied
    (unpickled in the consumer, each batch's tensors would be copied out of its bytes on the training step's path)."""
    try:
        for item in items:
            yield pickle.loads(item) if isinstance(item, bytes) else item
    finally:
        close = getattr(items, "close", None)
        if close is not None:
            close()


def unpacked(items: Iterator[Any]) -> Iterator[Any]:
    """Batches as objects; a data worker's failure raised here, as the user's exception."""
    loaded = unpickled(items)
    try:
        for item in loaded:
            if isinstance(item, _Failed):  # the user's exception as itself (raised_as), as without workers
                raise raised_as(item.record.to_error(
                    "data worker", item.worker, item.pid,
                    name=f"a data worker (--num-workers: worker {item.worker}, pid {item.pid})"))
            yield item
    finally:  # an early stop reaches the source (the accessor resets its pass)
        loaded.close()
