"""The one engine loop's policies on every device, and the backends' topology and collectives.

NaN policy: the CPU engine reads each update's loss on the host and stops before a bad update; the CUDA
engine (here on ``Accelerator(cpu=True)``) keeps the flag on the device and must end the call with the same
weights and optimizer state, reading the host once per call. Replicas (two gloo processes, CPU and DDP)
skip or stop at the same update. Collectives: single-process defaults, two processes, and the CUDA
backend's tensors on the accelerator's device (an NCCL group has no CPU backend).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from accelbatch.backends.base import EngineOptions, NonFiniteLoss, Topology
from accelbatch.backends.cpu import CPUBackend, PlanEngine
from accelbatch.backends.cuda import CUDABackend, StepGuard
from accelbatch.backends.distributed import spawn_replicas
from accelbatch.backends.prefetch import count_host_syncs
from torch import nn

from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan

NAN = float("nan")


class Poisonable(nn.Module):
    """Mean squared error; a row with ``p`` set makes the loss and gradients NaN (its micro-batch only)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)

    def forward(self, batch):
        pred = self.lin(batch["x"])
        per_row = ((pred - batch["y"]) ** 2).mean(1)
        per_row = per_row + pred.sum(1) * torch.where(batch["p"] > 0, NAN, 0.0)
        return {"loss": per_row.mean(), "pred": pred.detach()}


def data(rows: int, poison: tuple[int, ...] = (), seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.zeros(rows)
    p[list(poison)] = 1.0
    return {"x": torch.randn(rows, 3, generator=g), "y": torch.randn(rows, 2, generator=g), "p": p}


OPTIMIZERS = {
    "sgd": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "adam": lambda ps: torch.optim.Adam(ps, lr=0.01),
    "momentum_fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam_fused": lambda ps: torch.optim.Adam(ps, lr=0.01, fused=True),
}
# (plan keywords, rows per call, the poisoned row: update 2 of D=4, or replica 1's micro-batch of update 0)
PLANS = {"D4": ({"micro_batch": 2, "device_iterations": 4}, 8, 4, 3),
         "D2_G2_R2": ({"micro_batch": 2, "device_iterations": 2, "gradient_accumulation": 2,
                       "replication_factor": 2}, 16, 2, 1)}


def engines(opt: str, plan: ExecutionPlan, skip: bool):
    """(CPU engine, CUDA engine on the CPU), same initial weights and optimizer."""
    cpu_model, cuda_model = Poisonable(), Poisonable()
    cpu = PlanEngine(cpu_model, OPTIMIZERS[opt](cpu_model.parameters()), plan, EngineOptions(skip_nan=skip))
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda", skip_nan=skip))
    cuda = backend.compile(cuda_model, OPTIMIZERS[opt](cuda_model.parameters()), plan)
    return cpu, cuda


def assert_same(a, b, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=0), f"{name}: max diff {(p - q).abs().max():.3g}"
    sa, sb = a.optimizer.state_dict()["state"], b.optimizer.state_dict()["state"]
    assert sa.keys() == sb.keys()
    for k in sa:
        for key, value in sa[k].items():
            if isinstance(value, torch.Tensor):
                assert torch.allclose(value.float(), sb[k][key].float(), atol=atol, rtol=0), (k, key)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_a_nan_update_stops_the_call_with_the_weights_before_it(opt, plan_name):
    kw, rows, poison, bad_update = PLANS[plan_name]
    plan = ExecutionPlan(**kw)
    cpu, cuda = engines(opt, plan, skip=False)
    clean, poisoned = data(rows, seed=1), data(rows, (poison,), seed=2)
    for engine in (cpu, cuda):
        engine.train_step(clean)
    with pytest.raises(NonFiniteLoss, match=f"in weight update {bad_update} of "):
        cpu.train_step(poisoned)
    reads = cuda.host_syncs
    with count_host_syncs(include_cpu_reads=True) as syncs, \
            pytest.raises(NonFiniteLoss, match=f"weight update {bad_update} of .*--skip-nan") as err:
        cuda.train_step(poisoned)
    # one host read in the call, none per update (torch's Adam reads its own CPU step count: no device wait)
    assert syncs.by_kind.get("Tensor.tolist") == 1 and cuda.host_syncs == reads + 1
    after = plan.device_iterations - bad_update
    assert ("the update was not applied" if not after else f"and the {after} update") in str(err.value)
    assert_same(cpu, cuda)


@pytest.mark.parametrize("plan_name", list(PLANS))
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
def test_skip_nan_skips_the_same_update_on_both_engines(opt, plan_name):
    kw, rows, poison, _ = PLANS[plan_name]
    plan = ExecutionPlan(**kw)
    cpu, cuda = engines(opt, plan, skip=True)
    results = []
    for engine in (cpu, cuda):
        engine.train_step(data(rows, seed=1))
        results.append(engine.train_step(data(rows, (poison,), seed=2)))
        engine.train_step(data(rows, seed=3))
    a, b = results
    assert b.extras["host_syncs"] == 1      # the CUDA engine: one read per call, none per update
    assert a.extras["skipped_updates"] == b.extras["skipped_updates"] == 1
    assert a.updates == b.updates == plan.device_iterations - 1
    assert b.loss == pytest.approx(a.loss, rel=1e-6) and a.loss == a.loss   # finite: the skipped one left out
    assert_same(cpu, cuda)


@pytest.mark.parametrize("skip", [False, True])
def test_a_nan_before_the_optimizer_has_state_is_caught_on_the_host(skip):
    """Lazily created optimizer state cannot be put back, so the first update reads its flag on the host."""
    plan = ExecutionPlan(micro_batch=2, device_iterations=2)
    cpu, cuda = engines("adam", plan, skip=skip)
    poisoned = data(4, (0,), seed=2)
    for engine in (cpu, cuda):
        before = copy.deepcopy(engine.model.state_dict())
        if skip:
            assert engine.train_step(poisoned).extras["skipped_updates"] == 1
        else:
            with pytest.raises(NonFiniteLoss, match="weight update 1 of 2 of this call; the update was not"):
                engine.train_step(poisoned)
            assert not engine.optimizer.state and all(torch.equal(before[k], v)
                                                      for k, v in engine.model.state_dict().items())
    assert_same(cpu, cuda)


def test_state_kept_off_the_device_is_put_back_or_read_on_the_host():
    """With the flag on another device than the optimizer's state (torch's Adam keeps `step` on the host),
    a masked step puts the parameters back at once and that state on rollback; --skip-nan reads the host."""
    model = Poisonable()
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(data(2))["loss"].backward()
    opt.step()
    assert not StepGuard(opt, torch.device("cpu"), skip=True).needs_host()
    assert StepGuard(opt, torch.device("meta"), skip=True).needs_host()     # its state is "off the device"
    assert StepGuard(opt, torch.device("meta"), skip=False).has_host_state()  # fp16 reads the host then
    assert not StepGuard(opt, torch.device("cpu"), skip=False).has_host_state()
    guard = StepGuard(opt, torch.device("meta"), skip=False)
    assert not guard.needs_host()
    weights, state = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
    guard.step(opt.step, torch.tensor(True), update=0)
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())
    assert int(opt.state_dict()["state"][0]["step"]) == 2     # not yet: the host part waits for rollback
    guard.rollback(0)
    for k, value in state["state"][0].items():
        assert torch.equal(opt.state_dict()["state"][0][k], value), k


# --- topology and collectives ------------------------------------------------------------------------

def test_setup_returns_the_topology_and_keeps_the_engine_options():
    backend = CPUBackend()
    assert backend.setup(Opts(skip_nan=True, mixed_precision="bf16")) == Topology()
    assert backend.options == EngineOptions(skip_nan=True, mixed_precision="bf16")
    engine = backend.compile(Poisonable(), None, ExecutionPlan())
    assert engine.skip_nan and engine.hooks.autocast
    assert Topology(rank=1, world_size=2).is_main is False and Topology().is_main


class Recorded(Exception):
    """Raised by the fake collectives below once they have recorded where their tensors are."""


def test_cuda_backend_collectives_put_their_tensors_on_the_accelerators_device(monkeypatch):
    """An NCCL group has no CPU backend: a collective on a CPU tensor fails there. The accelerator's device
    is faked as ``meta`` here; a collective on a hard-coded CPU tensor (or none) is seen."""
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda"))
    backend.topology = Topology(rank=0, world_size=2)
    monkeypatch.setattr(type(backend.accelerator), "device", property(lambda self: torch.device("meta")))
    seen = []

    def recording(name):
        def collective(*args, **kwargs):
            tensors = [a for arg in args for a in (arg if isinstance(arg, list) else [arg])
                       if isinstance(a, torch.Tensor)]
            seen.append((name, {t.device.type for t in tensors} or {"no tensor"}))
            raise Recorded
        return collective

    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier",
                 "all_gather_into_tensor", "broadcast_object_list"):
        monkeypatch.setattr(dist, name, recording(name))
    for call in (backend.barrier, lambda: backend.decide(True, False), lambda: backend.all_gather_object([1]),
                 lambda: backend.reduce_metrics({"exs": 1})):
        with pytest.raises(Recorded):
            call()
    assert seen == [("all_reduce", {"meta"}), ("all_reduce", {"meta"}), ("all_gather", {"meta"}),
                    ("all_gather", {"meta"})]


def _two_replicas(rank: int, plan: ExecutionPlan, calls: list) -> dict:
    """In each of two gloo processes: the collectives, then poisoned training with and without --skip-nan,
    on the CPU backend (flat all-reduce) and the CUDA backend on the CPU (DDP)."""
    out: dict = {}
    for name, make in (("cpu", CPUBackend), ("cuda", lambda: CUDABackend(cpu=True))):
        backend = make()
        res = {"topology": backend.setup(Opts(device=name, replication_factor=2))}
        backend.barrier()
        res["gathered"] = backend.all_gather_object({"rank": rank, "t": torch.tensor([rank])})
        res["decide"] = backend.decide(rank == 1, False, rank == 0)
        res["metrics"] = backend.reduce_metrics({"exs": rank + 1, "sub": {f"r{rank}": 1.0}})
        for skip in (False, True):
            trainer = make()
            trainer.setup(Opts(device=name, replication_factor=2, skip_nan=skip))
            model = Poisonable()
            engine = trainer.compile(model, OPTIMIZERS["momentum"](model.parameters()), plan)
            error, skipped = None, []
            try:
                for batch in calls:
                    skipped.append(engine.train_step(plan.shard(batch, rank)).extras["skipped_updates"])
            except NonFiniteLoss as exc:
                error = str(exc)
            res[skip] = {"state": copy.deepcopy(model.state_dict()), "error": error, "skipped": skipped}
        out[name] = res
    return out


PLAN_R2 = ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2)
CALLS_R2 = [data(8, seed=1), data(8, (2,), seed=2), data(8, seed=3)]   # row 2: replica 1, update 1 of call 2


@pytest.fixture(scope="module")
def two_replicas():
    return spawn_replicas(_two_replicas, 2, PLAN_R2, CALLS_R2, timeout_s=240)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_collectives_across_two_processes(two_replicas):
    for rank, out in enumerate(two_replicas):
        for name in ("cpu", "cuda"):
            res = out[name]
            assert res["topology"] == Topology(rank=rank, world_size=2, local_rank=rank)
            assert [g["rank"] for g in res["gathered"]] == [0, 1]
            assert [int(g["t"]) for g in res["gathered"]] == [0, 1]
            assert res["decide"] == (True, False, True)
            assert res["metrics"] == {"exs": 3, "sub": {"r0": 1.0, "r1": 1.0}}


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("skip", [False, True])
def test_replicas_stop_at_or_skip_the_same_update(two_replicas, skip):
    model = Poisonable()
    ref = PlanEngine(model, OPTIMIZERS["momentum"](model.parameters()), PLAN_R2, EngineOptions(skip_nan=skip))
    error = None
    try:
        for batch in CALLS_R2:
            ref.train_step(batch)
    except NonFiniteLoss as exc:
        error = str(exc)
    assert (error is None) == skip
    for out in two_replicas:
        for name in ("cpu", "cuda"):
            res = out[name][skip]
            assert (res["error"] is None) == skip, (name, res["error"])
            if skip:
                assert res["skipped"] == [0, 1, 0], name
            else:
                assert "weight update 1 of 2" in res["error"] and "--skip-nan" in res["error"]
            for k, v in model.state_dict().items():
                torch.testing.assert_close(res["state"][k], v, rtol=0, atol=1e-6, msg=f"{name} {k}")


# --- fp16's loss scaler: the same policy on both engines, no host read on the CUDA one -------------------

class Overflowing(Poisonable):
    """A row with ``o`` set gives NaN gradients and a finite loss, as an fp16 overflow in backward does."""

    def forward(self, batch):
        out = super().forward(batch)
        pred = self.lin(batch["x"])
        out["loss"] = out["loss"] + (torch.sqrt(pred.sum(1) * 0.0 + (1 - batch["o"])) * 0.0).mean()
        return out


def overflow_data(rows: int, overflow: tuple[int, ...] = (), seed: int = 0) -> dict[str, torch.Tensor]:
    batch = data(rows, seed=seed)
    batch["o"] = torch.zeros(rows)
    batch["o"][list(overflow)] = 1.0
    return batch


@pytest.mark.parametrize("opt", ["sgd", "momentum", "adam_fused", "momentum_fused"])
def test_an_overflow_skips_the_same_update_and_backs_off_the_scale_on_both_engines(opt):
    from accelbatch.backends.scaler import LossScaler

    plan = ExecutionPlan(micro_batch=2, device_iterations=4)
    models = [Overflowing(), Overflowing()]
    cpu = PlanEngine(models[0], OPTIMIZERS[opt](models[0].parameters()), plan)
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda"))
    cuda = backend.compile(models[1], OPTIMIZERS[opt](models[1].parameters()), plan)
    for engine in (cpu, cuda):   # fp16's scaler; the arithmetic stays fp32 (accelerate runs no fp16 on the CPU)
        engine.hooks.scaler = LossScaler("cpu", growth_interval=3)
    calls = [overflow_data(8, seed=1), overflow_data(8, (4,), seed=2), overflow_data(8, seed=3)]
    for i, batch in enumerate(calls):
        weights = copy.deepcopy(cuda.model.state_dict())
        a = cpu.train_step(batch)
        with count_host_syncs(include_cpu_reads=True) as syncs:
            b = cuda.train_step(batch)
        if i > 0:   # the first call reads its first update's flags on the host (no optimizer state yet)
            assert syncs.by_kind == {"Tensor.tolist": 1} and b.extras["host_syncs"] == 1, syncs.by_kind
        assert a.updates == b.updates == 4 and a.extras["skipped_updates"] == b.extras["skipped_updates"] == 0
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        assert any(not torch.equal(weights[k], v) for k, v in cuda.model.state_dict().items())
        assert_same(cpu, cuda)
        assert cpu.hooks.scaler.state_dict() == cuda.hooks.scaler.state_dict()
    # x2 after every 3 clean updates in a row, x0.5 at the overflow (update 3 of call 2), whose NaN
    # gradients were not applied: call 1: 3 clean (x2) + 1; call 2: 2 clean (x2), overflow (x0.5), 1;
    # call 3: 2 clean (x2), 2 more
    assert all(bool(torch.isfinite(p).all()) for p in cuda.model.parameters())
    assert cuda.hooks.scaler.state_dict()["scale"] == 65536.0 * 2 * 2 * 0.5 * 2
    assert cuda.hooks.scaler.state_dict()["_growth_tracker"] == 2


# --- --compile ------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.multiprocess      # inductor runs the C++ compiler
@pytest.mark.timeout(600)
def test_compile_runs_the_forward_through_torch_compile_with_the_same_results():
    """``--compile`` on both engines: the forward goes through torch.compile (training and eval), and the
    weights and outputs equal the eager engine's."""
    plan = ExecutionPlan(micro_batch=4, device_iterations=2)
    calls = [data(8, seed=s) for s in (1, 2)]
    eager_model = Poisonable()
    eager = PlanEngine(eager_model, OPTIMIZERS["momentum"](eager_model.parameters()), plan)
    eager_results = [eager.train_step(b) for b in calls]
    eager_eval = eager.eval_step(calls[0])
    for name in ("cpu", "cuda"):
        torch._dynamo.reset()
        backend = CPUBackend() if name == "cpu" else CUDABackend(cpu=True)
        backend.setup(Opts(device=name, compile=True))
        model = Poisonable()
        engine = backend.compile(model, OPTIMIZERS["momentum"](model.parameters()), plan)
        results = [engine.train_step(b) for b in calls]
        evaluated = engine.eval_step(calls[0])
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        assert frames >= 1, name                           # dynamo compiled the model's forward
        for got, want in zip(results, eager_results):
            assert got.loss == pytest.approx(want.loss, rel=1e-5)
        torch.testing.assert_close(evaluated.outputs["pred"], eager_eval.outputs["pred"], rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), eager_model.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6)
        backend.teardown()


def test_compile_and_mixed_precision_on_the_ipu_are_refused_in_one_line():
    from accelbatch.backends.ipu import IPUBackend

    from accelbatch.plan import PlanError

    with pytest.raises(PlanError, match=r"^--compile applies to --device cpu and cuda .*leave it out$"):
        IPUBackend().setup(Opts(device="ipu", compile=True, ipu_emulator=True))
    with pytest.raises(PlanError, match=r"^--mixed-precision bf16: IPUs have no bfloat16 arithmetic; .*leave it out$"):
        IPUBackend().setup(Opts(device="ipu", mixed_precision="bf16", ipu_emulator=True))


def test_gathered_outputs_travel_as_tensors_not_pickles(monkeypatch):
    """``gather_outputs``: replicas exchange the outputs' shapes (small), then one all-gather per output
    name; no tensor is pickled. A second replica is faked: it holds micro-batch 1 with its own values."""
    engine = PlanEngine(Poisonable(), None, ExecutionPlan(micro_batch=2))
    engine.world_size, engine.rank = 2, 0
    mine = {0: {"pred": torch.arange(6.0).view(3, 2), "n": torch.tensor(7), "ids": torch.tensor([1, 2, 3])}}
    peer = {1: {"pred": -torch.arange(4.0).view(2, 2), "n": torch.tensor(8), "ids": torch.tensor([4, 5])}}
    pickled = []

    def all_gather_object(out, obj, group=None):
        pickled.append(obj)
        out[0], out[1] = obj, {j: {k: (tuple(v.shape), str(v.dtype).split(".")[-1]) for k, v in o.items()}
                               for j, o in peer.items()}

    order = iter(sorted(mine[0]))     # one all-gather per output name, in sorted order

    def all_gather(parts, tensor, group=None):
        parts[0].copy_(tensor)
        flat = peer[1][next(order)].reshape(-1)
        parts[1].zero_()
        parts[1][:flat.numel()] = flat

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    monkeypatch.setattr(dist, "all_gather", all_gather)
    got = engine._gather(mine)
    assert not [v for obj in pickled for out in obj.values() for v in out.values() if isinstance(v, torch.Tensor)]
    for j, expected in {**mine, **peer}.items():
        assert got[j].keys() == expected.keys()
        for k, v in expected.items():
            assert torch.equal(got[j][k], v), (j, k)
