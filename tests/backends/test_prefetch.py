"""The prefetcher's logic on the CPU: lookahead, laziness, ordering, stream rules (through a fake device).

The fake device models what matters on CUDA: a copy issued on a side stream writes its destination only when
a consumer stream waits on the event recorded after it. A prefetcher that handed out a batch before ordering
the consumer after its copy would hand out the sentinel-filled destination, and these tests would see it.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
import torch

from accelbatch.backends.prefetch import (
    DeviceLoader,
    PassthroughCopier,
    Prefetcher,
    StreamCopier,
    copier_for,
    count_host_syncs,
    map_tensors,
    pin_batch,
    pinned_in_background,
)

SENTINEL = -12345.0


class FakeStream:
    def __init__(self, name: str):
        self.name = name
        self.queue: list[tuple] = []       # ops not yet executed by the "device"

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class FakeEvent:
    def __init__(self, n: int):
        self.n = n
        self.stream: FakeStream | None = None
        self.fired = False


class FakeStreams:
    """A StreamAPI whose side-stream work runs only when some stream waits for it."""

    def __init__(self):
        self.device = torch.device("meta")   # anything but cpu: tensors "on the device" are tagged below
        self.main = FakeStream("main")
        self.current = self.main
        self.log: list[tuple] = []
        self.pinned: set[int] = set()
        self.on_dev: set[int] = set()
        self.used_by: dict[int, list[FakeStream]] = {}
        self.events = 0
        self.streams = 0
        self.keep: list[torch.Tensor] = []   # keeps ids unique for the test's lifetime

    # streams and events
    def new_stream(self):
        self.streams += 1
        return FakeStream(f"side{self.streams}")

    def current_stream(self):
        return self.current

    @contextlib.contextmanager
    def use_stream(self, stream):
        prev, self.current = self.current, stream
        self.log.append(("enter", stream.name))
        try:
            yield
        finally:
            self.current = prev
            self.log.append(("exit", stream.name))

    def new_event(self):
        self.events += 1
        return FakeEvent(self.events)

    def record_event(self, event, stream):
        event.stream = stream
        stream.queue.append(("event", event))
        self.log.append(("record_event", event.n, stream.name))

    def wait_event(self, stream, event):
        self.log.append(("wait_event", stream.name, event.n))
        # the device runs the event's stream up to the event before `stream` may go on
        src = event.stream
        while not event.fired:
            op = src.queue.pop(0)
            if op[0] == "copy":
                op[2].copy_(op[1])
            else:
                op[1].fired = True

    # tensors
    def pin(self, t):
        p = t.clone()
        self.keep.append(p)
        self.pinned.add(id(p))
        self.log.append(("pin",))
        return p

    def copy_async(self, t):
        assert self.current is not self.main, "copies must be issued on the side stream"
        assert id(t) in self.pinned, "copies must come from pinned memory"
        dst = torch.full_like(t, SENTINEL)
        self.keep.append(dst)
        self.on_dev.add(id(dst))
        self.current.queue.append(("copy", t, dst))
        self.log.append(("copy", self.current.name))
        return dst

    def record_stream(self, t, stream):
        self.used_by.setdefault(id(t), []).append(stream)
        self.log.append(("record_stream", stream.name))

    def on_device(self, t):
        return id(t) in self.on_dev


def _batches(n: int, rows: int = 3):
    for i in range(n):
        yield {"x": torch.full((rows, 2), float(i)), "y": torch.arange(rows) + 10 * i, "tag": f"b{i}"}


def test_stream_copier_yields_only_copied_data_and_follows_the_stream_rules():
    api = FakeStreams()
    pf = Prefetcher(_batches(5), StreamCopier(api), depth=1)
    got = []
    for batch in pf:
        # what a kernel on the consumer stream would read: never the sentinel
        assert not (batch["x"] == SENTINEL).any()
        got.append((batch["x"][0, 0].item(), batch["y"].tolist(), batch["tag"]))
        for t in (batch["x"], batch["y"]):
            assert api.used_by[id(t)] == [api.main], "record_stream on the consumer stream"
    assert got == [(float(i), [10 * i, 10 * i + 1, 10 * i + 2], f"b{i}") for i in range(5)]
    # every copy was issued inside the side-stream context, followed by an event record on it
    copies = [e for e in api.log if e[0] == "copy"]
    assert len(copies) == 10 and all(name.startswith("side") for _, name in copies)
    waits = [e for e in api.log if e[0] == "wait_event"]
    assert [w[1] for w in waits] == ["main"] * 5
    assert [w[2] for w in waits] == [1, 2, 3, 4, 5]


def test_without_the_wait_the_fake_device_shows_garbage():
    """The fake device is strict: reading a destination before waiting sees the sentinel."""
    api = FakeStreams()
    copier = StreamCopier(api)
    pending = copier.start({"x": torch.ones(2)})
    assert (pending.batch["x"] == SENTINEL).all()
    assert (copier.finish(pending)["x"] == 1).all()


def test_copy_of_next_batch_is_issued_before_the_current_one_is_returned():
    order: list[tuple[str, int]] = []

    class Logging(PassthroughCopier):
        def start(self, batch):
            order.append(("start", int(batch["x"][0, 0])))
            return super().start(batch)

    pf = Prefetcher(_batches(4), Logging(), depth=1)
    for batch in pf:
        order.append(("use", int(batch["x"][0, 0])))
    assert order == [("start", 0), ("start", 1), ("use", 0), ("start", 2), ("use", 1),
                     ("start", 3), ("use", 2), ("use", 3)]


@pytest.mark.parametrize("depth", [0, 1, 3])
def test_source_is_read_lazily(depth):
    pulled = []

    def source():
        for i, b in enumerate(_batches(10)):
            pulled.append(i)
            yield b

    pf = Prefetcher(source(), PassthroughCopier(), depth=depth)
    for k, batch in enumerate(pf):
        assert int(batch["x"][0, 0]) == k
        assert len(pulled) <= k + 1 + depth
        assert pf.in_flight() == min(depth, 10 - k - 1)
        if k == 4:
            break
    pf.close()
    assert len(pulled) == 5 + depth


def test_take_and_fill_let_a_loop_issue_the_next_copy_after_queueing_its_step():
    order = []

    class Logging(PassthroughCopier):
        def start(self, batch):
            order.append(("start", int(batch["x"][0, 0])))
            return super().start(batch)

    pf = Prefetcher(_batches(3), Logging(), depth=1)
    while True:
        try:
            batch = pf.take()
        except StopIteration:
            break
        order.append(("queue step", int(batch["x"][0, 0])))
        pf.fill()
        order.append(("wait", int(batch["x"][0, 0])))
    assert order == [("start", 0), ("queue step", 0), ("start", 1), ("wait", 0),
                     ("queue step", 1), ("start", 2), ("wait", 1), ("queue step", 2), ("wait", 2)]


def test_a_source_error_arrives_after_the_batches_before_it():
    def source():
        yield from _batches(2)
        raise ValueError("bad row 17")

    pf = Prefetcher(source(), PassthroughCopier(), depth=2)
    assert int(next(pf)["x"][0, 0]) == 0
    assert int(next(pf)["x"][0, 0]) == 1
    with pytest.raises(ValueError, match="bad row 17"):
        next(pf)
    with pytest.raises(StopIteration):
        next(pf)


def test_tensors_already_on_the_device_are_not_copied():
    api = FakeStreams()
    copier = StreamCopier(api)
    on_dev = torch.ones(2)
    api.on_dev.add(id(on_dev))
    pending = copier.start({"a": on_dev, "n": 3})
    assert pending.ready is None and pending.batch["a"] is on_dev and pending.batch["n"] == 3
    assert copier.finish(pending)["a"] is on_dev
    assert not [e for e in api.log if e[0] in ("copy", "wait_event")]


def test_cpu_copier_is_a_passthrough():
    copier = copier_for("cpu")
    assert isinstance(copier, PassthroughCopier)
    batch = {"x": torch.ones(2), "meta": ["a", "b"], "pair": (torch.zeros(1), 2)}
    out = list(Prefetcher([batch], copier))
    assert len(out) == 1 and out[0]["x"] is batch["x"] and out[0]["meta"] == ["a", "b"]
    assert out[0]["pair"][0] is batch["pair"][0]


def test_device_loader_is_reiterable_and_keeps_len():
    data = list(_batches(3))
    loader = DeviceLoader(data, PassthroughCopier(), depth=1)
    assert len(loader) == 3
    for _ in range(2):
        assert [b["tag"] for b in loader] == ["b0", "b1", "b2"]
    fake = FakeStreams()
    assert [int(b["x"][0, 0]) for b in DeviceLoader(data, StreamCopier(fake))] == [0, 1, 2]


def test_map_tensors_keeps_structure():
    batch = {"a": [torch.ones(1), (torch.zeros(1), "s")], "b": 5}
    out = map_tensors(batch, lambda t: t + 1)
    assert out["a"][0].item() == 2 and out["a"][1][0].item() == 1 and out["a"][1][1] == "s" and out["b"] == 5
    assert isinstance(out["a"][1], tuple)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU behaviour of pin_batch")
def test_pin_batch_needs_a_gpu_to_pin():
    # On a machine without CUDA, torch cannot page-lock memory; pin_batch says so rather than pretending.
    with pytest.raises(RuntimeError):
        pin_batch({"x": torch.ones(2)})


def test_pinned_in_background_keeps_order_and_passes_errors(monkeypatch):
    monkeypatch.setattr("accelbatch.backends.prefetch.pin_batch", lambda b: b)
    assert [int(b["x"][0, 0]) for b in pinned_in_background(_batches(6), depth=2)] == list(range(6))

    def bad():
        yield from _batches(1)
        raise KeyError("broken worker")

    it = pinned_in_background(bad())
    assert int(next(it)["x"][0, 0]) == 0
    with pytest.raises(KeyError, match="broken worker"):
        next(it)


def test_pinned_in_background_stops_its_thread_when_closed(monkeypatch):
    monkeypatch.setattr("accelbatch.backends.prefetch.pin_batch", lambda b: b)
    before = {t.ident for t in threading.enumerate()}
    it = pinned_in_background(_batches(1000), depth=2)
    next(it)
    it.close()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        if not [t for t in threading.enumerate() if t.ident not in before and t.name == "accelbatch-pin"]:
            break
        time.sleep(0.01)
    assert not [t for t in threading.enumerate() if t.ident not in before and t.name == "accelbatch-pin"]


def test_count_host_syncs_counts_reads_and_restores_torch():
    x = torch.ones(1)
    item, to = torch.Tensor.item, torch.Tensor.to
    with count_host_syncs() as syncs:
        x.item()
        x.tolist()
        x.to("cpu")
        bool(x[0])
    assert syncs.total == 0, "CPU tensors do not sync a device unless include_cpu_reads"
    with count_host_syncs(include_cpu_reads=True) as syncs:
        x.item()
        x.tolist()
        x.numpy()
        bool(x[0])   # not an explicit read
    assert syncs.by_kind == {"Tensor.item": 1, "Tensor.tolist": 1, "Tensor.numpy": 1}
    assert torch.Tensor.item is item and torch.Tensor.to is to
    assert "item" not in vars(torch.Tensor)


def test_count_host_syncs_counts_cuda_synchronize_calls(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a, **k: calls.append(1))
    with count_host_syncs() as syncs:
        torch.cuda.synchronize()
        torch.cuda.synchronize()
    assert syncs.by_kind == {"torch.cuda.synchronize": 2} and len(calls) == 2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_real_cuda_prefetch_matches_source_and_pins():
    src = [{"x": torch.randn(64, 256), "i": torch.tensor([k])} for k in range(6)]
    copier = copier_for("cuda")
    out = []
    for batch in Prefetcher(src, copier, depth=2):
        assert batch["x"].is_cuda
        out.append((batch["x"] * 2).cpu())
    for k, o in enumerate(out):
        torch.testing.assert_close(o, src[k]["x"] * 2)
    assert pin_batch({"x": torch.ones(2)})["x"].is_pinned()
