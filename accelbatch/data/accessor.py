"""AsyncDataAccessor: a background process loads batches into a shared-memory ring while you compute.

::

    accessor = AsyncDataAccessor(loader, buffer_size=3)      # loader: any re-iterable source of batches
    for epoch in range(3):
        for batch in accessor:          # tensors are VIEWS of a ring slot: valid until the next batch
            keep = batch["label"].clone()   # clone what you keep beyond this iteration
    accessor.terminate()                # or `with AsyncDataAccessor(...) as accessor:`

How it works. At construction one worker process starts; it iterates ``source`` (after ``transform``, or
:func:`~accelbatch.data.rebatch.rebatch` when ``rebatch_size`` is given), copies every tensor of each batch
into a slot of a ring of ``buffer_size + 1`` shared-memory buffers (``buffer_size`` batches ready ahead
plus the one the consumer holds) and sends the slot number with the batch pickled once, in one message:
the pickler (C, no Python walk over the batch's rows and Messages) sets every tensor aside for the slot and
leaves a reference in its place. The consumer unpickles it with those references resolved to views of the
slot (one pickle load, no per-leaf Python work) and hands the slot back when it asks for the next batch.

Batches: a tensor, or anything picklable holding tensors (tuples, named tuples, lists, dicts, dataclasses,
objects); tensors go through the ring (a tensor met twice is one view), everything else is pickled.
Shapes may change from batch to batch (a slot grows when a batch does not fit). :func:`pickle_batch` is
the matching cheap payload for data workers that send batches to this process (tensors as raw bytes).

Epochs: each ``iter(accessor)`` is one pass over ``source``. ``load_indefinitely=True`` (default): at the
end of a pass the worker goes straight on to the next one, so the next epoch's first batches are ready when
asked for; ``False``: the worker waits until the next pass is asked for. ``early_preload=True`` starts
loading at construction instead of at the first ``iter``. Leaving a pass early (``break``, an exception)
resets the worker: the next pass starts at the source's first item. One pass at a time: starting a new
pass abandons the old one.

Errors are never a hang: an exception in the worker is raised in the consumer with its type when it can be
pickled, the worker's traceback attached as a note and as the cause; a source with no batches raises
:class:`EmptySourceError`; a worker that dies raises :class:`WorkerDiedError`; waiting longer than
``timeout_s`` for one batch raises :class:`WorkerTimeoutError`. In each case the worker is stopped.

Processes and memory. The worker is started from a ``forkserver`` context: forking from a fresh server
process that has already imported torch and this module is fast (tens of ms after the first start, against
about a second and a half for ``spawn`` re-importing torch each time) and, unlike ``fork``, does not copy the
caller's threads, locks or CUDA context into the child. (Setting the server's preload list is process-wide;
it only takes effect when the server first starts.) The worker is not a daemon, so ``source`` may itself
start data-loader workers. The ring is made of torch shared-memory tensors; with torch's default
``file_descriptor`` sharing strategy their ``/dev/shm`` entries are unlinked as soon as they are created, so
no segment can outlive the processes. :meth:`terminate` (also run by ``with``, by garbage collection and at
interpreter exit) stops the worker (request, then SIGTERM, then SIGKILL); the worker ignores SIGINT so that
Ctrl-C reaches the consumer only, and it exits by itself when the consumer process dies. The worker runs
torch with one thread (it copies batches; a source that computes should use its own data workers), and
gives the source the consumer's default start method, so a torch DataLoader inside starts its workers as it
would in the consumer. It freezes what it was handed (``gc.freeze()``): the source, often a whole dataset
unpickled there, lives as long as the worker, and left to the collector it would be walked by every full
collection, there and in each data worker forked from there (copying the pages it touches).
"""

from __future__ import annotations

import functools
import gc
import io
import multiprocessing as mp
import pickle
import select
import signal
import sys
import time
import traceback
import weakref
from multiprocessing.reduction import ForkingPickler
from typing import Any, Callable, Iterable, Iterator

import torch

from accelbatch.data.rebatch import rebatch

__all__ = ["AsyncDataAccessor", "pickle_batch", "AccessorError", "EmptySourceError", "WorkerDiedError",
           "WorkerTimeoutError"]

_ALIGN = 64
_POLL_S = 0.2


class AccessorError(RuntimeError):
    """The async data accessor cannot deliver batches."""


class EmptySourceError(AccessorError, ValueError):
    """The source yielded no batch in a pass."""


class WorkerDiedError(AccessorError):
    """The worker process exited without finishing its pass."""


class WorkerTimeoutError(AccessorError, TimeoutError):
    """No batch came from the worker within ``timeout_s``."""


class WorkerTraceback(Exception):
    """The traceback text of an exception raised in the worker process (set as the re-raised error's cause)."""

    def __str__(self) -> str:
        return "\n" + self.args[0]


def _ring_tensor(i: int) -> torch.Tensor:
    """Stands for tensor number ``i`` of a batch in its pickled structure; the consumer's unpickler resolves
    it to a view of the ring slot (see :class:`_RingUnpickler`)."""
    raise AccessorError("AsyncDataAccessor: a ring tensor reference was unpickled outside the accessor")


class _RingPickler(ForkingPickler):
    """Pickles a batch in one pass (C pickle, no Python walk over its structure), setting its tensors aside:
    each tensor is pickled as a reference to its place in the ring slot. ``reducer_override`` is called only
    for objects that are not plain ints, strs, lists, dicts, ..., so per-row Python objects cost nothing extra."""

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

    ``pickle.loads`` restores it; each tensor comes back as a plain tensor over its own buffer. Several times
    cheaper than pickle's default for tensors (one ``torch.save`` per storage) and than torch's per-tensor
    shared-memory segments and file descriptors for the small tensors of text batches."""
    buf = io.BytesIO()
    _ByValuePickler(buf, protocol=5).dump(batch)
    return buf.getvalue()


class _Stop(Exception):
    pass


def _context() -> mp.context.BaseContext:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["accelbatch.data.accessor"])
    return ctx


# --------------------------------------------------------------------------------------------------
# worker process
# --------------------------------------------------------------------------------------------------

class _Worker:
    def __init__(self, source: Any, transform: Callable | None, control: Any, ready: Any, num_slots: int,
                 load_indefinitely: bool):
        self.source, self.transform = source, transform
        self.control, self.ready = control, ready   # pipe ends: orders in, batches out
        self.poller = select.poll()                 # one poll object, not a selector per check
        self.poller.register(control.fileno(), select.POLLIN)
        self.load_indefinitely = load_indefinitely
        self.free = set(range(num_slots))
        self.storages: list[torch.Tensor | None] = [None] * num_slots
        self.restart: tuple[int, int] | None = None

    # control messages ------------------------------------------------------------------------
    def _handle(self, msg: tuple) -> None:
        if msg[0] == "free":
            self.free.add(msg[1])
        elif msg[0] == "start":
            self.restart = msg[1]
        elif msg[0] == "stop":
            raise _Stop

    def _recv(self) -> None:
        try:
            msg = self.control.recv()
        except (EOFError, OSError):  # the consumer's end is closed: it is gone
            raise _Stop from None
        self._handle(msg)

    def _wait_message(self) -> None:
        self.control.poll(None)
        self._recv()

    def _drain(self) -> None:
        while self.poller.poll(0):
            self._recv()

    def _acquire(self) -> int | None:
        while not self.free:
            self._wait_message()
            if self.restart is not None:
                return None
        return self.free.pop()

    # one batch -------------------------------------------------------------------------------
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

    # passes ------------------------------------------------------------------------------------
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
                self.ready.send((kind, epoch, slot, new, blob, metas))
                count += 1
                self._drain()
                if self.restart is not None:
                    return False
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()
            del batches
        self.ready.send(("end", epoch, count))
        return True

    def main(self, epoch: tuple[int, int] | None) -> None:
        while True:
            if epoch is None:
                self._wait_message()
                epoch, self.restart = self.restart, None
                continue
            try:
                finished = self.run_pass(epoch)
            except (_Stop, KeyboardInterrupt, SystemExit):
                raise
            except BaseException as exc:  # the source failed: report and wait for orders
                # a data worker's exception carries that worker's traceback: more use than this process's
                text = getattr(exc, "worker_traceback", None) or traceback.format_exc()
                self.ready.send(("error", epoch, pickle_exception(exc), f"{type(exc).__name__}: {exc}", text))
                epoch = None
                continue
            if finished:  # pass ids are (generation, number): the consumer bumps the generation to restart
                epoch = (epoch[0], epoch[1] + 1) if self.load_indefinitely else None
            if self.restart is not None:
                epoch, self.restart = self.restart, None


def pickle_exception(exc: BaseException) -> bytes | None:
    """``exc`` pickled for another process, or None if it does not survive the round trip."""
    try:
        data = pickle.dumps(exc)
        pickle.loads(data)
        return data
    except Exception:
        return None


def unpickle_exception(data: bytes | None, fallback: str) -> BaseException:
    """The exception :func:`pickle_exception` sent, or an :class:`AccessorError` saying ``fallback``."""
    exc: Any = None
    if data is not None:
        try:
            exc = pickle.loads(data)
        except Exception:
            exc = None
    return exc if isinstance(exc, BaseException) else AccessorError(fallback)


def _worker_main(source: Any, transform: Callable | None, control: Any, ready: Any, num_slots: int,
                 load_indefinitely: bool, first_epoch: tuple[int, int] | None, start_method: str | None) -> None:
    # A forkserver child inherits 'forkserver' as its default start method; give the source (e.g. a torch
    # DataLoader starting its own workers) the consumer's default instead, as if it ran there.
    mp.set_start_method(start_method or mp.get_all_start_methods()[0], force=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)          # Ctrl-C is the consumer's to handle
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # run cleanup (stops the source's own workers)
    torch.set_num_threads(1)
    # what this process was handed (the source: often a whole dataset, unpickled here, so all young objects)
    # lives as long as the process: out of the collector's reach, it is not walked by every full collection
    # here nor in the data workers forked from here (whose walks would also copy each page they touch)
    gc.freeze()
    worker = _Worker(source, transform, control, ready, num_slots, load_indefinitely)
    try:
        worker.main(first_epoch)
    except (_Stop, BrokenPipeError):
        pass
    finally:
        ready.close()
        control.close()


# --------------------------------------------------------------------------------------------------
# consumer side
# --------------------------------------------------------------------------------------------------

def _shutdown(process: Any, control: Any, ready: Any) -> None:
    """Stop the worker and close the pipes (idempotent; used by terminate, GC and atexit)."""
    try:
        if process is not None and process.pid is not None:
            if process.is_alive():
                try:
                    control.send(("stop",))
                except Exception:
                    pass
                process.join(1.0)
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join(2.0)
            try:
                process.close()
            except ValueError:
                pass
    finally:
        for conn in (control, ready):
            try:
                conn.close()
            except Exception:
                pass


def _rebatch_transform(it: Iterable[Any], batch_size: int, drop_last: bool) -> Iterator[Any]:
    return rebatch(it, batch_size, drop_last)


class AsyncDataAccessor:
    """Iterate ``source`` in a background process through a shared-memory ring (see the module docstring).

    ``rebatch_size``: re-form batches of exactly this many rows in the worker
    (:func:`~accelbatch.data.rebatch.rebatch`, dropping the last partial one unless
    ``rebatch_drop_last=False``). ``transform``: any picklable ``iterator -> iterator`` applied in the worker
    instead. ``source`` and ``transform`` must be picklable (they are sent to the worker).
    """

    def __init__(self, source: Any, buffer_size: int = 3, early_preload: bool = False,
                 load_indefinitely: bool = True, rebatch_size: int | None = None, timeout_s: float = 60.0,
                 *, rebatch_drop_last: bool = True, transform: Callable[[Iterator[Any]], Iterator[Any]] | None = None):
        if isinstance(buffer_size, bool) or not isinstance(buffer_size, int) or buffer_size < 1:
            raise ValueError(f"AsyncDataAccessor: buffer_size must be a positive integer, got {buffer_size!r}")
        if timeout_s <= 0:
            raise ValueError(f"AsyncDataAccessor: timeout_s must be positive, got {timeout_s!r}")
        if rebatch_size is not None:
            if transform is not None:
                raise ValueError("AsyncDataAccessor: give rebatch_size or transform, not both")
            if isinstance(rebatch_size, bool) or not isinstance(rebatch_size, int) or rebatch_size < 1:
                raise ValueError(f"AsyncDataAccessor: rebatch_size must be a positive integer, got {rebatch_size!r}")
            transform = functools.partial(_rebatch_transform, batch_size=rebatch_size, drop_last=rebatch_drop_last)
        if not hasattr(source, "__iter__") and not hasattr(source, "__getitem__"):
            raise TypeError(f"AsyncDataAccessor: the source must be iterable, got {type(source).__name__}")
        self.source, self.transform = source, transform
        self.buffer_size, self.timeout_s = buffer_size, float(timeout_s)
        self.early_preload, self.load_indefinitely = early_preload, load_indefinitely
        self.rebatch_size = rebatch_size
        self._slots: dict[int, torch.Tensor] = {}
        self._epoch = (0, 0)     # id of the pass the worker is loading (or will load when told)
        self._loading = False    # whether the worker has been told to load self._epoch
        self._pass_token = 0     # which iterator is the live one
        self._in_pass = False    # an iterator has started and not finished its pass
        self._process = None
        self._finalizer: weakref.finalize | None = None
        self._start_worker()

    # lifecycle -------------------------------------------------------------------------------
    def _start_worker(self) -> None:
        ctx = _context()
        control_r, self._control = ctx.Pipe(duplex=False)   # consumer -> worker: start / free / stop
        self._ready, ready_w = ctx.Pipe(duplex=False)       # worker -> consumer: batch / end / error
        first = self._epoch if self.early_preload else None
        self._process = ctx.Process(
            target=_worker_main, name="accelbatch-async-data",
            args=(self.source, self.transform, control_r, ready_w, self.buffer_size + 1,
                  self.load_indefinitely, first, mp.get_start_method(allow_none=True)),
            daemon=False)
        try:
            self._process.start()
        except (pickle.PicklingError, TypeError, AttributeError) as exc:
            _shutdown(None, self._control, self._ready)
            raise TypeError(f"AsyncDataAccessor: the source (or transform) cannot be sent to the worker "
                            f"process: {exc}; define datasets and collate functions at module level") from exc
        finally:  # the worker holds its own copies now
            control_r.close()
            ready_w.close()
        self._loading = self.early_preload
        self._slots = {}
        self._free_msgs: dict[int, bytes] = {}
        self._poller = select.poll()
        self._poller.register(self._ready.fileno(), select.POLLIN)
        self._finalizer = weakref.finalize(self, _shutdown, self._process, self._control, self._ready)

    def terminate(self) -> None:
        """Stop the worker process and free the ring; the accessor cannot be iterated afterwards."""
        if self._finalizer is not None:
            self._finalizer()
        self._slots, self._process, self._finalizer = {}, None, None
        self._control = self._ready = None

    close = terminate

    def __enter__(self) -> "AsyncDataAccessor":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.terminate()

    @property
    def worker_pid(self) -> int | None:
        return None if self._process is None else self._process.pid

    def __len__(self) -> int:
        if self.transform is not None:
            raise TypeError("AsyncDataAccessor: the number of batches is unknown when rebatching or "
                            "transforming in the worker")
        return len(self.source)

    # receiving -------------------------------------------------------------------------------
    def _fail(self, error: BaseException) -> None:
        self.terminate()
        raise error

    def _receive(self) -> tuple:
        deadline = time.monotonic() + self.timeout_s
        while True:
            closed = False
            try:
                if self._poller.poll(_POLL_S * 1000):
                    return self._ready.recv()
            except (EOFError, OSError):
                closed = True   # the worker's end of the pipe is closed: it is exiting
                self._process.join(_POLL_S)
            if closed or not self._process.is_alive():
                code = self._process.exitcode
                how = (f"was killed by signal {-code}" if code is not None and code < 0 else
                       f"exited with code {code}" if code is not None else "closed its pipe")
                self._fail(WorkerDiedError(
                    f"AsyncDataAccessor: the worker process (pid {self._process.pid}) {how} before finishing "
                    "the pass (out of memory? a crash in the dataset or collate function?)"))
            if time.monotonic() > deadline:
                self._fail(WorkerTimeoutError(
                    f"AsyncDataAccessor: no batch from the worker process (pid {self._process.pid}) within "
                    f"timeout_s={self.timeout_s:g} s; the source is hanging or slower than that (raise "
                    "timeout_s, --data-timeout-s on the command line, if one batch really takes longer)"))

    def _free(self, slot: int) -> None:
        try:
            msg = self._free_msgs.get(slot)
            if msg is None:
                msg = self._free_msgs[slot] = bytes(ForkingPickler.dumps(("free", slot)))
            self._control.send_bytes(msg)
        except (ValueError, OSError, AttributeError):
            pass

    def _build(self, msg: tuple) -> Any:
        _, _, slot, new, blob, metas = msg
        if new is not None:
            self._slots[slot] = new
        storage = self._slots[slot]
        views = [storage[off:off + nbytes].view(dtype).view(shape) for off, nbytes, dtype, shape in metas]
        return _RingUnpickler(blob, views).load()

    def _raise_worker_error(self, msg: tuple) -> None:
        _, _, data, summary, tb = msg
        pid = self._process.pid
        self.terminate()
        exc = unpickle_exception(data, f"AsyncDataAccessor: the worker raised {summary}")
        exc.add_note(f"(raised in the AsyncDataAccessor worker process, pid {pid}; its traceback:)\n{tb}")
        raise exc from WorkerTraceback(tb)

    def __iter__(self) -> Iterator[Any]:
        if self._process is None:
            raise AccessorError("AsyncDataAccessor: this accessor was terminated; create a new one")
        self._pass_token += 1
        token = self._pass_token
        if self._in_pass:  # an earlier iterator is still mid-pass: abandon it and restart
            self._restart()
        if not self._loading:
            self._control.send(("start", self._epoch))
            self._loading = True
        return self._generate(token, self._epoch)

    def _restart(self) -> None:
        self._epoch = (self._epoch[0] + 1, 0)
        self._in_pass = False
        try:
            self._control.send(("start", self._epoch))
            self._loading = True
        except (ValueError, OSError, AttributeError):
            self._loading = False

    def _generate(self, token: int, epoch: tuple[int, int]) -> Iterator[Any]:
        held: int | None = None
        finished = False
        self._in_pass = True
        try:
            while True:
                if token != self._pass_token:
                    raise AccessorError("AsyncDataAccessor: another pass over this accessor was started; "
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
                    if held is not None:
                        self._free(held)
                    held = msg[2]
                    yield batch
                elif kind == "end":
                    finished = True
                    if held is not None:
                        self._free(held)
                        held = None
                    self._in_pass = False
                    self._epoch, self._loading = (epoch[0], epoch[1] + 1), self.load_indefinitely
                    if msg[2] == 0:
                        self._fail(EmptySourceError(
                            "AsyncDataAccessor: the source yielded no batches (an empty dataset, or fewer "
                            "rows than one batch with drop_last?)"))
                    return
                elif kind == "error":
                    finished = True
                    self._raise_worker_error(msg)
        finally:
            if held is not None:
                self._free(held)
            if not finished and token == self._pass_token and self._process is not None:
                self._restart()  # left early: the next pass starts at the source's first item
