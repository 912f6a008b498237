"""CUDA backend: CPU-checkable conformance (accelerate with cpu=True) and GPU tests that skip without one.

On the CPU: the CUDA engine runs the plan exactly as the CPU plan engine does (weights within 1e-6, same
outputs, rows and loss), accelerate wiring, DDP replication over gloo (two processes), the order in which
copies and steps are issued, one host read per call, the unavailable message and hogwild's rule.
On a GPU (``python bench/cuda_check.py`` runs them): cuda vs cpu weights, prefetch hiding copies, one host
sync per call with D=8, throughput against a naive loop.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import pathlib
import sys

import pytest
import torch
from torch import nn

from accelbatch.backends.base import BackendUnavailable, get_backend
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.cuda import (
    CUDABackend,
    CUDAEngine,
    HogwildError,
    cuda_unavailable_reason,
    hogwild_start_method,
    make_accelerator,
    spawn_cuda_replicas,
)
from accelbatch.backends.prefetch import PassthroughCopier, count_host_syncs
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan, PlanError

ROOT = pathlib.Path(__file__).resolve().parents[2]
NO_GPU = "needs a CUDA GPU (none visible here): run python bench/cuda_check.py on a GPU machine"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


class Tiny(nn.Module):
    """Mean squared loss over the rows, a per-row output and a 0-dim one."""

    def __init__(self, seed: int = 0, log: list | None = None):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(6, 5)
        self.l2 = nn.Linear(5, 2)
        self.log = log

    def forward(self, batch):
        if self.log is not None:
            self.log.append(("forward", int(batch["i"][0])))
        h = torch.tanh(self.l1(batch["x"]))
        pred = self.l2(h)
        loss = ((pred - batch["y"]) ** 2).mean()
        return {"loss": loss, "pred": pred, "score": pred.sum()}


def batches(n: int, rows: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for k in range(n):
        out.append({"x": torch.randn(rows, 6, generator=g), "y": torch.randn(rows, 2, generator=g),
                    "i": torch.arange(rows) + 1000 * k})
    return out


def make_opt(name: str, model: nn.Module) -> torch.optim.Optimizer:
    if name == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def cuda_on_cpu(model, opt, plan, **kw) -> CUDAEngine:
    return CUDABackend(cpu=True, **kw).compile(model, opt, plan)


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p.detach().cpu() - q.detach().cpu()).abs().max().item()
               for p, q in zip(a.parameters(), b.parameters()))


# --- same plan, same numbers (accelerate with cpu=True) ------------------------------------------------

PLANS = [
    # D, G, R, output mode, period, reduction, optimizer
    (1, 1, 1, "default", 1, "mean", "sgd"),
    (4, 2, 1, "default", 1, "mean", "sgd"),
    (4, 2, 1, "all", 1, "sum", "adam"),
    (2, 2, 2, "everyn", 2, "mean", "sgd"),
    (3, 1, 2, "sum", 1, "mean", "adam"),
    (2, 3, 1, "final", 1, "sum", "sgd"),
]


@pytest.mark.parametrize("d, g, r, mode, period, reduction, opt_name", PLANS)
def test_cuda_engine_on_cpu_matches_the_cpu_plan_engine(d, g, r, mode, period, reduction, opt_name):
    plan = ExecutionPlan(micro_batch=3, device_iterations=d, replication_factor=r, gradient_accumulation=g,
                         output_mode=mode, output_return_period=period, reduction=reduction)
    ref_model, our_model = Tiny(), Tiny()
    ref = PlanEngine(ref_model, make_opt(opt_name, ref_model), plan)
    ours = cuda_on_cpu(our_model, make_opt(opt_name, our_model), plan)
    assert ours.device.type == "cpu"
    for batch in batches(3, plan.combined_batch):
        a, b = ref.train_step(batch), ours.train_step(batch)
        assert b.updates == a.updates == d
        assert b.loss == pytest.approx(a.loss, rel=1e-6, abs=1e-7)
        assert (a.rows is None) == (b.rows is None)
        if a.rows is not None:
            assert torch.equal(a.rows, b.rows)
        assert a.outputs.keys() == b.outputs.keys()
        for k in a.outputs:
            assert a.outputs[k].shape == b.outputs[k].shape, k
            torch.testing.assert_close(b.outputs[k], a.outputs[k], rtol=1e-6, atol=1e-6)
    assert max_diff(ref_model, our_model) <= 1e-6


def test_tail_and_eval_match_the_cpu_plan_engine():
    plan = ExecutionPlan(micro_batch=4, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         drop_last=False)
    ref_model, our_model = Tiny(), Tiny()
    ref = PlanEngine(ref_model, make_opt("sgd", ref_model), plan)
    ours = cuda_on_cpu(our_model, make_opt("sgd", our_model), plan)
    full, tail = batches(1, plan.combined_batch)[0], batches(1, 13, seed=5)[0]
    for batch in (full, tail):
        a, b = ref.train_step(batch), ours.train_step(batch)
        assert (a.updates, a.extras["partial"]) == (b.updates, b.extras["partial"])
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        torch.testing.assert_close(b.outputs["pred"], a.outputs["pred"], rtol=1e-6, atol=1e-6)
    assert max_diff(ref_model, our_model) <= 1e-6
    for rows in (plan.combined_batch // 2, 7):   # eval: micro batch b*G, last call shorter
        batch = batches(1, rows, seed=rows)[0]
        a, b = ref.eval_step(batch), ours.eval_step(batch)
        assert b.loss == pytest.approx(a.loss, rel=1e-6)
        assert torch.equal(a.rows, b.rows)
        torch.testing.assert_close(b.outputs["pred"], a.outputs["pred"], rtol=1e-6, atol=1e-6)


def test_a_bad_batch_gets_the_plan_error():
    plan = ExecutionPlan(micro_batch=4, device_iterations=2)
    engine = cuda_on_cpu(Tiny(), torch.optim.SGD(Tiny().parameters(), lr=0.1), plan)
    with pytest.raises(PlanError, match="Invalid batch dimension"):
        engine.train_step(batches(1, 7)[0])
    with pytest.raises(PlanError, match="needs an optimizer"):
        cuda_on_cpu(Tiny(), None, plan).train_step(batches(1, 8)[0])


# --- accelerate wiring ----------------------------------------------------------------------------------

def test_accelerate_places_the_model_and_keeps_the_users_module():
    model = Tiny()
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda", mixed_precision="no"))
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan(micro_batch=2))
    assert engine.accelerator.device.type == "cpu" and engine.accelerator.num_processes == 1
    assert engine.model is model and engine.module is model       # no DDP wrapper in one process
    result = engine.train_step(batches(1, 2)[0])
    assert isinstance(result.loss, float) and result.outputs["pred"].device.type == "cpu"
    state = engine.state_dict()
    assert set(state) == {"model", "optimizer"}
    engine.load_state_dict(state)
    assert backend.rank == 0 and backend.world_size == 1 and backend.is_main_process()
    data = batches(2, 2)
    assert backend.make_loader(data, engine.plan) is data        # nothing to pin or copy on the CPU
    assert backend.reduce_metrics({"exs": 3}) == {"exs": 3}
    backend.teardown()
    backend.teardown()


def test_bf16_autocast_comes_from_accelerate():
    seen = []

    class Probe(Tiny):
        def forward(self, batch):
            seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
            return super().forward(batch)

    model = Probe()
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda", mixed_precision="bf16"))
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan(micro_batch=4))
    before = copy.deepcopy(model.state_dict())
    result = engine.train_step(batches(1, 4)[0])
    assert seen == [torch.bfloat16]
    assert result.outputs["pred"].dtype == torch.float32           # accelerate hands fp32 outputs back
    assert torch.isfinite(torch.tensor(result.loss))
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    # the next backend asks for no mixed precision: accelerate's per-process state is reset for it
    plain = CUDABackend(cpu=True)
    plain.setup(Opts(device="cuda"))
    assert plain.accelerator.mixed_precision == "no"


def test_fp16_on_the_cpu_is_refused():
    with pytest.raises(PlanError, match="fp16 needs a GPU"):
        make_accelerator(cpu=True, mixed_precision="fp16")


# --- feeding order and host reads -----------------------------------------------------------------------

class LoggingCopier(PassthroughCopier):
    def __init__(self, log):
        super().__init__("cpu")
        self.log = log

    def start(self, batch):
        self.log.append(("copy", int(batch["i"][0])))
        return super().start(batch)


def test_rows_of_update_d_plus_1_are_copied_before_update_d_runs():
    log: list = []
    plan = ExecutionPlan(micro_batch=2, device_iterations=3)
    model = Tiny(log=log)
    engine = CUDAEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, make_accelerator(cpu=True),
                        copier=LoggingCopier(log))
    engine._on_device = lambda batch: False   # pretend the host rows are not on the device yet
    engine.train_step(batches(1, plan.combined_batch)[0])
    assert log == [("copy", 0), ("copy", 2), ("forward", 0), ("copy", 4), ("forward", 2), ("forward", 4)]


def test_run_copies_batch_k_plus_1_while_batch_k_computes():
    log: list = []
    plan = ExecutionPlan(micro_batch=2)
    model = Tiny(log=log)
    engine = CUDAEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, make_accelerator(cpu=True),
                        copier=LoggingCopier(log))
    fetch = engine._fetch

    def logged_fetch(queued):
        log.append(("wait",))
        return fetch(queued)

    engine._fetch = logged_fetch
    results = list(engine.run(batches(3, 2)))
    assert len(results) == 3 and all(r.updates == 1 for r in results)
    assert log == [("copy", 0), ("forward", 0), ("copy", 1000), ("wait",),
                   ("forward", 1000), ("copy", 2000), ("wait",), ("forward", 2000), ("wait",)]


def test_one_host_read_per_call_with_eight_device_iterations():
    plan = ExecutionPlan(micro_batch=4, device_iterations=8, output_mode="all")
    model = Tiny()
    engine = cuda_on_cpu(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
    batch = batches(1, plan.combined_batch)[0]
    engine.train_step(batch)
    with count_host_syncs(include_cpu_reads=True) as syncs:
        result = engine.train_step(batch)
    assert syncs.by_kind == {"Tensor.item": 1}, syncs.by_kind
    assert result.extras["host_syncs"] == 1 and engine.host_syncs == 2 and result.updates == 8
    with count_host_syncs(include_cpu_reads=True) as syncs:
        engine.eval_step(batch)
    assert syncs.total == 1


# --- replication: DDP through accelerate, two processes on gloo ------------------------------------------

def _replica(rank: int, plan: ExecutionPlan, state: dict, calls: list) -> dict:
    """One replica, twice: fed its shard (default), and fed the whole call with outputs gathered."""
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda", replication_factor=plan.replication_factor))
    out: dict = {}
    for name, kwargs in (("shard", {}), ("full", {"inputs": "full", "gather_outputs": True})):
        model = Tiny()
        model.load_state_dict(state)
        engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, **kwargs)
        results = [engine.train_step(batch if name == "full" else plan.shard(batch, rank)) for batch in calls]
        out[name] = {"state": model.state_dict(), "losses": [r.loss for r in results],
                     "outputs": [r.outputs for r in results], "rows": [r.rows for r in results],
                     "wrapper": type(engine.module).__name__}
    backend.teardown()
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_two_replicas_with_ddp_equal_one_process():
    plan = ExecutionPlan(micro_batch=3, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         drop_last=False, output_mode="all")
    init = Tiny().state_dict()
    # two full calls, then an epoch tail in which replica 1 has no micro-batch in the last update
    calls = batches(2, plan.combined_batch) + batches(1, 14, seed=9)
    ref_model = Tiny()
    ref_model.load_state_dict(init)
    ref = PlanEngine(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), plan)
    ref_results = [ref.train_step(b) for b in calls]
    results = spawn_cuda_replicas(_replica, 2, plan, init, calls, timeout_s=100, cpu=True)
    for rank, both in enumerate(results):
        for name, res in both.items():
            assert res["wrapper"] == "DistributedDataParallel"
            assert res["losses"] == pytest.approx([r.loss for r in ref_results], rel=1e-5)
            for k, v in ref_model.state_dict().items():
                torch.testing.assert_close(res["state"][k], v, rtol=0, atol=1e-6)
        # fed its shard, a replica returns its own micro-batches' outputs, rows indexing the shard
        shard = plan.shard(calls[0], rank)
        assert torch.equal(both["shard"]["rows"][0], torch.arange(shard["x"].shape[0]))
        # fed the whole call with gather_outputs, every rank returns the whole call's outputs in order
        for got, want in zip(both["full"]["outputs"], ref_results):
            torch.testing.assert_close(got["pred"], want.outputs["pred"], rtol=1e-5, atol=1e-6)
        assert torch.equal(both["full"]["rows"][0], ref_results[0].rows)


def test_spawning_gpu_replicas_without_gpus_is_refused():
    if torch.cuda.device_count() >= 64:
        pytest.skip("a machine with 64 GPUs")
    with pytest.raises(PlanError, match="--replication-factor 64"):
        spawn_cuda_replicas(_replica, 64)


def test_a_replica_count_that_differs_from_the_plan_is_refused(monkeypatch):
    accel = make_accelerator(cpu=True)
    monkeypatch.setattr(type(accel), "num_processes", property(lambda self: 3))
    with pytest.raises(PlanError, match="--replication-factor 2 but 3 processes"):
        CUDAEngine(Tiny(), None, ExecutionPlan(replication_factor=2), accel)


# --- availability and the --device cuda message -----------------------------------------------------------

@no_gpu_only
def test_unavailable_reason_names_the_cause(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    ok, why = CUDABackend.is_available()
    assert not ok
    assert why.startswith("no CUDA GPU is visible (torch.cuda.device_count() == 0; "
                          "CUDA_VISIBLE_DEVICES=unset")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert "CUDA_VISIBLE_DEVICES=''" in cuda_unavailable_reason()


@no_gpu_only
def test_device_cuda_lists_the_usable_devices(capsys):
    with pytest.raises(BackendUnavailable) as info:
        get_backend("cuda")
    text = str(info.value)
    assert text.startswith("--device cuda: no CUDA GPU is visible") and "Usable here: cpu" in text
    from accelbatch.cli import main

    assert main(["train", "--device", "cuda", "--no-progress", "-ne", "0.01"]) == 2
    err = capsys.readouterr().err
    assert "no CUDA GPU is visible" in err and "Usable here: cpu" in err


def test_the_run_loop_drives_the_cuda_backend(monkeypatch):
    """`run` with --device cuda, its backend forced onto the CPU: the world trains through CUDAEngine."""
    from accelbatch.run import run
    from accelbatch.worlds import create_world

    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: (True, "")))
    monkeypatch.setattr(CUDABackend, "__init__", functools.partialmethod(CUDABackend.__init__, cpu=True))
    opts = Opts(task="babi:1", model="memnn", device="cuda", batchsize=8, device_iterations=2,
                max_train_steps=6, validation_every_n_epochs=-1, eval_splits="", progress=False)
    world = create_world(opts)
    agent = world.get_model_agent()
    before = copy.deepcopy(agent.model.state_dict())
    report = run(world, opts)
    assert report["device"] == "cuda"
    assert isinstance(agent.engine, CUDAEngine) and agent.engine.plan.combined_batch == 16
    assert report["train"]["steps"] == 6 and report["train"]["exs"] == 6 * 16
    assert agent.engine.host_syncs == 6
    assert any(not torch.equal(before[k], v) for k, v in agent.model.state_dict().items())


# --- hogwild ------------------------------------------------------------------------------------------------

def test_hogwild_on_cuda_uses_spawn_or_refuses(monkeypatch):
    assert hogwild_start_method(Opts(device="cpu", numthreads=4)) is None
    assert hogwild_start_method(Opts(device="cuda", numthreads=1)) is None
    monkeypatch.setattr(sys, "platform", "linux")
    assert hogwild_start_method(Opts(device="cuda", numthreads=2)) == "spawn"
    with pytest.raises(HogwildError, match="--replication-factor 2"):
        hogwild_start_method(Opts(device="cuda", numthreads=2, replication_factor=2))
    monkeypatch.setattr(sys, "platform", "win32")
    with pytest.raises(HogwildError, match="CUDA IPC"):
        hogwild_start_method(Opts(device="cuda", numthreads=2))


# --- on a GPU -----------------------------------------------------------------------------------------------

@functools.lru_cache(maxsize=1)
def bench():
    spec = importlib.util.spec_from_file_location("cuda_throughput", ROOT / "bench" / "cuda_throughput.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module      # dataclasses look their module up while the module runs
    spec.loader.exec_module(module)
    return module


def test_the_gpu_measurements_run_on_the_cpu():
    """The code of bench/cuda_throughput.py, tiny and on the CPU (numbers only, no timing claims)."""
    m = bench()
    assert m.weights_vs_cpu(4, 2, device="cpu") <= 1e-6
    assert m.syncs_per_call(d=8, b=4, features=8, hidden=8, device="cpu").counted == 1
    p = m.measure_prefetch(rows=16, features=8, hidden=8, steps=3, device="cpu")
    assert p.compute_s > 0 and p.prefetch_ratio > 0 and p.blocking_ratio > 0
    t = m.measure_throughput(b=8, d=2, features=8, hidden=8, calls=2, device="cpu")
    assert t.engine_exs > 0 and t.naive_exs > 0


@pytest.mark.cuda
@needs_gpu
@pytest.mark.parametrize("d, g", [(1, 1), (4, 2)])
def test_gpu_weights_equal_cpu_weights(d, g):
    assert bench().weights_vs_cpu(d, g) <= 1e-5


@pytest.mark.cuda
@needs_gpu
def test_gpu_engine_returns_host_outputs_and_keeps_weights_on_the_gpu():
    model = Tiny()
    engine = CUDABackend().compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                   ExecutionPlan(micro_batch=4, device_iterations=2, output_mode="all"))
    result = engine.train_step(batches(1, 8)[0])
    assert next(model.parameters()).is_cuda
    assert result.outputs["pred"].device.type == "cpu" and result.outputs["pred"].shape == (8, 2)


@pytest.mark.cuda
@needs_gpu
def test_gpu_prefetch_hides_copies():
    t = bench().measure_prefetch()
    print(f"prefetch/compute {t.prefetch_ratio:.3f}x, blocking/compute {t.blocking_ratio:.3f}x")
    assert t.blocking_ratio > 1.05, "the batch is not copy-heavy enough to show anything"
    assert t.prefetch_ratio <= 1.1


@pytest.mark.cuda
@needs_gpu
def test_gpu_one_host_sync_per_call_with_d8():
    s = bench().syncs_per_call(d=8)
    assert s.counted == 1, s.by_kind
    # torch's sync-debug mode sees the syncs the counter cannot (inside kernels' launch code); the call's
    # own wait may or may not be among those it flags, so at most that one
    assert s.debug_mode <= 1


@pytest.mark.cuda
@needs_gpu
def test_gpu_throughput_beats_a_naive_loop():
    t = bench().measure_throughput()
    print(f"engine {t.engine_exs:.0f} ex/s, naive {t.naive_exs:.0f} ex/s, {t.ratio:.2f}x")
    assert t.ratio >= 1.0


def _gpu_replica(rank: int, plan: ExecutionPlan, state: dict, calls: list) -> dict:
    model = Tiny()
    model.load_state_dict(state)
    backend = CUDABackend()
    backend.setup(Opts(device="cuda", replication_factor=plan.replication_factor))
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
    for batch in calls:
        engine.train_step(plan.shard(batch, rank))
    return {k: v.cpu() for k, v in model.state_dict().items()}


@pytest.mark.cuda
@pytest.mark.multiprocess
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs for DDP over NCCL")
@pytest.mark.timeout(300)
def test_gpu_ddp_two_replicas_equal_one_process():
    plan = ExecutionPlan(micro_batch=4, device_iterations=2, replication_factor=2, gradient_accumulation=2)
    init = Tiny().state_dict()
    calls = batches(2, plan.combined_batch)
    ref_model = Tiny()
    ref_model.load_state_dict(init)
    ref = PlanEngine(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), plan)
    for b in calls:
        ref.train_step(b)
    for state in spawn_cuda_replicas(_gpu_replica, 2, plan, init, calls, timeout_s=240):
        for k, v in ref_model.state_dict().items():
            torch.testing.assert_close(state[k], v, rtol=1e-4, atol=1e-5)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
