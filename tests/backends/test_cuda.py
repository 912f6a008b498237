"""CUDA backend: CPU-checkable conformance (accelerate with cpu=True) and GPU tests that skip without one.

On the CPU: the CUDA engine runs the plan exactly as the CPU plan engine does (weights within 1e-6, same
outputs, rows and loss), accelerate wiring (one state per process: other settings are refused, mixed
precision passed only when asked for), DDP replication over gloo (two processes), one host read per call
and the unavailable message. The order of copies and steps: test_prefetch.py; the NaN policy: test_engine.py.
On a GPU each check of ``bench/cuda_check.py`` runs in a fresh process (this one holds a cpu=True
accelerate state): cuda vs cpu weights, staged prefetch hiding copies, one host sync per call with D=8,
throughput against a plain loop, where weights and outputs live.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import json
import pathlib
import subprocess
import sys

import pytest
import torch
from accelbatch.backends.base import BackendUnavailable, Topology, get_backend
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.cuda import (
    CUDABackend,
    CUDAEngine,
    cuda_unavailable_reason,
    make_accelerator,
    spawn_cuda_replicas,
)
from accelbatch.backends.prefetch import count_host_syncs
from torch import nn

from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan, PlanError

ROOT = pathlib.Path(__file__).resolve().parents[2]
NO_GPU = "needs a CUDA GPU (none visible here): run python bench/cuda_check.py on a GPU machine"
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason=NO_GPU)
no_gpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the behaviour without a GPU")


class Tiny(nn.Module):
    """Mean squared loss over the rows, a per-row output and a 0-dim one."""

    def __init__(self, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.l1 = nn.Linear(6, 5)
        self.l2 = nn.Linear(5, 2)

    def forward(self, batch):
        h = torch.tanh(self.l1(batch["x"]))
        pred = self.l2(h)
        loss = ((pred - batch["y"]) ** 2).mean()
        return {"loss": loss, "pred": pred, "score": pred.sum()}


def batches(n: int, rows: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        out.append({"x": torch.randn(rows, 6, generator=g), "y": torch.randn(rows, 2, generator=g)})
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


def test_a_model_with_sparse_gradients_trains_with_sgd_as_on_the_cpu():
    """-opt sgd is fused on --device cuda, and torch's fused SGD refuses sparse gradients: a model with
    nn.Embedding(sparse=True) failed there with a torch traceback where the cpu trains it."""
    from accelbatch.agents import TorchAgent

    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(20, 4, sparse=True)

        def forward(self, batch):
            return {"loss": self.emb(batch["x"]).pow(2).mean()}

    class SparseAgent(TorchAgent):
        def build_model(self):
            return Sparse()

    weights = {}
    for device in ("cpu", "cuda"):
        torch.manual_seed(0)
        agent = SparseAgent(Opts(device=device, optimizer="sgd", learning_rate=0.5))
        compile_ = (lambda m, o, p: cuda_on_cpu(m, o, p)) if device == "cuda" else PlanEngine
        engine = compile_(agent.model, agent.optimizer, ExecutionPlan(micro_batch=4))
        for step in range(3):
            engine.train_step({"x": torch.arange(step, step + 4)})
        weights[device] = agent.model.emb.weight.detach().clone()
    assert torch.allclose(weights["cpu"], weights["cuda"]) and not torch.equal(weights["cpu"][0], torch.zeros(4))


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
    assert backend.setup(Opts(device="cuda", mixed_precision="no")) == Topology() == backend.topology
    engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan(micro_batch=2))
    assert engine.accelerator.device.type == "cpu" and engine.accelerator.num_processes == 1
    assert engine.model is model and engine.module is model       # no DDP wrapper in one process
    result = engine.train_step(batches(1, 2)[0])
    assert isinstance(result.loss, float) and result.outputs["pred"].device.type == "cpu"
    state = engine.state_dict()
    assert set(state) == {"model", "optimizer"}
    engine.load_state_dict(state)
    assert backend.rank == 0 and backend.world_size == 1 and backend.is_main_process()
    assert backend.reduce_metrics({"exs": 3}) == {"exs": 3}
    assert backend.decide(True, False) == (True, False) and backend.all_gather_object(5) == [5]
    backend.teardown()
    backend.teardown()


def run_isolated(name: str) -> None:
    """Run this module's function ``name`` in a fresh process: accelerate keeps one state per process, and
    this one holds a cpu=True state without mixed precision."""
    proc = subprocess.run([sys.executable, __file__, "--isolated", name], cwd=ROOT, text=True,
                          capture_output=True, timeout=240, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]


def bf16_autocast_comes_from_accelerate() -> None:
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
    # accelerate's state is this process's: a backend that asks for no mixed precision gets accelerate's
    plain = CUDABackend(cpu=True)
    plain.setup(Opts(device="cuda"))
    assert plain.accelerator.mixed_precision == "bf16"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bf16_autocast_comes_from_accelerate():
    run_isolated("bf16_autocast_comes_from_accelerate")


def test_a_second_accelerator_with_other_settings_is_refused(monkeypatch):
    make_accelerator(cpu=True)                    # this process's state: the CPU, no mixed precision
    with pytest.raises(PlanError, match="keeps one state per process.*new process"):
        make_accelerator(cpu=True, mixed_precision="bf16")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PlanError, match="accelerate already runs this process on cpu"):
        make_accelerator(cpu=False)                             # accelerate alone would hand back the CPU one


def test_mixed_precision_is_passed_to_accelerate_only_when_asked(monkeypatch):
    import accelerate
    import accelerate.state

    made = []
    monkeypatch.setattr(accelerate.state, "is_initialized", lambda: False)
    monkeypatch.setattr(accelerate, "Accelerator", lambda **kwargs: made.append(kwargs))
    make_accelerator(cpu=True)
    make_accelerator(cpu=True, mixed_precision="bf16")
    handlers = [m.pop("kwargs_handlers") for m in made]
    assert made == [{"cpu": True}, {"cpu": True, "mixed_precision": "bf16"}]
    assert all([type(h).__name__ for h in hs] == ["DistributedDataParallelKwargs"] for hs in handlers)
    assert all(hs[0].gradient_as_bucket_view and not hs[0].static_graph for hs in handlers)
    made.clear()
    make_accelerator(cpu=True, static_graph=True)
    assert made[0]["kwargs_handlers"][0].static_graph


def test_fp16_on_the_cpu_is_refused():
    with pytest.raises(PlanError, match="fp16 needs a GPU"):
        make_accelerator(cpu=True, mixed_precision="fp16")


# --- host reads (the order of copies and steps: test_prefetch.py) --------------------------------------

def test_one_host_read_per_call_with_eight_device_iterations():
    plan = ExecutionPlan(micro_batch=4, device_iterations=8, output_mode="all")
    model = Tiny()
    engine = cuda_on_cpu(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
    batch = batches(1, plan.combined_batch)[0]
    engine.train_step(batch)
    with count_host_syncs(include_cpu_reads=True) as syncs:
        result = engine.train_step(batch)
    assert syncs.by_kind == {"Tensor.tolist": 1}, syncs.by_kind   # loss and NaN flags of all 8 updates
    # the warm-up call read its first update's flag on the host too (the optimizer had no state yet)
    assert result.extras["host_syncs"] == 1 and engine.host_syncs == 2 + 1 and result.updates == 8
    with count_host_syncs(include_cpu_reads=True) as syncs:
        engine.eval_step(batch)
    assert syncs.total == 1


# --- replication: DDP through accelerate, two processes on gloo ------------------------------------------

def _replica(rank: int, plan: ExecutionPlan, state: dict, calls: list, static_graph: bool = False) -> dict:
    """One replica, twice: fed its shard (default), and fed the whole call with outputs gathered."""
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda", replication_factor=plan.replication_factor, ddp_static_graph=static_graph))
    out: dict = {}
    for name, kwargs in (("shard", {}), ("full", {"inputs": "full", "gather_outputs": True})):
        model = Tiny()
        model.load_state_dict(state)
        engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), plan, **kwargs)
        results = [engine.train_step(batch if name == "full" else plan.shard(batch, rank)) for batch in calls]
        out[name] = {"state": model.state_dict(), "losses": [r.loss for r in results],
                     "outputs": [r.outputs for r in results], "rows": [r.rows for r in results],
                     "wrapper": type(engine.module).__name__,
                     "bucket_view": getattr(engine.module, "gradient_as_bucket_view", None),
                     "static_graph": getattr(engine.module, "static_graph", None)}
    backend.teardown()
    return out


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_static_graph_refuses_a_first_call_that_is_an_epoch_tail():
    plan = ExecutionPlan(micro_batch=3, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         drop_last=False, output_mode="all")
    with pytest.raises(Exception, match="--ddp-static-graph: the run's first call is an epoch tail"):
        spawn_cuda_replicas(_replica, 2, plan, Tiny().state_dict(), batches(1, 14, seed=9), True, timeout_s=100,
                            cpu=True)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.parametrize("static_graph", [False, True], ids=["dynamic-graph", "static-graph"])
def test_two_replicas_with_ddp_equal_one_process(static_graph):
    plan = ExecutionPlan(micro_batch=3, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         drop_last=False, output_mode="all")
    init = Tiny().state_dict()
    # two full calls, then an epoch tail in which replica 1 has no micro-batch in the last update
    calls = batches(2, plan.combined_batch) + batches(1, 14, seed=9)
    ref_model = Tiny()
    ref_model.load_state_dict(init)
    ref = PlanEngine(ref_model, torch.optim.SGD(ref_model.parameters(), lr=0.1), plan)
    ref_results = [ref.train_step(b) for b in calls]
    results = spawn_cuda_replicas(_replica, 2, plan, init, calls, static_graph, timeout_s=100, cpu=True)
    for mode in ("shard", "full"):  # each replica reports its own micro-batches' loss: on full calls (equal
        # shares) their mean is the single process's figure
        mean = [sum(both[mode]["losses"][c] for both in results) / 2 for c in range(2)]
        assert mean == pytest.approx([r.loss for r in ref_results[:2]], rel=1e-5)
    for rank, both in enumerate(results):
        for res in both.values():
            assert res["wrapper"] == "DistributedDataParallel" and res["bucket_view"] is True
            assert res["static_graph"] is static_graph
            for k, v in ref_model.state_dict().items():
                torch.testing.assert_close(res["state"][k], v, rtol=0, atol=1e-6)
        # fed its shard, a replica returns its own micro-batches' outputs, rows indexing the shard
        shard = plan.shard(calls[0], rank)
        assert torch.equal(both["shard"]["rows"][0], torch.arange(shard["x"].shape[0]))
        # fed the whole call with gather_outputs, every rank returns the whole call's outputs in order
        for got, want in zip(both["full"]["outputs"], ref_results):
            torch.testing.assert_close(got["pred"], want.outputs["pred"], rtol=1e-5, atol=1e-6)
        assert torch.equal(both["full"]["rows"][0], ref_results[0].rows)


def test_a_tail_all_reduces_gradients_and_loss_in_one_flat_buffer(monkeypatch):
    """An epoch tail runs the bare module (DDP cannot all-reduce it): one all-reduce for every gradient and
    the loss, not one per parameter. Two replicas are faked with an all-reduce that adds an equal peer."""
    import torch.distributed as dist

    model = Tiny()
    engine = cuda_on_cpu(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan(micro_batch=2))
    engine.hooks.world = 2
    calls = []

    def all_reduce(tensor, *args, **kwargs):
        calls.append(tensor.numel())
        tensor.mul_(2)

    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    model(batches(1, 2)[0])["loss"].backward()
    grads = [p.grad.clone() for p in model.parameters()]
    total = engine.hooks.reduce(torch.tensor(1.5), bare=True)
    assert calls == [sum(p.numel() for p in model.parameters()) + 1]
    assert float(total) == 3.0
    for p, g in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, 2 * g, rtol=0, atol=0)


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


def test_a_gpu_without_accelerate_names_the_extra_to_install(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "accelerate" else real(name, *a))
    ok, why = CUDABackend.is_available()
    assert not ok and why == ("Hugging Face accelerate, which the cuda backend runs on, is not installed: pip "
                              "install 'accelbatch[cuda]' (or pip install accelerate)")
    with pytest.raises(BackendUnavailable) as refused:  # the device said once (its message named it twice)
        get_backend("cuda")
    assert str(refused.value).count("--device cuda") == 1, refused.value
    monkeypatch.setattr(importlib.util, "find_spec", real)
    assert CUDABackend.is_available() == (True, "")


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
    from accelbatch.build import create_world
    from accelbatch.run import run

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
    # one host wait per call, and one more: the first update reads its NaN flag on the host while the
    # optimizer has no state yet (state created by a step cannot be put back)
    assert agent.engine.host_syncs == 6 + 1
    assert any(not torch.equal(before[k], v) for k, v in agent.model.state_dict().items())


@pytest.mark.slow
def test_the_run_loop_stages_each_next_call_on_the_cuda_backend(monkeypatch):
    """`accelbatch train --device cuda` without workers: the loader front end fetches each call one step
    ahead and stages it (its copy then overlaps the current step); the weights are the --device cpu run's
    (no prefetch, teacher and agent clones)."""
    from accelbatch.build import create_world
    from accelbatch.loader_world import LoaderWorld
    from accelbatch.run import run

    monkeypatch.setattr(CUDABackend, "is_available", classmethod(lambda cls: (True, "")))
    monkeypatch.setattr(CUDABackend, "__init__", functools.partialmethod(CUDABackend.__init__, cpu=True))
    staged, stepped = [], []
    stage, train_step = CUDAEngine.stage, CUDAEngine.train_step
    monkeypatch.setattr(CUDAEngine, "stage", lambda self, b: (staged.append(id(b)), stage(self, b))[1])
    monkeypatch.setattr(CUDAEngine, "train_step", lambda self, b: (stepped.append(id(b)), train_step(self, b))[1])
    # sgd: fused (cuda) and plain (cpu) SGD agree to rounding; Adam's ~lr steps on near-zero gradients
    # would turn rounding into differences of the order of lr
    opts = Opts(task="babi:1", model="memnn", device="cuda", batchsize=8, device_iterations=2, optimizer="sgd",
                learning_rate=0.1, max_train_steps=6, validation_every_n_epochs=-1, eval_splits="", progress=False)
    models = {}
    for device in ("cuda", "cpu"):
        world = create_world(opts.replace(device=device))
        models[device] = world.get_model_agent().model
        if device == "cuda":
            assert isinstance(world, LoaderWorld)
        run(world, opts.replace(device=device))
    assert len(stepped) == 6 and stepped[1:] == staged[:5]     # every call after the first was staged first
    for p, q in zip(models["cuda"].parameters(), models["cpu"].parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6)


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


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_cuda_check_runs_each_check_in_a_fresh_process(tmp_path):
    """bench/cuda_check.py on the CPU: a bf16 check, a fp32 one and the CLI runs in separate processes, one
    JSON."""
    out = tmp_path / "check.json"
    proc = subprocess.run([sys.executable, "bench/cuda_check.py", "--no-tests", "--device", "cpu", "--only",
                           "weights_bf16_D4_G2,host_syncs_D8,train_memnn,train_feeds", "--json", str(out)], cwd=ROOT,
                          text=True, capture_output=True, timeout=280, check=False)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    figures = json.loads(out.read_text())["figures"]
    assert 0 < figures["weights_bf16_D4_G2"]["max_abs_diff"] <= 5e-2   # bf16 differs, a little
    assert figures["host_syncs_D8"]["counted"] == 1 and not figures["host_syncs_D8"]["failure"]
    train = figures["train_memnn"]   # on the CPU both sides are the CPU: the same seed trains the same weights
    assert train["steps"] == 30 and train["weights_max_abs_diff_vs_cpu"] == 0.0 and train["async_equals_sync"]
    assert not train["failure"] and len(set(train["valid_accuracy"].values())) == 1
    feeds = figures["train_feeds"]   # each feed against its sync reference: on the CPU all bit for bit equal
    assert feeds["steps"] == 8 and not feeds["failure"] and len(feeds["verdict"]) == 6
    assert set(feeds["verdict"].values()) == {"equal"}


def test_cuda_check_judges_a_feed_against_the_devices_own_noise():
    """train_feeds' verdicts on the figures of an H200 run: dynamic batching repeated in sync was 4.0e-7 apart
    (valid loss in its last digits), so async dynamic batching 2.1e-7 apart is noise; a feed apart on a workload
    the device repeats exactly, or further apart than noise, or with another accuracy, differs."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cuda_check

    reference = {"async": "sync", "workers_2": "sync", "dynamic_again": "dynamic", "async_dynamic": "dynamic"}

    def judge(diff, metrics):
        return cuda_check.judge_feeds(diff, metrics, reference, {"dynamic": "dynamic_again"})

    h200 = {"async": 0.0, "workers_2": 0.0, "dynamic_again": 4.0e-7, "async_dynamic": 2.1e-7}
    metrics = {"async": [], "workers_2": [], "dynamic_again": ["loss"], "async_dynamic": ["loss"]}
    assert judge(h200, metrics) == {"async": "equal", "workers_2": "equal", "dynamic_again": "within device noise",
                                    "async_dynamic": "within device noise"}
    assert judge({**h200, "dynamic_again": 0.0}, {**metrics, "dynamic_again": []})["async_dynamic"] == "differs"
    assert judge({**h200, "async_dynamic": 3e-3}, metrics)["async_dynamic"] == "differs"
    assert judge(h200, {**metrics, "async_dynamic": ["accuracy", "loss"]})["async_dynamic"] == "differs"
    assert judge({**h200, "workers_2": 1e-7}, metrics)["workers_2"] == "differs"   # its workload repeats exactly


def gpu_check(name: str) -> dict:
    """One check of bench/cuda_check.py in a fresh process (this one holds a cpu=True accelerate state)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import cuda_check

    figures = cuda_check.run_isolated(name, "cuda")
    print(name, figures)
    assert not figures.get("failure"), figures["failure"]
    return figures


@pytest.mark.cuda
@pytest.mark.multiprocess   # each check runs in a fresh process
@needs_gpu
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["weights_D1_G1", "weights_D4_G2", "weights_bf16_D4_G2",
                                  "weights_fp16_D4_G2", "placement", "staged_prefetch", "host_syncs_D8",
                                  "host_syncs_fp16_D8",
                                  "throughput", "train_memnn", "train_generator", "train_feeds"])
def test_gpu_check(name):
    gpu_check(name)


def _gpu_replica(rank: int, plan: ExecutionPlan, state: dict, calls: list) -> dict:
    """One DDP replica on its GPU; its NCCL group is torn down however it ends (a live communicator at
    exit can leave a peer waiting until NCCL's watchdog aborts it)."""
    model = Tiny()
    model.load_state_dict(state)
    backend = CUDABackend()
    try:
        backend.setup(Opts(device="cuda", replication_factor=plan.replication_factor))
        engine = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
        for batch in calls:
            engine.train_step(plan.shard(batch, rank))
        return {k: v.cpu() for k, v in model.state_dict().items()}
    finally:
        backend.teardown()


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
    if sys.argv[1:2] == ["--isolated"]:
        globals()[sys.argv[2]]()
        sys.exit(0)
    sys.exit(pytest.main([__file__, "-q", *sys.argv[1:]]))
