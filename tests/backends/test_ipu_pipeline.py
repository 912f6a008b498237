"""``--pipeline`` / ``--ipu-execution-strategy`` on the emulated IPU: the split model trains to the CPU's weights
(and exactly to the unsplit IPU model's), the blocks land where the names say, and PopTorch's rules are
checked before any step with one-line errors naming the option."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends import poptorch_emulator
from accelbatch.backends.cpu import PlanEngine
from accelbatch.backends.ipu import EMULATOR_ENV, IPUBackend
from accelbatch.backends.poptorch_emulator.blocks import block_annotations

import accelbatch as ab
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import ExecutionPlan, PlanError


class Tower(torch.nn.Module):
    """forward(batch) -> {"scores", "loss"} through blocks b0..b3 (b1 holds an inner layer)."""

    def __init__(self, width: int = 5):
        super().__init__()
        self.b0 = torch.nn.Linear(width, width)
        self.b1 = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.Tanh())
        self.b2 = torch.nn.Linear(width, width)
        self.b3 = torch.nn.Linear(width, width)

    def forward(self, batch):
        x = torch.tanh(self.b0(batch["x"]))
        x = self.b3(torch.tanh(self.b2(self.b1(x))))
        return {"scores": x, "loss": F.cross_entropy(x, batch["t"])}


def tower(seed: int = 0) -> Tower:
    torch.manual_seed(seed)
    return Tower()


def data(n: int, seed: int = 1, width: int = 5):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, width, generator=g), "t": torch.randint(0, width, (n,), generator=g)}


def backend(**opts) -> IPUBackend:
    b = IPUBackend()
    b.setup(Opts(device="ipu", ipu_emulator=True, **opts))
    return b


def train(engine, plan, steps: int = 3) -> list[float]:
    return [engine.train_step(data(plan.combined_batch, seed=s)).loss for s in range(steps)]


# --- the same weights ------------------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline, g, d", [("b2", 3, 2), ("b1,b2,b3", 7, 4), ("b1.0,b2,b3", 7, 4)])
def test_a_pipelined_model_trains_to_the_cpu_weights_and_exactly_to_the_unsplit_ipu_model(pipeline, g, d):
    plan = ExecutionPlan(micro_batch=2, device_iterations=d, gradient_accumulation=g, output_mode="all")
    models = {name: tower() for name in ("cpu", "unsplit", "split")}
    engines = {"cpu": PlanEngine(models["cpu"], torch.optim.SGD(models["cpu"].parameters(), lr=0.3), plan)}
    for name, flags in (("unsplit", {}), ("split", {"pipeline": pipeline})):
        m = models[name]
        engines[name] = backend(**flags).compile(m, torch.optim.SGD(m.parameters(), lr=0.3), plan)
    losses = {name: train(engine, plan) for name, engine in engines.items()}
    assert losses["split"] == losses["unsplit"]
    assert losses["split"] == pytest.approx(losses["cpu"], abs=1e-6)
    for (name, p), q, r in zip(models["split"].named_parameters(), models["unsplit"].parameters(),
                               models["cpu"].parameters()):
        assert torch.equal(p, q), name
        assert torch.allclose(p, r, atol=1e-6, rtol=0), name
        assert not torch.equal(p, tower().state_dict()[name])  # it trained
    stages = pipeline.count(",") + 2
    names = pipeline.split(",")
    assert block_annotations(models["split"]) == {n: (f"stage{k}", k) for k, n in enumerate(names, start=1)}
    (entry,) = engines["split"]._executors.values()
    assert isinstance(entry.executor.options._execution_strategy, poptorch_emulator.PipelinedExecution)
    assert entry.executor._placement.forward_stages == stages
    assert entry.executor._placement.ipus_per_replica == stages
    res = engines["split"].eval_step(data(7))  # the eval graph pipelines too (D >= stages)
    assert res.outputs["scores"].shape == (7, 5)


@pytest.mark.parametrize("strategy, ipus", [("sharded", 2), ("phased", 1)])
def test_sharded_and_phased_strategies_need_no_accumulation(strategy, ipus):
    plan = ExecutionPlan(micro_batch=2)
    split, plain = tower(), tower()
    engine = backend(pipeline="b2", ipu_execution_strategy=strategy).compile(
        split, torch.optim.SGD(split.parameters(), lr=0.3), plan)
    ref = PlanEngine(plain, torch.optim.SGD(plain.parameters(), lr=0.3), plan)
    assert train(engine, plan) == pytest.approx(train(ref, plan), abs=1e-6)
    (entry,) = engine._executors.values()
    assert entry.executor._placement.ipus_per_replica == ipus
    assert entry.executor._placement.mode == strategy


def test_a_model_that_annotates_itself_runs_as_written():
    class Annotated(Tower):
        def __init__(self):
            super().__init__()
            poptorch_emulator.BeginBlock(self.b2, ipu_id=1)

    torch.manual_seed(0)
    model = Annotated()
    plan = ExecutionPlan(micro_batch=1, gradient_accumulation=3, device_iterations=2)
    engine = backend().compile(model, torch.optim.SGD(model.parameters(), lr=0.3), plan)
    train(engine, plan, steps=1)
    (entry,) = engine._executors.values()
    assert entry.executor._placement.forward_stages == 2
    model = Annotated()
    plan = ExecutionPlan(micro_batch=1, gradient_accumulation=2, device_iterations=2)
    engine = backend().compile(model, torch.optim.SGD(model.parameters(), lr=0.3), plan)
    with pytest.raises(PlanError, match=r"^--device ipu: poptorch could not compile the model: poptorch.Options\(\)."
                                        r"Training.gradientAccumulation must be greater than or equal to the number "
                                        r"of pipeline stages \(3\)"):
        engine.train_step(data(plan.combined_batch))


def test_the_memory_proportion_applies_to_every_ipu_of_a_replica():
    opts = backend(pipeline="b1,b2,b3", ipu_available_memory_proportion=0.3).options(ExecutionPlan())
    assert opts.available_memory_proportion == {0: 0.3, 1: 0.3, 2: 0.3, 3: 0.3}
    assert isinstance(opts._execution_strategy, poptorch_emulator.PipelinedExecution)


# --- refused before any step -----------------------------------------------------------------------------

@pytest.mark.parametrize("opts, plan, fragment", [
    ({"pipeline": "b2"}, ExecutionPlan(gradient_accumulation=2, device_iterations=2),
     r"^--pipeline: 2 pipelined stages train as 3 .* -ga/--gradient-accumulation must be at least 3, got 2"),
    ({"pipeline": "b1,b2,b3"}, ExecutionPlan(gradient_accumulation=6, device_iterations=4),
     "must be at least 7, got 6"),
    ({"pipeline": "b2"}, ExecutionPlan(gradient_accumulation=3),
     r"^--pipeline: an inference pipeline of 2 stages needs -di/--device-iterations >= 2 .*got 1"),
    ({"pipeline": "b2"}, ExecutionPlan(training=False),
     "-di/--device-iterations >= 2"),
    ({"pipeline": "b9"}, ExecutionPlan(gradient_accumulation=3, device_iterations=2),
     r"^--pipeline: the model \(Tower\) has no submodule 'b9'; its top-level submodules are: b0, b1, b2, b3"),
    ({"pipeline": "b1.5"}, ExecutionPlan(gradient_accumulation=3, device_iterations=2), "no submodule 'b1.5'"),
])
def test_plans_and_names_that_cannot_work_are_refused_at_compile(opts, plan, fragment):
    model = tower()
    with pytest.raises(PlanError, match=fragment):
        backend(**opts).compile(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
    assert "\n" not in fragment


@pytest.mark.parametrize("opts, ok", [({"pipeline": "b2", "replication_factor": 2}, True),
                                      ({"pipeline": "b1,b2"}, False),
                                      ({"pipeline": "b2", "replication_factor": 3}, False),
                                      ({"pipeline": "b1,b2", "ipu_execution_strategy": "phased",
                                        "replication_factor": 2}, True)])
def test_ipus_of_the_stages_times_replicas_must_be_reservable(opts, ok):
    if ok:
        backend(**opts)
        return
    with pytest.raises(PlanError, match=r"^--pipeline: \d stages x -rf \d = \d IPUs, but an IPU system reserves"):
        backend(**opts)


@pytest.mark.parametrize("changes, fragment", [
    ({"pipeline": "b2"}, "^--pipeline splits the model over IPUs and applies to --device ipu only"),
    ({"pipeline": "b2", "device": "cuda"}, "--device cuda"),
    ({"device": "ipu", "pipeline": "a,,b"}, r"^--pipeline: '' is not a submodule name"),
    ({"device": "ipu", "pipeline": "a-b"}, "'a-b' is not a submodule name"),
    ({"device": "ipu", "pipeline": "a,b,a"}, "^--pipeline: a named twice"),
    ({"device": "ipu", "ipu_execution_strategy": "sharded"}, "^--ipu-execution-strategy sharded: places the stages"),
])
def test_pipeline_options_are_validated_with_the_others(changes, fragment):
    with pytest.raises(OptionError, match=fragment):
        Opts(**changes)


def test_the_cli_refuses_pipeline_on_cpu_with_one_line(capsys):
    from accelbatch.cli import main

    assert main(["train", "-t", "babi:1", "--pipeline", "encoder"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--pipeline splits the model over IPUs" in err


# --- the whole run ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("pipeline, g, d", [("memory_out", 3, 2), ("time_in,memory_out,query_emb", 7, 4)])
def test_memnn_pipelined_over_2_and_4_ipus_trains_to_the_cpu_weights(monkeypatch, pipeline, g, d):
    """memnn on babi:1 through accelbatch.run with the same plan: within 1e-5 of the CPU (its engine sums in
    another order), torch.equal to the unsplit emulated IPU."""
    monkeypatch.setenv(EMULATOR_ENV, "1")
    weights = {}
    for run, extra in (("cpu", {"device": "cpu"}), ("ipu", {"device": "ipu"}),
                       ("split", {"device": "ipu", "pipeline": pipeline})):
        opts = Opts(task="babi:1", model="memnn", optimizer="sgd", batchsize=2, learning_rate=0.5, embedding_size=8,
                    device_iterations=d, gradient_accumulation=g, output_mode="all", max_train_steps=3,
                    num_epochs=1, validation_every_n_epochs=-1, eval_splits="", progress=False, seed=3, **extra)
        world = ab.create_world(opts)
        report = ab.run(world, opts)
        assert report["train"]["steps"] == 3
        weights[run] = world.get_model_agent().model.state_dict()
    stages = pipeline.count(",") + 2
    assert {k: report["ipu"][k] for k in ("stages", "strategy", "ipus")} == {
        "stages": stages, "strategy": "pipelined", "ipus": stages}
    for k, w in weights["split"].items():
        assert torch.equal(w, weights["ipu"][k]), k
        assert torch.allclose(w, weights["cpu"][k], atol=1e-5, rtol=0), k
