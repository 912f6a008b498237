"""--device ipu: half precision (issue 18 item 6) and the executable cache / synthetic data options (item 7)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator as poptorch
from accelbatch.backends.ipu import IPUBackend
from helpers import needs_cpu_half

import accelbatch as ab
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import ExecutionPlan, PlanError

from .test_ipu import Classifier, data


def run_memnn(tmp_path=None, steps: int = 8, **kw):
    opts = Opts(task="babi:1", model="memnn", batchsize=4, embedding_size=16, max_train_steps=steps, num_epochs=1,
                validation_every_n_epochs=-1, eval_splits="", progress=False, device="ipu", ipu_emulator=True,
                seed=3, **kw)
    world = ab.create_world(opts)
    report = ab.run(world, opts)
    return report, world.get_model_agent()


# --- half precision -------------------------------------------------------------------------------------


@pytest.mark.slow
@needs_cpu_half
def test_fp16_memnn_trains_half_weights_with_figures_close_to_fp32():
    ref, _ = run_memnn()
    half, agent = run_memnn(mixed_precision="fp16")
    assert {p.dtype for p in agent.model.parameters()} == {torch.float16}  # trained in half, no master copy
    assert agent.optimizer.loss_scaling == 128.0
    assert half["train"]["steps"] == ref["train"]["steps"] == 8
    assert torch.isfinite(torch.tensor(half["train"]["loss"]))
    assert half["train"]["loss"] == pytest.approx(ref["train"]["loss"], rel=1e-2)
    assert half["train"]["accuracy"] == pytest.approx(ref["train"]["accuracy"], abs=0.05)


@needs_cpu_half
def test_a_loss_scaling_that_overflows_float16_is_named_when_the_loss_is_not_finite():
    """The static scale, not the rate, is what to lower: it overflows at any -lr."""
    from accelbatch.backends.base import NonFiniteLoss

    with pytest.raises(NonFiniteLoss, match=r"lower --ipu-loss-scaling \(1e\+06: the scaled loss"):
        run_memnn(steps=2, mixed_precision="fp16", ipu_loss_scaling=1e6, learning_rate=1e-6)


def test_bf16_is_refused_in_one_line():
    with pytest.raises(PlanError, match=r"^--mixed-precision bf16: IPUs have no bfloat16 arithmetic") as exc:
        IPUBackend().setup(Opts(device="ipu", ipu_emulator=True, mixed_precision="bf16"))
    assert "\n" not in str(exc.value)


@pytest.mark.parametrize("kw, says", [({"ipu_loss_scaling": 64.0}, "applies to --mixed-precision fp16"),
                                      ({"ipu_loss_scaling": -1.0, "mixed_precision": "fp16"}, "positive")])
def test_loss_scaling_option_errors(kw, says):
    with pytest.raises(PlanError, match=says):
        IPUBackend().setup(Opts(device="ipu", ipu_emulator=True, **kw))


@needs_cpu_half
def test_fp16_engine_casts_float_inputs_and_sets_partials_and_loss_scaling():
    torch.manual_seed(0)
    model = Classifier()
    backend = IPUBackend()
    backend.setup(Opts(device="ipu", ipu_emulator=True, mixed_precision="fp16", ipu_loss_scaling=32.0))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    engine = backend.compile(model, opt, ExecutionPlan(micro_batch=4))
    assert model.lin.weight.dtype == torch.float16 and opt.loss_scaling == 32.0
    result = engine.train_step(data(4))  # float32 x: a half Linear would refuse it uncast
    assert result.loss is not None and result.loss == result.loss
    options = engine._active.executor.options
    assert options._Popart.options["partialsTypeMatMuls"] == "float"
    assert options._Popart.options["convolutionOptions"] == {"partialsType": "float"}


@needs_cpu_half
def test_emulator_half_update_unscales_and_steps_in_float32():
    """One SGD step of a half Linear with loss scaling S: gradients of (S x loss) in float16, accumulated in
    float32, divided by S and by G, the update made in float32 and rounded to float16 (computed by hand)."""
    torch.manual_seed(1)
    x = torch.randn(4, 3).half()
    y = torch.randint(0, 2, (4,))
    model = torch.nn.Linear(3, 2).half()
    ref = torch.nn.Linear(3, 2).half()
    ref.load_state_dict(model.state_dict())

    class WithLoss(torch.nn.Module):
        def __init__(self, lin):
            super().__init__()
            self.lin = lin

        def forward(self, x, y):
            out = self.lin(x)
            return out, F.cross_entropy(out.float(), y)

    S, lr, G = 512.0, 0.5, 2
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    opt.loss_scaling = S
    opts = poptorch.Options()
    opts.Training.gradientAccumulation(G)
    ex = poptorch.trainingModel(WithLoss(model), options=opts, optimizer=opt)
    ex(x, y)
    grads = [torch.zeros(p.shape) for p in ref.parameters()]
    for g in range(G):
        ref.zero_grad()
        rows = slice(2 * g, 2 * g + 2)
        (F.cross_entropy(ref(x[rows]).float(), y[rows]) * S).backward()
        grads = [a + p.grad.float() for a, p in zip(grads, ref.parameters())]
    for p, a, q in zip(ref.parameters(), grads, model.parameters()):
        want = (p.detach().float() - lr * (a / (S * G))).half()
        assert q.dtype == torch.float16
        assert torch.equal(q.detach(), want)


@needs_cpu_half
def test_emulator_loss_scaling_keeps_float16_gradients_from_underflowing():
    """A loss whose float16 gradients underflow to zero moves the weights only with loss scaling."""
    moved = {}
    for S in (1.0, 4096.0):
        w = torch.nn.Parameter(torch.ones(4, dtype=torch.float16))

        class Tiny(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.w = w

            def forward(self, x):
                return poptorch.identity_loss((self.w * x).sum() * 1e-8, reduction="none")

        opt = torch.optim.SGD([w], lr=1e6)
        opt.loss_scaling = S
        poptorch.trainingModel(Tiny(), optimizer=opt)(torch.ones(1, 4, dtype=torch.float16))
        moved[S] = float((w.detach().float() - 1).abs().max())
    assert moved[1.0] == 0.0 and moved[4096.0] > 0.0


def test_precision_options_are_recorded_and_checked():
    opts = poptorch.Options()
    opts.Precision.setPartialsType(torch.half).enableStochasticRounding(True)
    assert opts._Popart.options["partialsTypeMatMuls"] == "half"
    assert opts._Popart.options["enableStochasticRounding"] is True
    with pytest.raises(ValueError, match="setPartialsType should be either torch.float or torch.half"):
        opts.Precision.setPartialsType(torch.bfloat16)
    opts._freeze()
    with pytest.raises(AttributeError, match="Can't modify frozen Options"):
        opts.Precision.setPartialsType(torch.float)


# --- executable cache and synthetic data -----------------------------------------------------------------


def test_second_run_with_the_same_cache_dir_loads_every_graph(tmp_path):
    cache = str(tmp_path / "cache")
    first, _ = run_memnn(steps=3, ipu_cache_dir=cache)
    second, _ = run_memnn(steps=3, ipu_cache_dir=cache)
    graphs = first["ipu"]["compilations"]
    assert graphs >= 1 and first["ipu"]["cached"] == 0
    fixed = {k: v for k, v in second["ipu"].items() if not k.startswith("latency_")}  # host times vary
    assert fixed == {"poptorch": "poptorch-emulator", "compilations": 0, "cached": graphs}
    assert len(list((tmp_path / "cache").iterdir())) == graphs
    assert second["train"]["loss"] == first["train"]["loss"]  # a loaded graph runs the same model


def test_emulator_cache_hit_needs_the_same_inputs(tmp_path):
    def make():
        opts = poptorch.Options().enableExecutableCaching(str(tmp_path))
        return poptorch.inferenceModel(torch.nn.Linear(3, 2), opts)

    a = make()
    a(torch.ones(2, 3))
    b = make()
    b(torch.ones(2, 3))
    c = make()
    c(torch.ones(4, 3))
    assert (a.loaded_from_cache, b.loaded_from_cache, c.loaded_from_cache) == (False, True, False)


def test_synthetic_data_replaces_host_inputs_by_device_made_ones():
    class Echo(torch.nn.Module):
        def forward(self, x, ids):
            return x * 1, ids + 0

    opts = poptorch.Options().randomSeed(7).enableSyntheticData(True)
    ex = poptorch.inferenceModel(Echo(), opts)
    x, ids = torch.full((3, 2), 5.0), torch.full((3,), 9)
    out_x, out_ids = ex(x, ids)
    want = torch.randn((3, 2), generator=torch.Generator().manual_seed(7))
    assert torch.equal(out_x, want) and torch.equal(out_ids, torch.zeros(3, dtype=torch.int32))
    assert opts._Popart.options["syntheticDataMode"] == 2


def test_cli_synthetic_data_option_reaches_the_options():
    backend = IPUBackend()
    backend.setup(Opts(device="ipu", ipu_emulator=True, ipu_synthetic_data=True, ipu_cache_dir="/tmp/unused-cache"))
    options = backend.options(ExecutionPlan())
    assert options._Popart.options["syntheticDataMode"] == 2
    assert options._Popart.options["cachePath"] == "/tmp/unused-cache"


@needs_cpu_half
def test_fp16_resume_keeps_the_optimizer_states_in_float32():
    """Loading a checkpoint into a half model keeps Adam's moments float32, bit for bit (rounded to float16, a
    small second moment becomes 0 and the next update is inf)."""
    def engine():
        torch.manual_seed(0)
        model = Classifier()
        backend = IPUBackend()
        backend.setup(Opts(device="ipu", ipu_emulator=True, mixed_precision="fp16"))
        return backend.compile(model, torch.optim.Adam(model.parameters(), lr=0.01), ExecutionPlan(micro_batch=4))

    first = engine()
    first.train_step(data(4))
    saved = first.state_dict()
    moments = [s["exp_avg_sq"] for s in saved["optimizer"]["ipu_state"].values()]  # the device's state
    assert all(m.dtype == torch.float32 for m in moments) and min(float(m[m > 0].min()) for m in moments) < 6e-8
    second = engine()
    second.load_state_dict(saved)
    assert {p.dtype for p in second.model.parameters()} == {torch.float16}
    loaded = [s["exp_avg_sq"] for s in second.optimizer.state_dict()["ipu_state"].values()]
    assert all(torch.equal(a, b) for a, b in zip(moments, loaded))
    result = second.train_step(data(4, seed=2))
    assert result.loss == result.loss and all(torch.isfinite(p).all() for p in second.model.parameters())


def test_available_memory_proportion_option_reaches_the_options():
    backend = IPUBackend()
    backend.setup(Opts(device="ipu", ipu_emulator=True, ipu_available_memory_proportion=0.3))
    assert backend.options(ExecutionPlan(micro_batch=2, replication_factor=2)).available_memory_proportion == {0: 0.3}
    for bad in (0.0, 1.5):
        with pytest.raises(PlanError, match=r"^--ipu-available-memory-proportion .*: give a proportion in "
                                            r"\(0, 1\]") as exc:
            IPUBackend().setup(Opts(device="ipu", ipu_emulator=True, ipu_available_memory_proportion=bad))
        assert "\n" not in str(exc.value)
    with pytest.raises(OptionError, match=r"^--ipu-available-memory-proportion: expected a finite number"):
        Opts(device="ipu", ipu_emulator=True, ipu_available_memory_proportion=float("nan"))


# --- latency from getLatency() ---------------------------------------------------------------------------


def test_report_carries_round_trip_latency_from_get_latency():
    report, _ = run_memnn(steps=3)
    ipu = report["ipu"]
    assert 0 < ipu["latency_min_ms"] <= ipu["latency_mean_ms"] <= ipu["latency_max_ms"]
    rest = {k: v for k, v in ipu.items() if not k.startswith("latency_")}
    assert set(rest) == {"poptorch", "compilations"}  # nothing else in the report takes host times
    assert rest["poptorch"] == "poptorch-emulator" and rest["compilations"] >= 1


def test_latency_left_out_when_poptorch_has_no_get_latency():
    from accelbatch.backends.ipu_latency import LatencyStats

    class Old:  # a poptorch without performance counters
        pass

    class Timed:
        def getLatency(self):
            return (0.002, 0.004, 0.003)

    stats = LatencyStats()
    stats.record(Old())
    assert stats.report() is None
    stats.record(Timed())
    stats.record(Timed())
    assert stats.report() == {"latency_min_ms": 2.0, "latency_mean_ms": 3.0, "latency_max_ms": 4.0}


def test_a_failing_get_latency_never_stops_the_run():
    from accelbatch.backends.ipu_latency import LatencyStats

    class Broken:
        def getLatency(self):
            raise AssertionError("Internal PopTorch error: mismatching number of start timestamps")

    stats = LatencyStats()
    stats.record(Broken())
    assert stats.report() is None
