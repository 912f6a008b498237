"""The IPU backend on the poptorch emulator: selection, option mapping, CPU conformance, padding, output
modes, compilation counting, executor switching and the loader.

References are written out here (plain torch, the DESIGN table of output modes, literal option values) or
are the CPU engine, which is tested against plain-torch loops in test_cpu_engine.py.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator
from accelbatch.backends.base import BackendUnavailable, available_backends, get_backend
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.ipu import EMULATOR_ENV, IPUBackend
from accelbatch.backends.ipu_engine import IPUEngine, plan_options

import accelbatch as ab
from accelbatch.build import attach_runtime
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan, PlanError

# --- helpers --------------------------------------------------------------------------------------------


class Classifier(torch.nn.Module):
    """forward(batch) -> {"scores", "pred" (int64), "loss"}; all-zero rows (padding) are left out of the loss."""

    def __init__(self, d_in: int = 4, classes: int = 3):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, classes)

    def forward(self, batch):
        scores = self.lin(batch["x"])
        out = {"scores": scores, "pred": scores.argmax(dim=1)}
        if "t" in batch:
            real = (batch["x"].abs().sum(dim=1) > 0).float()
            per_row = F.cross_entropy(scores, batch["t"], reduction="none")
            out["loss"] = (per_row * real).sum() / real.sum().clamp(min=1.0)
        return out


def data(n: int, seed: int = 1, d_in: int = 4, classes: int = 3):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d_in, generator=g), "t": torch.randint(0, classes, (n,), generator=g)}


def fresh(seed: int = 0) -> Classifier:
    torch.manual_seed(seed)
    return Classifier()


def emulated_backend(seed: int = 0) -> IPUBackend:
    backend = IPUBackend()
    backend.setup(Opts(ipu_emulator=True, seed=seed))
    return backend


def ipu_engine(model, plan, lr=0.1, backend=None) -> IPUEngine:
    backend = backend or emulated_backend()
    return backend.compile(model, torch.optim.SGD(model.parameters(), lr=lr), plan)


@pytest.fixture
def no_poptorch(monkeypatch):
    """As on a machine without the Poplar SDK: poptorch cannot be imported, no emulator switch set."""
    monkeypatch.delenv(EMULATOR_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "poptorch", None)


# --- selection ------------------------------------------------------------------------------------------


def test_ipu_without_poptorch_fails_with_one_line_naming_the_sdk_and_the_switch(no_poptorch):
    with pytest.raises(BackendUnavailable) as err:
        get_backend("ipu")
    text = str(err.value)
    assert "\n" not in text
    assert text.startswith("--device ipu: poptorch is not installed")
    for part in ("Poplar SDK", "not on PyPI", "--ipu-emulator", f"{EMULATOR_ENV}=1", "Usable here: cpu"):
        assert part in text, part
    assert "Poplar SDK" in available_backends()["ipu"]
    with pytest.raises(BackendUnavailable):
        get_backend("ipu", Opts(ipu_emulator=False))
    with pytest.raises(BackendUnavailable):
        IPUBackend().setup(Opts())


def test_cli_device_ipu_without_poptorch_is_a_usage_error(no_poptorch, capsys):
    from accelbatch.cli import main

    code = main(["train", "--device", "ipu", "-bs", "4", "--max-train-steps", "1", "--no-progress"])
    assert code == 2
    err = capsys.readouterr().err
    assert "Poplar SDK" in err and "--ipu-emulator" in err


@pytest.mark.parametrize("how", ["option", "env"])
def test_emulator_runs_when_asked(no_poptorch, monkeypatch, how):
    opts = Opts(ipu_emulator=True) if how == "option" else Opts()  # env: the option not given
    if how == "env":
        monkeypatch.setenv(EMULATOR_ENV, "1")
    assert get_backend("ipu", opts) is IPUBackend
    assert IPUBackend.is_available(opts) == (True, "")
    backend = IPUBackend()
    backend.setup(opts)
    assert backend.implementation == "poptorch-emulator"
    assert backend.poptorch is poptorch_emulator
    assert "emulator" in backend.describe()


def test_env_switch_off_values_do_not_select_the_emulator(no_poptorch, monkeypatch):
    monkeypatch.setenv(EMULATOR_ENV, "0")
    assert IPUBackend.is_available()[0] is False


def test_no_ipu_emulator_wins_over_the_environment(no_poptorch, monkeypatch, capsys):
    """With ACCELBATCH_IPU_EMULATOR=1 exported, --no-ipu-emulator asked for IPUs and ran the emulator."""
    from accelbatch.cli import main

    monkeypatch.setenv(EMULATOR_ENV, "1")
    assert IPUBackend.is_available(Opts())[0] is True  # the option not given: the environment says
    assert IPUBackend.is_available(Opts(ipu_emulator=False))[0] is False
    assert main(["train", "--device", "ipu", "--no-ipu-emulator", "-bs", "4", "-tstep", "1", "--no-progress"]) == 2
    assert "--device ipu: poptorch is not installed" in capsys.readouterr().err
    assert Opts.from_args(["--device", "ipu"]).ipu_emulator is None


def test_real_poptorch_when_it_imports_and_the_emulator_when_asked(monkeypatch):
    monkeypatch.delenv(EMULATOR_ENV, raising=False)
    fake = types.ModuleType("poptorch")
    fake.__version__ = "3.3.0"
    monkeypatch.setitem(sys.modules, "poptorch", fake)
    backend = IPUBackend()
    backend.setup(Opts())
    assert backend.poptorch is fake and backend.implementation == "poptorch"
    assert backend.describe() == "ipu: poptorch on IPU 3.3.0"
    asked = IPUBackend()
    asked.setup(Opts(ipu_emulator=True))  # an explicit request wins, to check IPU code on an SDK machine
    assert asked.implementation == "poptorch-emulator"


def test_a_poptorch_that_fails_to_import_is_reported(monkeypatch, tmp_path):
    monkeypatch.delenv(EMULATOR_ENV, raising=False)
    (tmp_path / "poptorch.py").write_text("raise ImportError('libpoplar.so: cannot open shared object file')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "poptorch", raising=False)
    ok, why = IPUBackend.is_available()
    assert not ok
    assert "poptorch failed to import (ImportError: libpoplar.so" in why and "--ipu-emulator" in why


# --- options --------------------------------------------------------------------------------------------

OPTION_CASES = [
    # plan kwargs, expected (D, R, G, reduction, output mode, period)
    (dict(micro_batch=2), (1, 1, 1, "Mean", "Final", 1)),
    (dict(micro_batch=2, device_iterations=4, output_mode="all"), (4, 1, 1, "Mean", "All", 1)),
    (dict(micro_batch=3, replication_factor=2, reduction="sum", output_mode="sum"), (1, 2, 1, "Sum", "Sum", 1)),
    (dict(micro_batch=1, device_iterations=2, replication_factor=2, gradient_accumulation=2),
     (2, 2, 2, "Mean", "Final", 1)),
    (dict(micro_batch=1, device_iterations=6, output_mode="everyn", output_return_period=3),
     (6, 1, 1, "Mean", "EveryN", 3)),
    # EveryN with G > 1: the device returns every micro-batch of device iterations N-1, 2N-1, ...
    (dict(micro_batch=1, device_iterations=2, gradient_accumulation=2, output_mode="everyn",
          output_return_period=2), (2, 1, 2, "Mean", "EveryN", 2)),
]


@pytest.mark.parametrize("kwargs, expected", OPTION_CASES)
def test_plan_maps_to_poptorch_options(kwargs, expected):
    pt = poptorch_emulator
    d, r, g, reduction, mode, period = expected
    rng = torch.get_rng_state()
    opts = plan_options(pt, ExecutionPlan(**kwargs), seed=7)
    assert torch.equal(torch.get_rng_state(), rng)  # the host's random stream is left alone
    assert opts.device_iterations == d
    assert opts.replication_factor == r
    assert opts.Training.gradient_accumulation == g
    assert opts.Training.accumulation_and_replication_reduction_type == getattr(pt.ReductionType, reduction)
    assert opts.output_mode == getattr(pt.OutputMode, mode)
    assert opts.output_return_period == period
    assert opts.random_seed == 7
    inference = plan_options(pt, ExecutionPlan(**kwargs).for_inference())
    assert inference.Training.gradient_accumulation == 1
    assert inference.device_iterations == d and inference.replication_factor == r
    assert inference.output_mode == pt.OutputMode.All
    assert not inference.exists("random_seed")


def test_engine_wrappers_carry_the_options_and_share_host_weights():
    model = fresh()
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         reduction="sum")
    engine = ipu_engine(model, plan)
    engine.train_step(data(plan.combined_batch))
    engine.eval_step(data(3))
    (train_ex, eval_ex) = [e.executor for e in engine._executors.values()]
    assert train_ex.training and not eval_ex.training
    o = train_ex.options
    assert (o.device_iterations, o.replication_factor, o.Training.gradient_accumulation) == (2, 2, 2)
    assert o.Training.accumulation_and_replication_reduction_type == poptorch_emulator.ReductionType.Sum
    assert eval_ex.options.Training.gradient_accumulation == 1
    assert all(p is q for p, q in zip(train_ex.model.model.parameters(), model.parameters()))


# --- conformance with the CPU engine --------------------------------------------------------------------

# (D, R, G, reduction): the four plans of the issue, and Sum (with Mean, G = 2 of b rows and G = 1 of 2b rows
# give the same weights for a mean loss, so only Sum shows that G reached the device)
PLANS = [(1, 1, 1, "mean"), (4, 1, 1, "mean"), (1, 2, 1, "mean"), (2, 2, 2, "mean"), (2, 2, 2, "sum")]


@pytest.mark.parametrize("d, r, g, reduction", PLANS)
def test_bundled_task_trains_to_the_same_weights_on_cpu_and_emulated_ipu(monkeypatch, d, r, g, reduction):
    """memnn on babi:1 through accelbatch.run, SGD, the same plan: weights within 1e-5."""
    monkeypatch.setenv(EMULATOR_ENV, "1")  # the emulator, whatever the options
    weights, reports = {}, {}
    for device in ("cpu", "ipu"):
        opts = Opts(task="babi:1", model="memnn", optimizer="sgd", batchsize=2, reduction=reduction,
                    learning_rate=0.5 if reduction == "mean" else 0.5 / (r * g),
                    embedding_size=8, device_iterations=d, replication_factor=r, gradient_accumulation=g,
                    output_mode="all", max_train_steps=3, num_epochs=1, validation_every_n_epochs=-1,
                    eval_splits="", progress=False, device=device, ipu_emulator=device == "ipu", seed=3)
        world = ab.create_world(opts)
        reports[device] = ab.run(world, opts)
        weights[device] = {k: v.detach().clone() for k, v in world.get_model_agent().model.state_dict().items()}
    initial = ab.create_world(opts).get_model_agent().model.state_dict()
    assert reports["ipu"]["device"] == "ipu"
    assert reports["cpu"]["train"]["steps"] == reports["ipu"]["train"]["steps"] == 3
    moved = 0.0
    for k, w in weights["cpu"].items():
        assert torch.allclose(w, weights["ipu"][k], atol=1e-5, rtol=0), k
        moved = max(moved, float((w - initial[k]).abs().max()))
    assert moved > 1e-3  # the runs did train
    # output mode All: the loss is every micro-batch's mean, as on the CPU
    assert reports["cpu"]["train"]["loss"] == pytest.approx(reports["ipu"]["train"]["loss"], abs=1e-5)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_engine_steps_match_the_cpu_engine_with_dynamic_micro_batches(reduction):
    """Calls of 2 and 3 rows per micro-batch (dynamic batching changes b), Mean and Sum reductions."""
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2, gradient_accumulation=2,
                         reduction=reduction, output_mode="all")
    cpu_model, ipu_model = fresh(), fresh()
    cpu = PlanEngine(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.2), plan)
    ipu = ipu_engine(ipu_model, plan, lr=0.2)
    for step, rows in enumerate([16, 24, 16, 24]):
        batch = data(rows, seed=step)
        a, b = cpu.train_step(batch), ipu.train_step(batch)
        assert b.updates == a.updates == 2
        assert torch.equal(a.rows, b.rows)
        assert b.loss == pytest.approx(a.loss, abs=1e-6)
        assert torch.allclose(a.outputs["scores"], b.outputs["scores"], atol=1e-6)
        assert b.outputs["pred"].dtype == torch.int64  # an IPU returns int32; the engine casts back
        assert torch.equal(a.outputs["pred"], b.outputs["pred"])
    for p, q in zip(cpu_model.parameters(), ipu_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)
    assert ipu.compilations == 2


def test_changed_learning_rate_reaches_the_device():
    plan = ExecutionPlan(micro_batch=4)
    cpu_model, ipu_model = fresh(), fresh()
    cpu_opt = torch.optim.SGD(cpu_model.parameters(), lr=0.5)
    cpu = PlanEngine(cpu_model, cpu_opt, plan)
    ipu = ipu_engine(ipu_model, plan, lr=0.5)
    for step in range(4):
        if step == 2:
            for opt in (cpu_opt, ipu.optimizer):
                for group in opt.param_groups:
                    group["lr"] = 0.05
        batch = data(4, seed=step)
        cpu.train_step(batch)
        ipu.train_step(batch)
    for p, q in zip(cpu_model.parameters(), ipu_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6)


def test_partial_training_tail_is_refused_naming_drop_last():
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, drop_last=False)
    engine = ipu_engine(fresh(), plan)
    with pytest.raises(PlanError, match="--drop-last"):
        engine.train_step(data(3))
    with pytest.raises(PlanError, match="Invalid batch dimension"):
        ipu_engine(fresh(), ExecutionPlan(micro_batch=2, device_iterations=2)).train_step(data(5))


# --- evaluation: padding to the compiled rows -----------------------------------------------------------


class MeanOverAllRows(Classifier):
    """The README's way: the loss is the mean over every row it is given, padding rows included."""

    def forward(self, batch):
        out = super().forward(batch)
        if "t" in batch:
            out["loss"] = F.cross_entropy(out["scores"], batch["t"])
        return out


@pytest.mark.parametrize("model_cls", [Classifier, MeanOverAllRows])
def test_partial_eval_batches_are_padded_cut_back_and_scored_on_their_real_rows(model_cls):
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2, gradient_accumulation=2)
    torch.manual_seed(0)
    model = model_cls()
    engine = ipu_engine(model, plan)
    combined = plan.for_inference().combined_batch
    assert combined == 16
    for n in (16, 1, 5, 11, 15, 32):  # more rows than the combined batch too (dynamic batching's)
        batch = data(n, seed=n)
        res = engine.eval_step(batch)
        with torch.no_grad():
            scores = model.lin(batch["x"])
            loss = F.cross_entropy(scores, batch["t"])
        assert torch.equal(res.rows, torch.arange(n))
        assert res.outputs["scores"].shape == (n, 3)
        assert torch.allclose(res.outputs["scores"], scores, atol=1e-6)
        assert torch.equal(res.outputs["pred"], scores.argmax(dim=1))
        assert res.loss == pytest.approx(float(loss), abs=1e-5)
    # whole micro-batches ran in calls of the full call's graph, every remainder in the one of micro batch 1
    assert engine.compilations == 2
    with pytest.raises(PlanError, match="Invalid batch dimension"):  # no tail of this plan (--drop-last)
        engine.eval_step(data(18))


class NaNOnPadding(Classifier):
    """Its loss is NaN on a micro-batch of padding rows only (0 / 0), as many masked losses are."""

    def forward(self, batch):
        out = super().forward(batch)
        if "t" in batch:
            real = (batch["x"].abs().sum(dim=1) > 0).float()
            per_row = F.cross_entropy(out["scores"], batch["t"], reduction="none")
            out["loss"] = (per_row * real).sum() / real.sum()
        return out


def test_micro_batches_of_padding_only_do_not_enter_the_eval_loss():
    torch.manual_seed(0)
    model = NaNOnPadding()
    engine = ipu_engine(model, ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2))
    batch = data(3)
    res = engine.eval_step(batch)
    with torch.no_grad():
        expected = F.cross_entropy(model.lin(batch["x"]), batch["t"])
    assert res.loss == pytest.approx(float(expected), abs=1e-5)


def test_eval_without_labels_returns_outputs_and_no_loss():
    engine = ipu_engine(fresh(), ExecutionPlan(micro_batch=4))
    res = engine.eval_step({"x": torch.randn(3, 4)})
    assert res.loss is None and res.outputs["scores"].shape == (3, 3)


# --- output modes ---------------------------------------------------------------------------------------


def reference_selection(d, g, r, mode, period):
    """(micro-batches j returned, in order); j = (d*G + g)*R + r; None groups for Sum. EveryN returns every
    micro-batch of device iterations N-1, 2N-1, ... (PopART: numOutFetchesPerRepl = D / N x G)."""
    its = d * g
    if mode == "all":
        return [j for j in range(its * r)]
    if mode == "final":
        return [(its - 1) * r + rep for rep in range(r)]
    if mode == "everyn":
        return [(it * g + k) * r + rep for it in range(period - 1, d, period) for k in range(g) for rep in range(r)]
    return [[it * r + rep for it in range(its)] for rep in range(r)]


MODE_CASES = [(2, 1, 2, "all", 1), (2, 2, 2, "final", 1), (4, 1, 2, "everyn", 2), (2, 2, 1, "everyn", 2),
              (3, 2, 2, "everyn", 3), (2, 2, 2, "sum", 1)]


@pytest.mark.parametrize("d, g, r, mode, period", MODE_CASES)
def test_output_modes_return_the_right_rows(d, g, r, mode, period):
    b = 2
    plan = ExecutionPlan(micro_batch=b, device_iterations=d, gradient_accumulation=g, replication_factor=r,
                         output_mode=mode, output_return_period=period)
    model = fresh()
    engine = ipu_engine(model, plan, lr=0.0)  # weights fixed: outputs are a function of the inputs only
    batch = data(plan.combined_batch, seed=5)
    res = engine.train_step(batch)
    with torch.no_grad():
        scores = model.lin(batch["x"])
    selection = reference_selection(d, g, r, mode, period)
    if mode == "sum":
        assert res.rows is None
        expected = torch.cat([sum(scores[j * b:(j + 1) * b] for j in group) for group in selection])
        assert torch.allclose(res.outputs["scores"], expected, atol=1e-5)
        return
    rows = torch.cat([torch.arange(j * b, (j + 1) * b) for j in selection])
    assert torch.equal(res.rows, rows)
    assert torch.allclose(res.outputs["scores"], scores[rows], atol=1e-6)
    assert torch.equal(res.outputs["pred"], scores[rows].argmax(dim=1))
    assert res.extras["loss_micro_batches"] == len(selection)


def test_sum_mode_loss_is_the_mean_over_every_micro_batch():
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, replication_factor=2, output_mode="sum")
    cpu_model, ipu_model = fresh(), fresh()
    cpu = PlanEngine(cpu_model, torch.optim.SGD(cpu_model.parameters(), lr=0.1), plan)
    ipu = ipu_engine(ipu_model, plan)
    batch = data(8)
    assert ipu.train_step(batch).loss == pytest.approx(cpu.train_step(batch).loss, abs=1e-6)


# --- compilations and executor switching ----------------------------------------------------------------


def test_each_input_signature_compiles_once_and_is_counted():
    backend = emulated_backend()
    plan = ExecutionPlan(micro_batch=2, device_iterations=2)
    engine = backend.compile(fresh(), torch.optim.SGD(fresh().parameters(), lr=0.1), plan)
    shapes = [4, 8, 4, 4, 8, 12]  # rows: three distinct training signatures
    counts = [engine.train_step(data(n, seed=i)).extras["compilations"] for i, n in enumerate(shapes)]
    assert counts == [1, 2, 2, 2, 2, 3]
    engine.eval_step(data(3))  # 2 rows in the eval graph, the remaining 1 in the graph of micro batch 1
    engine.eval_step(data(1))  # the same two inference graphs
    assert engine.compilations == 5 and backend.compilations == 5
    assert [g["training"] for g in engine.compiled_graphs] == [True, True, True, False, False]
    assert engine.compiled_graphs[1]["inputs"] == {"t": (8,), "x": (8, 4)}


def test_least_recently_used_graphs_are_destroyed_and_recompiled_when_needed():
    model = fresh()
    engine = emulated_backend().compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                        ExecutionPlan(micro_batch=1), max_executors=2)
    for n in (1, 2, 3, 1):
        engine.train_step(data(n))
    assert engine.num_executors == 2 and engine.compilations == 4


class _DeviceSpy:
    """Records attach/detach/weight copies of every emulated executor; checks one is attached at a time."""

    def __init__(self, monkeypatch):
        self.events: list[tuple[str, bool]] = []
        self.attached: set[int] = set()
        cls = poptorch_emulator.PoplarExecutor
        spy = self

        def wrap(name):
            original = getattr(cls, name)

            def method(executor, *args, **kwargs):
                result = original(executor, *args, **kwargs)
                spy.events.append((name, executor.training))
                spy._track(executor)
                return result
            monkeypatch.setattr(cls, name, method)

        for name in ("attachToDevice", "detachFromDevice", "copyWeightsToHost", "copyWeightsToDevice", "__call__"):
            wrap(name)

    def _track(self, executor):
        if executor.isAttachedToDevice():
            self.attached.add(id(executor))
        else:
            self.attached.discard(id(executor))
        assert len(self.attached) <= 1, "two graphs attached to the device at once"


def test_switching_graphs_copies_weights_and_keeps_one_attached(monkeypatch):
    spy = _DeviceSpy(monkeypatch)
    engine = ipu_engine(fresh(), ExecutionPlan(micro_batch=4))
    engine.train_step(data(4))
    engine.eval_step(data(2))
    engine.train_step(data(4))
    assert spy.events == [
        ("__call__", True),                               # compiles, attaches, uploads the host weights
        ("copyWeightsToHost", True), ("detachFromDevice", True),
        ("__call__", False),
        ("detachFromDevice", False),
        ("attachToDevice", True), ("__call__", True),        # attaching uploads the weights: no second copy
    ]
    spy.events.clear()
    engine.state_dict()
    assert spy.events == [("copyWeightsToHost", True)]


def test_state_dict_round_trip_reaches_the_device():
    plan = ExecutionPlan(micro_batch=4)
    a, b = fresh(0), fresh(1)
    ea, eb = ipu_engine(a, plan), ipu_engine(b, plan)
    ea.train_step(data(4))
    eb.train_step(data(4))
    eb.load_state_dict(ea.state_dict())
    batch = data(4, seed=9)
    assert ea.train_step(batch).loss == pytest.approx(eb.train_step(batch).loss, abs=1e-7)


# --- dynamic batching through the world -----------------------------------------------------------------

BAG = "accelbatch.models.bag:BagAgent"


def _world_graphs(monkeypatch, strategy: str, buckets: int, steps: int):
    monkeypatch.setenv(EMULATOR_ENV, "1")
    opts = Opts(task="babi:1", model=BAG, optimizer="sgd", learning_rate=0.5, batchsize=8, embedding_size=8,
                dynamic_batching=strategy, num_buckets=buckets, device="ipu", ipu_emulator=True,
                progress=False, seed=0)
    world = ab.create_world(opts)
    backend = attach_runtime(world, opts).backend
    try:
        for _ in range(steps):
            world.parley()
        train_graphs = backend.compilations
        valid = ab.create_world(opts.replace(datatype="valid"), agent=world.get_model_agent())
        report = ab.evaluate(valid)
        valid.shutdown()
    finally:
        world.shutdown()
        backend.teardown()
    return train_graphs, backend.compilations, report


@pytest.mark.parametrize("strategy", ["full", "buckets"])
def test_a_dynamic_eval_batch_of_more_rows_than_a_call_is_scored_as_on_the_cpu(monkeypatch, strategy):
    """-di 3: a batch of the token budget holds more rows than the eval graph's D x b, in no multiple of D;
    it ran as one call ("Invalid batch dimension" from inside the engine) and now runs as calls of the graph."""
    monkeypatch.setenv(EMULATOR_ENV, "1")
    reports = {}
    for device in ("cpu", "ipu"):
        opts = Opts(task="babi:1", model=BAG, batchsize=4, embedding_size=8, device_iterations=3, datatype="valid",
                    dynamic_batching=strategy, num_buckets=2, device=device, ipu_emulator=device == "ipu",
                    progress=False, seed=0)
        world = ab.create_world(opts)
        try:
            reports[device] = ab.evaluate(world)
        finally:
            world.shutdown()
    assert reports["ipu"]["exs"] == reports["cpu"]["exs"] == 1000
    assert reports["ipu"]["accuracy"] == reports["cpu"]["accuracy"]
    assert reports["ipu"]["loss"] == pytest.approx(reports["cpu"]["loss"], rel=1e-5)


@pytest.mark.parametrize("buckets", [3, 8])
def test_buckets_keep_the_number_of_graphs_small(monkeypatch, buckets):
    """Rows vary with each bucket's length under the token budget; the graphs stay at most --num-buckets."""
    train_graphs, total, report = _world_graphs(monkeypatch, "buckets", buckets=buckets, steps=40)
    assert report["exs"] == 1000
    assert 1 <= train_graphs <= buckets
    # evaluation: per bucket at most the graph of whole micro-batches and the one of micro batch 1 that runs
    # a remainder (so padding rows never enter the loss)
    assert total - train_graphs <= 2 * buckets
    print(f"buckets={buckets}: {train_graphs} training graphs, {total} in all")


def test_without_buckets_varying_shapes_recompile(monkeypatch):
    train_graphs, total, _ = _world_graphs(monkeypatch, "batchsort", buckets=3, steps=40)
    assert train_graphs > 3  # every new text length is a new graph, and each one is counted
    print(f"batchsort: {train_graphs} training graphs, {total} in all")


# --- loader ---------------------------------------------------------------------------------------------


class Items(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.tensor([i])


def test_make_loader_gives_a_poptorch_dataloader_with_the_plans_combined_batch():
    backend = emulated_backend()
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, gradient_accumulation=2)
    loader = backend.make_loader(Items(20), plan)
    assert isinstance(loader, poptorch_emulator.DataLoader)
    assert loader.combinedBatchSize == plan.combined_batch == 8
    batches = [b.reshape(-1).tolist() for b in loader]
    assert batches == [list(range(8)), list(range(8, 16))]  # drop_last from the plan: 4 items dropped
    tail = backend.make_loader(Items(20), plan, drop_last=False)
    assert [len(b) for b in tail] == [8, 8, 4]
    inference = backend.make_loader(Items(20), plan.for_inference(), drop_last=False)
    assert inference.combinedBatchSize == 8
    ready = [{"x": torch.zeros(8, 1)}]
    assert backend.make_loader(ready, plan) is ready  # ready combined batches pass through, as on cpu
    with pytest.raises(ValueError, match="--dataloader-mode"):
        backend.make_loader(Items(4), plan, mode="turbo")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_make_loader_async_rebatched_mode():
    backend = emulated_backend()
    plan = ExecutionPlan(micro_batch=2, device_iterations=2)
    loader = backend.make_loader(Items(10), plan, mode="async-rebatched", rebatched_worker_size=2)
    try:
        got = [b.reshape(-1).tolist() for b in loader]
    finally:
        loader.terminate()
    assert got == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_a_non_finite_training_loss_stops_the_run_naming_the_ipu():
    """An IPU applies a call's updates before the host reads its loss: the engine stops the run there."""
    from accelbatch.backends.base import NonFiniteLoss

    engine = ipu_engine(fresh(), ExecutionPlan(micro_batch=4))
    batch = data(4)
    batch["x"][0, 0] = float("nan")
    with pytest.raises(NonFiniteLoss, match="on ipu.*--learning-rate"):
        engine.train_step(batch)
    engine.close()


@pytest.mark.parametrize("replicas, ok", [(1, True), (2, True), (3, False), (4, True), (6, False)])
def test_replication_factors_an_ipu_system_cannot_reserve_are_refused_at_setup(replicas, ok):
    backend = IPUBackend()
    if ok:
        backend.setup(Opts(ipu_emulator=True, replication_factor=replicas))
        return
    with pytest.raises(PlanError, match=rf"-rf/--replication-factor {replicas}: an IPU system reserves a power of 2"):
        backend.setup(Opts(ipu_emulator=True, replication_factor=replicas))


@pytest.mark.parametrize("replicas, stages", [(96, 1), (128, 1), (192, 1), (64, 2)])
def test_more_ipus_than_one_process_drives_are_refused_at_setup(replicas, stages):
    """PopTorch compiles at most 64 IPUs in one process: -rf 128 passed the setup and failed at compile with
    a message that did not name -rf, and the refusal of -rf 96 suggested 128."""
    opts = Opts(device="ipu", ipu_emulator=True, replication_factor=replicas,
                pipeline="memory_out" if stages > 1 else None)
    with pytest.raises(PlanError, match=rf"^-rf/--replication-factor {replicas}: .* = {replicas * stages} IPUs, and "
                                        rf"PopTorch drives at most 64 .*; use -rf {64 // stages} or fewer$"):
        IPUBackend().setup(opts)
    IPUBackend().setup(opts.replace(replication_factor=64 // stages))


def test_a_run_reports_its_own_compilations_when_its_agent_ran_before(tmp_path):
    """Worlds built on one agent share its engines: a second run of them compiles no graph (the graphs it
    needs afresh come from --ipu-cache-dir), and its report says 0 (it said the first run's, the cache loads
    summed over both runs likewise)."""
    opts = ab.Opts(task="babi:1", max_train_steps=4, num_epochs=-1, validation_every_n_epochs=-1,
                   eval_splits="valid", device="ipu", ipu_emulator=True, ipu_cache_dir=str(tmp_path / "cache"),
                   progress=False)
    world = ab.create_world(opts)
    first = ab.run(world, opts)["ipu"]
    second = ab.run(ab.create_world(opts, agent=world.get_model_agent()), opts)["ipu"]
    assert first["compilations"] >= 2 and first["cached"] == 0
    assert second["compilations"] == 0 and second["cached"] <= first["compilations"]
