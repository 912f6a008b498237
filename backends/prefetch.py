"""Feeding a device: pinned host memory, copies on a side stream, and counting host synchronisations.

An engine copies rows on a side stream while earlier work computes on the current stream (the rows of the
next update of a call, or a whole later call given to ``Engine.stage``). Three rules make that correct on
CUDA:

1. the source is page-locked (pinned), or ``non_blocking=True`` silently becomes a synchronous copy;
2. the consumer's stream waits for the copy (an event recorded on the side stream after the copy, waited on
   by the consumer's stream) before any kernel reads the batch -- the host never blocks for this;
3. every device tensor is marked as used by the consumer's stream (``record_stream``), because it was
   allocated on the side stream: without that, the caching allocator could hand its memory to the next copy
   while the consumer's kernels still read it.

All stream work goes through :class:`StreamAPI`, a small seam with a CUDA implementation
(:class:`CUDAStreams`); tests drive the same :class:`StreamCopier` with a fake one and check the order of
copies, event records, waits and ``record_stream`` calls. On a machine without a device,
:class:`PassthroughCopier` is a plain (optionally ``.to(device)``) copy.

:func:`count_host_syncs` counts the calls that make the host wait for a device (``torch.cuda.synchronize``,
stream/event ``synchronize``, and ``item``/``tolist``/``numpy``/``cpu``/``bool``/``float``/``int``/a blocking
``.to("cpu")`` of device tensors).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

__all__ = [
    "CUDAStreams",
    "Copier",
    "PassthroughCopier",
    "Pending",
    "StreamAPI",
    "StreamCopier",
    "SyncCount",
    "copier_for",
    "count_host_syncs",
    "map_tensors",
    "tensors_of",
]


# --- batches as trees of tensors ----------------------------------------------------------------------

def map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """``obj`` with each tensor ``t`` (in dicts, lists, tuples) replaced by ``fn(t)``; other leaves kept."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return type(obj)((k, map_tensors(v, fn)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(map_tensors(v, fn) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(map_tensors(v, fn) for v in obj)
    return obj


def tensors_of(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj`` (dicts, lists, tuples), in order."""
    found: list[torch.Tensor] = []
    map_tensors(obj, found.append)
    return found


# --- the stream seam ------------------------------------------------------------------------------------

class StreamAPI(Protocol):
    """What :class:`StreamCopier` needs from a device with streams (CUDA, or a fake in tests)."""

    device: torch.device

    def new_stream(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def use_stream(self, stream: Any) -> contextlib.AbstractContextManager: ...
    def new_event(self) -> Any: ...
    def record_event(self, event: Any, stream: Any) -> None: ...
    def wait_event(self, stream: Any, event: Any) -> None: ...
    def pin(self, t: torch.Tensor) -> torch.Tensor: ...
    def copy_async(self, t: torch.Tensor) -> torch.Tensor: ...
    def record_stream(self, t: torch.Tensor, stream: Any) -> None: ...
    def on_device(self, t: torch.Tensor) -> bool: ...


class CUDAStreams:
    """:class:`StreamAPI` on a CUDA device."""

    def __init__(self, device: torch.device | str | int | None = None):
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if dev.type != "cuda":
            raise ValueError(f"CUDAStreams needs a cuda device, got {dev}")
        self.device = dev if dev.index is not None else torch.device("cuda", torch.cuda.current_device())

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> contextlib.AbstractContextManager:
        return torch.cuda.stream(stream)

    def new_event(self) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record_event(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait_event(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def pin(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.is_pinned() else t.pin_memory()

    def copy_async(self, t: torch.Tensor) -> torch.Tensor:
        return t.to(self.device, non_blocking=True)

    def record_stream(self, t: torch.Tensor, stream: torch.cuda.Stream) -> None:
        t.record_stream(stream)

    def on_device(self, t: torch.Tensor) -> bool:
        return t.device == self.device


# --- copiers --------------------------------------------------------------------------------------------

@dataclass
class Pending:
    """A batch whose copy has been issued; ``ready`` (an event) says when it has landed."""

    batch: Any                      # the device-side batch (its contents valid once ``ready`` has fired)
    ready: Any = None               # an event on the copy stream, or None when nothing was copied
    host: Any = None                # the pinned source, kept alive until the copy is waited for
    copied: list[torch.Tensor] = field(default_factory=list)  # the device tensors the copy wrote


class Copier(Protocol):
    """Moves host batches to the device: ``start`` issues the copy, ``finish`` makes it safe to use."""

    device: torch.device

    def start(self, batch: Any) -> Pending: ...
    def finish(self, pending: Pending) -> Any: ...


class PassthroughCopier:
    """A copier with no streams: a blocking ``.to(device)`` (nothing at all when already there)."""

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def start(self, batch: Any) -> Pending:
        return Pending(map_tensors(batch, lambda t: t.to(self.device)))

    def finish(self, pending: Pending) -> Any:
        return pending.batch


class StreamCopier:
    """Pinned, non-blocking copies on a side stream, waited for by the consumer's stream (see module doc).

    :meth:`pin_ahead` pins a batch on a helper thread (one, started when first needed), so that a batch
    staged ahead is pinned while the calling thread steps the current one; ``start(pinned, pinned=True)``
    then only issues the copies.
    """

    def __init__(self, api: StreamAPI, pin: bool = True):
        self.api = api
        self.device = api.device
        self.pin = pin
        self.stream = api.new_stream()
        self._pinner: ThreadPoolExecutor | None = None

    def _pinned(self, t: torch.Tensor) -> torch.Tensor:
        return self.api.pin(t) if t.device.type == "cpu" and not self.api.on_device(t) else t

    def pin_ahead(self, batch: Any) -> Future | None:
        """Start pinning ``batch``'s host tensors off the calling thread; the future gives the pinned batch
        (None when this copier does not pin)."""
        if not self.pin:
            return None
        if self._pinner is None:
            self._pinner = ThreadPoolExecutor(1, thread_name_prefix="accelbatch-pin")
        return self._pinner.submit(map_tensors, batch, self._pinned)

    def start(self, batch: Any, pinned: bool = False) -> Pending:
        copied: list[torch.Tensor] = []
        sources: list[torch.Tensor] = []

        def copy(t: torch.Tensor) -> torch.Tensor:
            if self.api.on_device(t):
                return t
            src = self.api.pin(t) if self.pin and not pinned and t.device.type == "cpu" else t   # rule 1
            out = self.api.copy_async(src)
            sources.append(src)
            copied.append(out)
            return out

        with self.api.use_stream(self.stream):
            device_batch = map_tensors(batch, copy)
        if not copied:
            return Pending(device_batch)
        event = self.api.new_event()
        self.api.record_event(event, self.stream)
        return Pending(device_batch, ready=event, host=sources, copied=copied)

    def finish(self, pending: Pending) -> Any:
        if pending.ready is not None:
            consumer = self.api.current_stream()
            # rule 2: kernels queued on the consumer stream from now on wait for the copy
            self.api.wait_event(consumer, pending.ready)
            # rule 3: the allocator does not reuse this memory before the consumer's kernels are done
            for t in pending.copied:
                self.api.record_stream(t, consumer)
        pending.host = None
        return pending.batch


def copier_for(device: torch.device | str, pin: bool = True) -> Copier:
    """A :class:`StreamCopier` for a CUDA device, a :class:`PassthroughCopier` for anything else."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return StreamCopier(CUDAStreams(dev), pin=pin)
    return PassthroughCopier(dev)


# --- counting host synchronisations -----------------------------------------------------------------------

@dataclass
class SyncCount:
    """Host synchronisations seen inside :func:`count_host_syncs`, by kind."""

    by_kind: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def total(self) -> int:
        return sum(self.by_kind.values())

    def add(self, kind: str) -> None:
        with self._lock:
            self.by_kind[kind] = self.by_kind.get(kind, 0) + 1

    def reset(self) -> None:
        with self._lock:
            self.by_kind.clear()


_READS = ("item", "tolist", "numpy")          # explicit reads of tensor values
_DEVICE_ONLY = ("cpu", "__bool__", "__float__", "__int__")  # syncs only when the tensor is on a device


@contextlib.contextmanager
def count_host_syncs(include_cpu_reads: bool = False) -> Iterator[SyncCount]:
    """Count the calls that make the host wait for a device, while the block runs.

    Counted: ``torch.cuda.synchronize``, ``torch.cuda.Stream.synchronize``, ``torch.cuda.Event.synchronize``
    and, on tensors not on the CPU, ``item``/``tolist``/``numpy``/``cpu``/``bool()``/``float()``/``int()``
    and a blocking ``.to`` that lands on the CPU. ``include_cpu_reads=True`` also counts
    ``item``/``tolist``/``numpy`` on CPU tensors, so code that reads its results once per call can be
    checked on a machine without a device. Not thread-isolated: calls from every thread are counted.
    """
    count = SyncCount()
    undo: list[Callable[[], None]] = []

    def patch(owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        had_own = name in vars(owner)
        original = getattr(owner, name)
        setattr(owner, name, make(original))

        def restore() -> None:
            if had_own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        undo.append(restore)

    def counted_always(kind: str) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                count.add(kind)
                return original(*args, **kwargs)
            return wrapper
        return make

    def counted_tensor(name: str, on_cpu_too: bool) -> Callable[[Callable], Callable]:
        def make(original: Callable) -> Callable:
            def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
                if self.device.type != "cpu" or on_cpu_too:
                    count.add(f"Tensor.{name}")
                return original(self, *args, **kwargs)
            return wrapper
        return make

    def counted_to(original: Callable) -> Callable:
        def wrapper(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            out = original(self, *args, **kwargs)
            blocking = not kwargs.get("non_blocking", False) and not any(a is True for a in args)
            if (isinstance(out, torch.Tensor) and self.device.type != "cpu" and out.device.type == "cpu"
                    and blocking):
                count.add("Tensor.to(cpu)")
            return out
        return wrapper

    try:
        patch(torch.cuda, "synchronize", counted_always("torch.cuda.synchronize"))
        for cls_name in ("Stream", "Event"):
            cls = getattr(torch.cuda, cls_name, None)
            if cls is not None and hasattr(cls, "synchronize"):
                patch(cls, "synchronize", counted_always(f"torch.cuda.{cls_name}.synchronize"))
        for name in _READS:
            patch(torch.Tensor, name, counted_tensor(name, include_cpu_reads))
        for name in _DEVICE_ONLY:
            patch(torch.Tensor, name, counted_tensor(name, False))
        patch(torch.Tensor, "to", counted_to)
        yield count
    finally:
        for restore in reversed(undo):
            restore()
