"""Copies to a device on the CPU: the stream rules of StreamCopier and of the engine's staging (through a
fake device), and the host-sync counter.

The fake device models what matters on CUDA: a copy issued on a side stream writes its destination only when
a consumer stream waits on the event recorded after it. An engine that computed on a batch before ordering
the consumer after its copy would compute on the sentinel-filled destination, and these tests would see it.
"""

from __future__ import annotations

import contextlib
import threading

import pytest
import torch
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.cuda import CUDAEngine, make_accelerator
from accelbatch.backends.prefetch import PassthroughCopier, StreamCopier, copier_for, count_host_syncs, map_tensors

from accelbatch.plan import ExecutionPlan

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
        main = threading.current_thread() is threading.main_thread()
        self.log.append(("pin",) if main else ("pin", "off the main thread"))
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
    copier = StreamCopier(api)
    got = []
    for batch in (copier.finish(copier.start(b)) for b in _batches(5)):
        # what a kernel on the consumer stream would read: never the sentinel
        assert not (batch["x"] == SENTINEL).any()
        got.append((batch["x"][0, 0].item(), batch["y"].tolist(), batch["tag"]))
        for t in (batch["x"], batch["y"]):
            assert api.used_by[id(t)] == [api.main], "record_stream on the consumer stream"
    assert got == [(float(i), [10 * i, 10 * i + 1, 10 * i + 2], f"b{i}") for i in range(5)]
    # every copy was issued inside the side-stream context, from pinned memory, followed by an event record
    copies = [e for e in api.log if e[0] == "copy"]
    assert len(copies) == 10 and all(name.startswith("side") for _, name in copies)
    assert api.log[:5] == [("enter", "side1"), ("pin",), ("copy", "side1"), ("pin",), ("copy", "side1")]
    assert api.log[5:8] == [("exit", "side1"), ("record_event", 1, "side1"), ("wait_event", "main", 1)]
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
    out = copier.finish(copier.start(batch))
    assert out["x"] is batch["x"] and out["meta"] == ["a", "b"]
    assert out["pair"][0] is batch["pair"][0]


def test_map_tensors_keeps_structure():
    batch = {"a": [torch.ones(1), (torch.zeros(1), "s")], "b": 5}
    out = map_tensors(batch, lambda t: t + 1)
    assert out["a"][0].item() == 2 and out["a"][1][0].item() == 1 and out["a"][1][1] == "s" and out["b"] == 5
    assert isinstance(out["a"][1], tuple)


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


# --- the engine's staging, on the fake device -------------------------------------------------------------

class Linear(torch.nn.Module):
    """Refuses to compute on a destination the copy has not written yet (the fake device's sentinel); logs
    ("forward", first x) when given a log."""

    def __init__(self, log: list | None = None):
        super().__init__()
        torch.manual_seed(0)
        self.lin = torch.nn.Linear(2, 1)
        self.log = log

    def forward(self, batch):
        assert not (batch["x"] == SENTINEL).any(), "computed on rows whose copy was not waited for"
        if self.log is not None:
            self.log.append(("forward", int(batch["x"][0, 0])))
        pred = self.lin(batch["x"]).squeeze(-1)
        return {"loss": ((pred - batch["y"].float()) ** 2).mean(), "pred": pred}


def fake_engine(api: FakeStreams, plan: ExecutionPlan) -> CUDAEngine:
    model = Linear()
    engine = CUDAEngine(model, torch.optim.SGD(model.parameters(), lr=0.01), plan, make_accelerator(cpu=True),
                        copier=StreamCopier(api))
    engine.hooks.on_device = lambda batch: all(id(t) in api.on_dev for t in batch.values()
                                               if isinstance(t, torch.Tensor))
    return engine


def _numeric(n: int, rows: int = 4):
    return [{k: v for k, v in b.items() if k != "tag"} for b in _batches(n, rows)]


def test_a_staged_batch_follows_the_stream_rules_and_is_copied_once():
    api = FakeStreams()
    plan = ExecutionPlan(micro_batch=4)
    engine = fake_engine(api, plan)
    ref_model = Linear()
    ref = PlanEngine(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.01), plan)
    b0, b1 = _numeric(2)
    engine.stage(b1)
    assert not [e for e in api.log if e[0] == "copy"], "the copy waits for the next call's kernels"
    first = engine.train_step(b0)
    # b1 was pinned on the pin thread (while b0 was stepped), before its copies
    assert [e for e in api.log if e[1:] == ("off the main thread",)] == [("pin", "off the main thread")] * 2
    kinds = [e[0] for e in api.log if e[1:] != ("off the main thread",)]
    # b0: pinned, copied, waited for, used; then b1's copy is issued on the side stream (no wait yet)
    assert kinds == ["enter", "pin", "copy", "pin", "copy", "exit", "record_event", "wait_event",
                     "record_stream", "record_stream",
                     "enter", "copy", "copy", "exit", "record_event"]
    mark = len(api.log)
    second = engine.train_step(b1)
    # b1: no second copy; the consumer stream waits for the staged copy's event before computing on it
    assert api.log[mark:] == [("wait_event", "main", 2), ("record_stream", "main"), ("record_stream", "main")]
    for got, batch in zip((first, second), (b0, b1)):
        assert got.loss == pytest.approx(ref.train_step(batch).loss, rel=1e-6)
    assert torch.allclose(ref_model.lin.weight, engine.model.lin.weight, atol=1e-7)


def test_the_rows_of_each_update_are_waited_for_before_use():
    api = FakeStreams()
    plan = ExecutionPlan(micro_batch=2, device_iterations=2)
    engine = fake_engine(api, plan)
    engine.train_step(_numeric(1)[0])
    events = [e for e in api.log if e[0] in ("record_event", "wait_event")]
    assert events == [("record_event", 1, "side1"), ("wait_event", "main", 1),
                      ("record_event", 2, "side1"), ("wait_event", "main", 2)]


# --- the order of copies, steps and host reads (a logging copier) ---------------------------------------

class LoggingCopier(PassthroughCopier):
    def __init__(self, log: list):
        super().__init__("cpu")
        self.log = log

    def start(self, batch):
        self.log.append(("copy", int(batch["x"][0, 0])))
        return super().start(batch)


def logging_engine(log: list, plan: ExecutionPlan) -> CUDAEngine:
    """A CUDA engine on the CPU whose copies, forwards and host reads are logged; host rows count as not on
    the device, so every batch goes through the copier."""
    model = Linear(log)
    engine = CUDAEngine(model, torch.optim.SGD(model.parameters(), lr=0.01), plan, make_accelerator(cpu=True),
                        copier=LoggingCopier(log))
    engine.hooks.on_device = lambda batch: False
    to_host = engine.hooks.to_host

    def logged_read(tree):
        log.append(("wait",))
        return to_host(tree)

    engine.hooks.to_host = logged_read
    return engine


def counted_rows(first: int, rows: int) -> dict[str, torch.Tensor]:
    """Row r has x = [first + r, first + r]."""
    x = torch.arange(first, first + rows, dtype=torch.float32)
    return {"x": torch.stack([x, x], dim=1), "y": torch.zeros(rows)}


def test_rows_of_update_d_plus_1_are_copied_once_update_d_is_queued():
    log: list = []
    plan = ExecutionPlan(micro_batch=2, device_iterations=3)
    logging_engine(log, plan).train_step(counted_rows(0, plan.combined_batch))
    assert log == [("copy", 0), ("forward", 0), ("copy", 2), ("forward", 2), ("copy", 4), ("forward", 4),
                   ("wait",)]


def test_a_staged_batch_is_copied_while_the_current_call_computes_and_not_again():
    log: list = []
    plan = ExecutionPlan(micro_batch=2)
    engine = logging_engine(log, plan)
    ref_model = Linear()
    ref = PlanEngine(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.01), plan)
    data = [counted_rows(1000 * k, 2) for k in range(3)]
    for k, batch in enumerate(data):
        if k + 1 < len(data):
            engine.stage(data[k + 1])     # one batch ahead, before stepping the current one
        assert engine.train_step(batch).loss == pytest.approx(ref.train_step(batch).loss, rel=1e-6)
    assert log == [("copy", 0), ("forward", 0), ("copy", 1000), ("wait",),
                   ("forward", 1000), ("copy", 2000), ("wait",), ("forward", 2000), ("wait",)]
    assert torch.allclose(ref_model.lin.weight, engine.model.lin.weight, atol=1e-7)
    for batch in data:                    # staged but not stepped: at most max_staged kept, none copied yet
        engine.stage(batch)
    assert len(engine._staged) == engine.max_staged and id(data[0]) not in engine._staged
    engine.eval_step(data[2])   # not issued yet: copied as usual; data[1]'s copy follows eval's work
    assert log[-4:] == [("copy", 2000), ("forward", 2000), ("copy", 1000), ("wait",)]


def test_stage_is_a_no_op_for_rows_already_on_the_device():
    model = Linear()
    engine = CUDAEngine(model, torch.optim.SGD(model.parameters(), lr=0.01), ExecutionPlan(micro_batch=2),
                        make_accelerator(cpu=True))
    engine.stage(counted_rows(0, 2))
    assert not engine._staged


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible here)")
def test_real_cuda_copies_match_the_source():
    src = [{"x": torch.randn(64, 256), "i": torch.tensor([k])} for k in range(6)]
    copier = copier_for("cuda")
    pending = [copier.start(b) for b in src]
    out = []
    for p in pending:
        batch = copier.finish(p)
        assert batch["x"].is_cuda
        out.append((batch["x"] * 2).cpu())
    for k, o in enumerate(out):
        torch.testing.assert_close(o, src[k]["x"] * 2)
