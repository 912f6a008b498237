"""AsyncDataAccessor: a background process loads batches into a shared-memory ring while you compute.

::

    accessor = AsyncDataAccessor(loader, buffer_size=3)      # loader: any re-iterable source of batches
    for epoch in range(3):
        for batch in accessor:          # tensors are VIEWS of a ring slot: valid until the next batch
            keep = batch["label"].clone()   # clone what you keep beyond this iteration
    accessor.terminate()                # or `with AsyncDataAccessor(...) as accessor:`

How it works. At construction one worker process starts; it iterates ``source`` (after ``transform``, or
:func:`~accelbatch.data.rebatch.rebatch` when ``rebatch_size`` is given), copies every tensor of each batch
into a slot of a ring of ``buffer_size + consumer_holds`` shared-memory buffers (``buffer_size`` batches ready
ahead plus the ones the consumer holds) and sends the slot number with the batch pickled once, in one message: the
pickler (C, no Python walk over rows and Messages) sets every tensor aside for the slot. The consumer unpickles it
with those tensors as views of the slot (one pickle load) and hands the slot back once it has received
``consumer_holds`` batches after it (default 1: when the next batch arrives; 2 for a consumer that fetches one
batch ahead while it still reads the current one, as a training loop that stages the next batch's copy to a
device does), whether in this pass or the next one: the end of a pass, ``break`` or an exception hand nothing
back, so the batch in hand stays valid.

Batches: anything picklable holding tensors; tensors go through the ring (a tensor met twice is one view),
the rest is pickled; shapes may change. :func:`pickle_batch`: the cheap payload for data workers' batches.

Epochs: each ``iter(accessor)`` is one pass over ``source``. ``load_indefinitely=True`` (default): at the end
of a pass the worker goes straight on to the next one; ``False``: it waits until the next pass is asked for.
``early_preload=True`` starts loading at construction instead of at the first ``iter``. Leaving a pass early
(``break``, an exception) resets the worker: the next pass starts at the source's first item. One pass at a
time: starting a new pass abandons the old one.

Errors are never a hang, and each stops the worker. An exception in the worker is raised here with its type
when it can be pickled (its traceback as a note, its :class:`~accelbatch.procs.ProcessRaised` as the cause:
:func:`~accelbatch.procs.raised_as`), else, or when not an Exception (a KeyboardInterrupt), as that
ProcessRaised; a data worker's failure passed on is raised the same way. No batch in a pass:
:class:`EmptySourceError` (unless ``empty_passes``: a replica's share of a small split); the worker dies:
:class:`~accelbatch.procs.ProcessDied`; no batch within ``timeout_s``: :class:`~accelbatch.procs.ProcessTimeout`.

Processes and memory. The worker runs under :class:`accelbatch.procs.Supervisor`, forked from the process's
forkserver (:mod:`accelbatch.forkserver`), which has imported torch and this module: fast (tens of ms, against
about 1.5 s for ``spawn``) and, unlike ``fork``, without the caller's threads, locks or CUDA context. The
worker is not a daemon, so ``source`` may start data-loader workers (with the consumer's default start
method). It ignores SIGINT, runs torch with one thread, exits when the consumer dies, and freezes what it
was handed (``gc.freeze()``: the source, often a whole dataset, is then not walked by every full collection,
there and in data workers forked from there, copying its pages). The ring is torch shared memory; with the
``file_descriptor`` strategy its ``/dev/shm`` entries are unlinked at once. :meth:`terminate` (also run by
``with``, garbage collection and interpreter exit) stops the worker.
"""

from __future__ import annotations

import collections
import functools
import gc
import io
import math
import multiprocessing as mp
import pickle
import select
import signal
import sys
import time
from collections.abc import Callable, Iterator
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch

from accelbatch.data.rebatch import rebatch
from accelbatch.procs import (
    ChildSpec,
    FailureRecord,
    ProcessFailure,
    ProcessTimeout,
    Supervisor,
    raised_as,
)

__all__ = ["AsyncDataAccessor", "EmptySourceError", "pickle_batch"]

_ALIGN = 64
_WORKER = ChildSpec(role="data accessor", pipe=True, ignore_sigint=True,
                    label="a data worker (the AsyncDataAccessor process, pid {pid})", stop_request=("stop",),
                    process_name="accelbatch-async-data", stop_grace_s=1.0, died_hint=" before finishing the "
                    "pass (out of memory? a crash in the dataset or collate function?)")

class EmptySourceError(ProcessFailure, ValueError):
    """The source yielded no batch in a pass."""


def _ring_tensor(i: int) -> torch.Tensor:
    """Stands for tensor ``i`` of a pickled batch; :class:`_RingUnpickler` resolves it to a view of the slot."""
    raise RuntimeError("AsyncDataAccessor: a ring tensor reference was unpickled outside the accessor")


class _RingPickler(ForkingPickler):
    """Pickles a batch in one pass (C pickle), each tensor set aside as a reference to its place in the slot.
    ``reducer_override`` is not called for plain ints, strs, lists, dicts: per-row objects cost nothing extra."""

    def __init__(self, file: Any, tensors: list[torch.Tensor]):
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.tensors = tensors

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor):
            if obj.layout != torch.strided:
                raise TypeError(f"AsyncDataAccessor: {obj.layout} tensors are not supported; send dense tensors")
            self.tensors.append(obj.detach())
            return (_ring_tensor, (len(self.tensors) - 1,))
        return NotImplemented


class _RingUnpickler(pickle.Unpickler):
    """Unpickles a batch pickled by :class:`_RingPickler`, its tensors as the given views of the ring slot."""

    def __init__(self, data: bytes, views: list[torch.Tensor]):
        super().__init__(io.BytesIO(data))
        self.views = views

    def find_class(self, module: str, name: str) -> Any:
        if name == "_ring_tensor" and module == __name__:
            return self.views.__getitem__
        return super().find_class(module, name)


def _tensor_from_buffer(data: bytearray, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    if not data:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(data, dtype=torch.uint8).view(dtype).view(shape)


class _ByValuePickler(pickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if type(obj) is torch.Tensor and obj.layout == torch.strided and obj.device.type == "cpu":
            t = obj.detach().contiguous()
            raw = t.reshape(-1).view(torch.uint8) if t.numel() else t.new_empty(0, dtype=torch.uint8)
            return (_tensor_from_buffer, (pickle.PickleBuffer(raw.numpy()), t.dtype, tuple(t.shape)))
        return NotImplemented


def pickle_batch(batch: Any) -> bytes:
    """``batch`` pickled with its (dense CPU) tensors as raw bytes, for a data worker to send as one payload.

    ``pickle.loads`` restores it, each tensor over its own buffer. Several times cheaper than pickle's default
    (one ``torch.save`` per storage) and than torch's shared-memory segments for the small tensors of text."""
    buf = io.BytesIO()
    _ByValuePickler(buf, protocol=5).dump(batch)
    return buf.getvalue()


class _Stop(Exception):
    pass


class _Worker:
    def __init__(self, source: Any, transform: Callable | None, conn: Any, num_slots: int, load_indefinitely: bool,
                 miss_sleep_s: float = 0.0):
        self.source, self.transform = source, transform
        self.miss_sleep_s = miss_sleep_s
        self.conn = conn                            # orders in, batches out
        self.poller = select.poll()                 # one poll object, not a selector per check
        self.poller.register(conn.fileno(), select.POLLIN)
        self.load_indefinitely = load_indefinitely
        self.free = set(range(num_slots))
        self.storages: list[torch.Tensor | None] = [None] * num_slots
        self.restart: tuple[int, int] | None = None
        self.hold_after: int | None = None          # batches of this pass to load before a "go"
        self.restart_hold: int | None = None        # hold_after of the pass asked for by ``restart``

    def _handle(self, msg: tuple) -> None:
        if msg[0] == "free":
            self.free.add(msg[1])
        elif msg[0] == "start":
            self.restart, self.restart_hold = msg[1], (msg[2] if len(msg) > 2 else None)
        elif msg[0] == "go":
            self.hold_after = None
        elif msg[0] == "stop":
            raise _Stop

    def _recv(self) -> None:
        try:
            msg = self.conn.recv()
        except (EOFError, OSError):  # the consumer's end is closed: it is gone
            raise _Stop from None
        self._handle(msg)

    def _drain(self) -> None:
        while self.poller.poll(0):
            self._recv()

    def _acquire(self) -> int | None:
        waited_from = None if self.free else time.monotonic()
        while not self.free:
            self._recv()
            if self.restart is not None:
                return None
        if waited_from is not None and self.miss_sleep_s > 0:
            # a worker that checks for a free slot every miss_sleep_s sees one only at its next check
            elapsed = time.monotonic() - waited_from
            time.sleep(max(0.0, math.ceil(elapsed / self.miss_sleep_s) * self.miss_sleep_s - elapsed))
        return self.free.pop()

    def _write(self, slot: int, batch: Any) -> tuple:
        tensors: list[torch.Tensor] = []
        out = io.BytesIO()
        _RingPickler(out, tensors).dump(batch)
        metas, offset = [], 0
        for t in tensors:
            nbytes = t.numel() * t.element_size()
            metas.append((offset, nbytes, t.dtype, tuple(t.shape)))
            offset += -(-nbytes // _ALIGN) * _ALIGN
        storage, new = self.storages[slot], None
        if storage is None or storage.numel() < offset:
            storage = torch.empty(max(offset + offset // 4, 4096), dtype=torch.uint8).share_memory_()
            self.storages[slot] = new = storage
        for (off, nbytes, dtype, shape), t in zip(metas, tensors):
            storage[off:off + nbytes].view(dtype).view(shape).copy_(t)
        return ("batch", slot, new, out.getvalue(), metas)

    def _iterate(self) -> Iterator[Any]:
        it = iter(self.source)
        return self.transform(it) if self.transform is not None else it

    def run_pass(self, epoch: tuple[int, int]) -> bool:
        """Load one pass; True if it ended normally, False if a restart was asked for."""
        count = 0
        batches = self._iterate()
        try:
            for batch in batches:
                slot = self._acquire()
                if slot is None:
                    return False
                kind, slot, new, blob, metas = self._write(slot, batch)
                self.conn.send((kind, epoch, slot, new, blob, metas))
                count += 1
                self._drain()
                while self.hold_after is not None and count >= self.hold_after and self.restart is None:
                    self._recv()  # held (see AsyncDataAccessor.start_pass): wait for "go" (or other orders)
                if self.restart is not None:
                    return False
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
            del batches
        self.conn.send(("end", epoch, count))
        return True

    def main(self, epoch: tuple[int, int] | None) -> None:
        while True:
            if epoch is None:
                self._recv()
                epoch = self._take_restart()
                continue
            try:
                finished = self.run_pass(epoch)
            except (_Stop, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # noqa: BLE001 - the source failed: report and wait for orders
                record = FailureRecord.capture(exc)
                self.conn.send(("error", epoch, record))
                epoch = None
                continue
            if finished:  # pass ids are (generation, number): the consumer bumps the generation to restart
                epoch = (epoch[0], epoch[1] + 1) if self.load_indefinitely else None
                self.hold_after = None
            if self.restart is not None:
                epoch = self._take_restart()

    def _take_restart(self) -> tuple[int, int] | None:
        """The pass asked for by the last "start" order (with its hold), now the current one."""
        epoch, self.restart, self.hold_after = self.restart, None, self.restart_hold
        return epoch


def _exit_on_sigterm(*_: Any) -> None:
    """End the worker, running cleanup (which stops the source's own workers, e.g. a DataLoader's)."""
    sys.exit(0)


def _worker_main(index: int, conn: Any, source: Any, transform: Callable | None, num_slots: int,
                 load_indefinitely: bool, first_epoch: tuple[int, int] | None, start_method: str | None,
                 miss_sleep_s: float = 0.0) -> None:
    """The worker process (under the supervisor's entry wrapper, which ignores SIGINT and sets one thread)."""
    # a forkserver child has 'forkserver' as its default: give the source the consumer's, as if it ran there
    mp.set_start_method(start_method or mp.get_all_start_methods()[0], force=True)
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    gc.freeze()  # what it was handed lives as long as the process (see the module docstring)
    try:
        _Worker(source, transform, conn, num_slots, load_indefinitely, miss_sleep_s).main(first_epoch)
    except (_Stop, BrokenPipeError):
        pass
    finally:
        # the source's own workers (a DataLoader's) still running are ended as this process exits: expected
        # deaths, which torch's SIGCHLD handler (installed by a DataLoader) would report as failures
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        # exiting already: a stop's SIGTERM that comes while the exit functions run (a slow finalizer under
        # load outlasts the grace) has nothing left to end, and raised in one of them it would be printed
        signal.signal(signal.SIGTERM, signal.SIG_IGN)


class AsyncDataAccessor:
    """Iterate ``source`` in a background process through a shared-memory ring (see the module docstring).

    ``rebatch_size``: re-form batches of exactly this many rows in the worker
    (:func:`~accelbatch.data.rebatch.rebatch`, dropping the last partial one unless
    ``rebatch_drop_last=False``). ``transform``: any picklable ``iterator -> iterator`` applied in the worker
    instead. ``source`` and ``transform`` must be picklable (they are sent to the worker).
    ``consumer_holds``: how many of the latest batches received stay valid (see the module docstring).
    ``miss_sleep_s``: with every slot full, the worker takes a freed slot only at its next check, one every
    ``miss_sleep_s`` seconds (PopTorch's polling worker; 0, the default: at once). It waits without polling.
    """

    def __init__(self, source: Any, buffer_size: int = 3, early_preload: bool = False,
                 load_indefinitely: bool = True, rebatch_size: int | None = None, timeout_s: float = 60.0,
                 *, rebatch_drop_last: bool = True, transform: Callable[[Iterator[Any]], Iterator[Any]] | None = None,
                 miss_sleep_s: float = 0.0, empty_passes: bool = False, consumer_holds: int = 1):
        for name, value in (("buffer_size", buffer_size), ("consumer_holds", consumer_holds)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"AsyncDataAccessor: {name} must be a positive integer, got {value!r}")
        if isinstance(miss_sleep_s, bool) or not isinstance(miss_sleep_s, (int, float)) or miss_sleep_s < 0:
            raise ValueError(f"AsyncDataAccessor: miss_sleep_s must be a number >= 0, got {miss_sleep_s!r}")
        if timeout_s <= 0:
            raise ValueError(f"AsyncDataAccessor: timeout_s must be positive, got {timeout_s!r}")
        if rebatch_size is not None:
            if transform is not None:
                raise ValueError("AsyncDataAccessor: give rebatch_size or transform, not both")
            if isinstance(rebatch_size, bool) or not isinstance(rebatch_size, int) or rebatch_size < 1:
                raise ValueError(f"AsyncDataAccessor: rebatch_size must be a positive integer, got {rebatch_size!r}")
            transform = functools.partial(rebatch, batch_size=rebatch_size, drop_last=rebatch_drop_last)
        if not hasattr(source, "__iter__") and not hasattr(source, "__getitem__"):
            raise TypeError(f"AsyncDataAccessor: the source must be iterable, got {type(source).__name__}")
        self.source, self.transform, self.empty_passes = source, transform, empty_passes
        self.buffer_size, self.timeout_s = buffer_size, float(timeout_s)
        self.early_preload, self.load_indefinitely, self.rebatch_size = early_preload, load_indefinitely, rebatch_size
        self._slots: dict[int, torch.Tensor] = {}
        self._held: collections.deque[int] = collections.deque()  # slots of the latest batches handed out
        self.consumer_holds = consumer_holds
        self._epoch = (0, 0)     # id of the pass the worker is loading (or will load when told)
        self._loading = False    # whether the worker has been told to load self._epoch
        self._pass_token = 0     # which iterator is the live one
        self._in_pass = False    # an iterator has started and not finished its pass
        self._free_msgs: dict[int, bytes] = {}
        self._worker: Supervisor | None = None
        try:
            self._worker = Supervisor(_WORKER, _worker_main, 1, args=(
                source, transform, buffer_size + consumer_holds, load_indefinitely,
                self._epoch if early_preload else None,
                mp.get_start_method(allow_none=True), float(miss_sleep_s)))
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            raise TypeError(f"AsyncDataAccessor: the source (or transform) cannot be sent to the worker "
                            f"process: {exc}; define datasets and collate functions at module level") from exc
        self._loading = early_preload

    def terminate(self) -> None:
        """Stop the worker process and free the ring; the accessor cannot be iterated afterwards."""
        if self._worker is not None:
            self._worker.stop()
        self._slots, self._worker = {}, None
        self._held.clear()

    close = terminate

    def __enter__(self) -> "AsyncDataAccessor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.terminate()

    @property
    def worker_pid(self) -> int | None:
        return None if self._worker is None else self._worker.pids[0]

    def __len__(self) -> int:
        if self.transform is not None:
            raise TypeError("AsyncDataAccessor: the number of batches is unknown when rebatching or "
                            "transforming in the worker")
        return len(self.source)

    def _fail(self, error: BaseException) -> None:
        self.terminate()
        raise error

    def _receive(self) -> tuple:
        try:
            got = self._worker.receive(self.timeout_s)
        except ProcessFailure as error:  # it raised outside a pass, or ended
            self._fail(raised_as(error))
        if got is None:
            self._fail(ProcessTimeout(
                f"AsyncDataAccessor: no batch from the worker process (pid {self.worker_pid}) within "
                f"timeout_s={self.timeout_s:g} s; the source is hanging or slower than that (raise timeout_s, "
                "--data-timeout-s on the command line, if one batch really takes longer)", role=_WORKER.role,
                index=0, pid=self.worker_pid))
        return got[1]

    def _tell(self, msg: Any, raw: bool = False) -> bool:
        """Send the worker an order; False if it is stopped or gone (the next receive says why)."""
        try:
            self._worker.send(0, msg, raw=raw)
            return True
        except (RuntimeError, AttributeError):
            return False

    def _free(self, slot: int) -> None:
        msg = self._free_msgs.get(slot)
        if msg is None:
            msg = self._free_msgs[slot] = bytes(ForkingPickler.dumps(("free", slot)))
        self._tell(msg, raw=True)

    def _hold(self, slot: int) -> None:
        """Hold ``slot``, of a batch handed out, and hand back all but the latest ``consumer_holds``."""
        self._held.append(slot)
        while len(self._held) > self.consumer_holds:
            self._free(self._held.popleft())

    def _build(self, msg: tuple) -> Any:
        _, _, slot, new, blob, metas = msg
        if new is not None:
            self._slots[slot] = new
        storage = self._slots[slot]
        views = [storage[off:off + nbytes].view(dtype).view(shape) for off, nbytes, dtype, shape in metas]
        return _RingUnpickler(blob, views).load()

    def _raise_worker_error(self, record: FailureRecord) -> None:
        """Raise what the source raised in the worker (see the module docstring)."""
        pid = self.worker_pid
        failure = record.to_error(_WORKER.role, 0, pid, name=_WORKER.label.format(pid=pid))
        self.terminate()
        raise raised_as(failure, f"the AsyncDataAccessor worker process, pid {pid}")

    def __iter__(self) -> Iterator[Any]:
        return self.start_pass()

    def start_pass(self, hold_after: int | None = None) -> Iterator[Any]:
        """``iter(accessor)``; with ``hold_after=n`` the worker loads only the first ``n`` batches of this pass
        until :meth:`release` (no effect when it is already loading the pass: early preload, or the pass after
        a finished one with ``load_indefinitely``)."""
        if hold_after is not None and (isinstance(hold_after, bool) or not isinstance(hold_after, int)
                                       or hold_after < 1):
            raise ValueError(f"AsyncDataAccessor: hold_after must be a positive integer, got {hold_after!r}")
        if self._worker is None:
            raise RuntimeError("AsyncDataAccessor: this accessor was terminated; create a new one")
        self._pass_token += 1
        token = self._pass_token
        if self._in_pass:  # an earlier iterator is still mid-pass: abandon it and restart
            self._restart()
        if not self._loading:
            self._loading = self._tell(("start", self._epoch, hold_after))
        return self._generate(token, self._epoch)

    def release(self) -> None:
        """Let the worker load the rest of a pass started with ``hold_after``."""
        if self._worker is not None:
            self._tell(("go",))

    def _restart(self) -> None:
        self._epoch = (self._epoch[0] + 1, 0)
        self._in_pass = False
        self._loading = self._tell(("start", self._epoch))

    def _generate(self, token: int, epoch: tuple[int, int]) -> Iterator[Any]:
        finished = False
        self._in_pass = True
        try:
            while True:
                if token != self._pass_token:
                    raise RuntimeError("AsyncDataAccessor: another pass over this accessor was started; "
                                       "this one was abandoned")
                msg = self._receive()
                kind = msg[0]
                if msg[1] != epoch:   # left over from an abandoned pass
                    if kind == "batch":
                        if msg[3] is not None:
                            self._slots[msg[2]] = msg[3]
                        self._free(msg[2])
                    continue
                if kind == "batch":
                    batch = self._build(msg)
                    self._hold(msg[2])
                    yield batch
                elif kind == "end":
                    finished = True
                    self._in_pass = False
                    self._epoch, self._loading = (epoch[0], epoch[1] + 1), self.load_indefinitely
                    if msg[2] == 0 and not self.empty_passes:
                        self._fail(EmptySourceError(
                            "AsyncDataAccessor: the source yielded no batches (an empty dataset, or fewer "
                            "rows than one batch with drop_last?)", role=_WORKER.role, index=0,
                            pid=self.worker_pid))
                    return
                elif kind == "error":
                    finished = True
                    self._raise_worker_error(msg[2])
        finally:
            if not finished and token == self._pass_token and self._worker is not None:
                self._restart()  # left early: the next pass starts at the source's first item
