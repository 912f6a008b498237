"""--ipu-input-replica-grouping (PopTorch's Options.inputReplicaGrouping) on the emulated IPU.

References: the same model run with R / N replicas and no grouping (the rows a call feeds are the same), and
PopTorch's semantics (python/options.py, _poplar_executor.py, tests/replicated_graph_test.py): replica r reads
input group r // N (consecutive) or r % (R / N) (orthogonal), every replica returns its outputs, and the
Mean reduction divides by G x R, so N equal gradients per group give the R / N-replica update (Sum: N times it).
"""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch
from accelbatch.backends.ipu import EMULATOR_ENV, IPUBackend
from accelbatch.backends.ipu_graph import group_leaders_only, plan_options

import accelbatch as ab
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import LOSS_TOKENS, ExecutionPlan, PlanError

from .test_ipu import Classifier, data, fresh, ipu_engine


def plans(r: int = 4, n: int = 2, group_type: str = "consecutive", **kw) -> tuple[ExecutionPlan, ExecutionPlan]:
    """(R replicas in input groups of N, R / N replicas without grouping), otherwise the same plan."""
    return (ExecutionPlan(replication_factor=r, input_group_size=n, input_group_type=group_type, **kw),
            ExecutionPlan(replication_factor=r // n, **kw))


# --- the plan -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_type, groups_of", [("consecutive", [0, 0, 1, 1, 2, 2]),
                                                   ("orthogonal", [0, 1, 2, 0, 1, 2])])
def test_plan_feeds_r_over_n_groups(group_type, groups_of):
    plan, ref = plans(r=6, n=2, group_type=group_type, micro_batch=2, device_iterations=2, gradient_accumulation=3)
    assert plan.input_groups == 3 and plan.factor == ref.factor == 18
    assert plan.combined_batch == ref.combined_batch == 2 * 2 * 3 * 3
    assert [plan.input_group_of(r) for r in range(6)] == groups_of
    assert plan.group_leaders == ((0, 2, 4) if group_type == "consecutive" else (0, 1, 2))
    assert plan.layout(36).replica == ref.layout(36).replica
    rows = {"row": torch.arange(36)}
    for r in range(6):  # a replica runs its group's rows, as replica group_of(r) of the ungrouped plan
        assert torch.equal(plan.shard(rows, r)["row"], ref.shard(rows, groups_of[r])["row"])
    inference = plan.for_inference()
    assert (inference.input_group_size, inference.input_group_type) == (2, group_type)
    assert inference.combined_batch == 36
    assert "inputs shared by" in plan.describe()


def test_plan_batch_error_names_the_group_size():
    plan, _ = plans(r=4, n=2, micro_batch=2)
    with pytest.raises(PlanError) as err:
        plan.validate_batch(5)
    text = str(err.value)
    assert "(Options.replicationFactor(4) / Options.inputReplicaGrouping.input_group_size(2))" in text
    assert "= 2 because" in text and "--replication-factor(4) / --ipu-input-replica-grouping(2)" in text


@pytest.mark.parametrize("kw, says", [({"replication_factor": 4, "input_group_size": 3}, "must divide"),
                                      ({"input_group_size": 0}, "--ipu-input-replica-grouping: must be an integer"),
                                      ({"replication_factor": 2, "input_group_size": 2, "input_group_type": "all"},
                                       "is not one of consecutive, orthogonal")])
def test_plan_refuses_groups_that_cannot_work(kw, says):
    with pytest.raises(PlanError, match=says):
        ExecutionPlan(**kw)


def test_from_opts_carries_the_grouping():
    opts = Opts(device="ipu", batchsize=3, replication_factor=4, gradient_accumulation=2,
                ipu_input_replica_grouping=2, ipu_input_replica_grouping_type="orthogonal")
    plan = ExecutionPlan.from_opts(opts, training=True)
    assert (plan.input_group_size, plan.input_group_type, plan.combined_batch) == (2, "orthogonal", 3 * 2 * 2)
    assert ExecutionPlan.from_opts(opts, training=False).combined_batch == 3 * 2 * 2
    parsed = Opts.from_args(["--device", "ipu", "-bs", "3", "-rf", "4", "-ga", "2", "--ipu-input-replica-grouping",
                             "2", "--ipu-input-replica-grouping-type", "orthogonal"])
    assert ExecutionPlan.from_opts(parsed, training=True) == plan


# --- options --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, says", [
    ({"ipu_input_replica_grouping": 2, "replication_factor": 2},
     "^--ipu-input-replica-grouping 2: applies to --device ipu only"),
    ({"ipu_input_replica_grouping": 2, "replication_factor": 2, "device": "cuda"}, "--device cuda"),
    ({"ipu_input_replica_grouping": 3, "replication_factor": 4, "device": "ipu"},
     "^--ipu-input-replica-grouping 3: groups of replicas must divide -rf/--replication-factor 4; use one of 1, 2, 4$"),
    ({"ipu_input_replica_grouping": 0, "device": "ipu"}, "^--ipu-input-replica-grouping: must be at least 1"),
    ({"ipu_input_replica_grouping_type": "orthogonal", "device": "ipu"},
     "^--ipu-input-replica-grouping-type orthogonal: arranges the groups"),
    ({"ipu_input_replica_grouping_type": "all"}, "is not one of consecutive, orthogonal"),
])
def test_option_errors(kw, says):
    with pytest.raises(OptionError, match=says) as err:
        Opts(**kw)
    assert "\n" not in str(err.value)


def test_the_cli_refuses_grouping_on_cpu_with_one_line(capsys):
    from accelbatch.cli import main

    assert main(["train", "-t", "babi:1", "-rf", "2", "--ipu-input-replica-grouping", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "applies to --device ipu only" in err


@pytest.mark.parametrize("group_type, cgt", [("consecutive", poptorch.CommGroupType.Consecutive),
                                             ("orthogonal", poptorch.CommGroupType.Orthogonal)])
def test_plan_maps_to_replication_and_input_grouping(group_type, cgt):
    plan, _ = plans(r=4, n=2, group_type=group_type)
    for p in (plan, plan.for_inference()):
        opts = plan_options(poptorch, p)
        assert (opts.replication_factor, opts.input_group_size, opts.input_cgt) == (4, 2, cgt)
    assert plan_options(poptorch, ExecutionPlan(replication_factor=4)).input_group_size == 1


def test_loader_yields_the_combined_batch_of_the_groups():
    """poptorch.DataLoader with the plan's options: b x D x (R / N) x G items a call."""
    backend = IPUBackend()
    backend.setup(Opts(ipu_emulator=True, replication_factor=4))
    plan, _ = plans(r=4, n=2, group_type="orthogonal", micro_batch=2, device_iterations=3)
    loader = backend.make_loader(torch.utils.data.TensorDataset(torch.arange(30)), plan)
    assert loader.combinedBatchSize == plan.combined_batch == 12
    assert [b[0].tolist() for b in loader] == [list(range(12)), list(range(12, 24))]


# --- outputs: each group's first replica ----------------------------------------------------------------


@pytest.mark.parametrize("group_type, mode", [("consecutive", "all"), ("orthogonal", "all"),
                                              ("consecutive", "final"), ("orthogonal", "sum")])
def test_group_leaders_are_kept_from_every_replica_output(group_type, mode):
    """A device output holding its replica's index: only each group's first replica's values remain."""
    plan, _ = plans(r=4, n=2, group_type=group_type, device_iterations=3, output_mode=mode)
    outer = 3 if mode == "all" else 1
    k = 5  # rows per micro-batch
    device = torch.arange(4).repeat_interleave(k).repeat(outer).float()  # [outer, R, k] flattened
    kept = group_leaders_only(plan, device, scalar=False)
    assert torch.equal(kept, torch.tensor(plan.group_leaders).repeat_interleave(k).repeat(outer).float())
    single, _ = plans(r=2, n=2, output_mode="final")
    assert group_leaders_only(single, torch.tensor([7.0, 7.0]), scalar=True).shape == ()  # multiplier 1
    assert group_leaders_only(single, torch.tensor([[7.0], [7.0]]), scalar=False).shape == (1, 1)


# --- training: the numbers of R / N replicas ------------------------------------------------------------

CASES = [("consecutive", "mean", "all", 2, 2), ("orthogonal", "mean", "all", 2, 2),
         ("consecutive", "sum", "all", 2, 2), ("orthogonal", "sum", "all", 2, 2),
         ("consecutive", "mean", "final", 2, 2), ("orthogonal", "sum", "sum", 2, 2),
         ("orthogonal", "mean", "everyn", 2, 2), ("consecutive", "mean", "everyn", 4, 1)]


@pytest.mark.parametrize("group_type, reduction, mode, d, g", CASES)
def test_grouped_training_equals_r_over_n_replicas(group_type, reduction, mode, d, g):
    """Mean: the weights of R / N replicas; Sum: N times their gradient (the reference's lr x N, SGD); the
    outputs, their rows and the loss are the reference's."""
    n = 2
    period = 2 if mode == "everyn" else 1
    plan, ref = plans(r=4, n=n, group_type=group_type, micro_batch=2, device_iterations=d, gradient_accumulation=g,
                      reduction=reduction, output_mode=mode, output_return_period=period)
    grouped_model, ref_model = fresh(), fresh()
    grouped = ipu_engine(grouped_model, plan, lr=0.1)
    reference = ipu_engine(ref_model, ref, lr=0.1 * (n if reduction == "sum" else 1))
    for step in range(3):
        batch = data(plan.combined_batch, seed=step)
        a, b = grouped.train_step(batch), reference.train_step(batch)
        assert a.updates == b.updates == d
        assert torch.equal(a.rows, b.rows) if b.rows is not None else a.rows is None
        assert a.loss == pytest.approx(b.loss, abs=1e-6)
        assert a.outputs["scores"].shape == b.outputs["scores"].shape
        assert torch.allclose(a.outputs["scores"], b.outputs["scores"], atol=1e-6)
    moved = 0.0
    for p, q, p0 in zip(grouped_model.parameters(), ref_model.parameters(), fresh().parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)
        moved = max(moved, float((p - p0).detach().abs().max()))
    assert moved > 1e-3
    assert grouped._active.executor.options.input_group_size == n


def test_sum_reduction_steps_n_times_the_ungrouped_gradient():
    """One update (D = G = 1), the same lr: the grouped step moves the weights N = 2 times as far."""
    plan, ref = plans(r=4, n=2, group_type="orthogonal", micro_batch=3, reduction="sum")
    grouped_model, ref_model, start = fresh(), fresh(), fresh()
    batch = data(plan.combined_batch)
    ipu_engine(grouped_model, plan, lr=0.05).train_step(batch)
    ipu_engine(ref_model, ref, lr=0.05).train_step(batch)
    for p, q, p0 in zip(grouped_model.parameters(), ref_model.parameters(), start.parameters()):
        assert torch.allclose(p - p0, 2 * (q - p0), atol=1e-6, rtol=0)


def test_token_normalization_scales_by_the_groups_fed():
    plan, ref = plans(r=4, n=2, micro_batch=2, gradient_accumulation=2, output_mode="all",
                      loss_normalization="token")
    grouped_model, ref_model = fresh(), fresh()
    grouped, reference = ipu_engine(grouped_model, plan), ipu_engine(ref_model, ref)
    for step in range(2):
        batch = data(plan.combined_batch, seed=step)
        batch[LOSS_TOKENS] = torch.arange(1, plan.combined_batch + 1) % 5 + 1
        grouped.train_step(dict(batch))
        reference.train_step(dict(batch))
    for p, q in zip(grouped_model.parameters(), ref_model.parameters()):
        assert torch.allclose(p, q, atol=1e-6, rtol=0)


# --- evaluation: every row scored once ------------------------------------------------------------------


class Echo(Classifier):
    """Classifier that also returns each row's id (x[:, 0]) and a 0-dim output."""

    def forward(self, batch):
        out = super().forward(batch)
        out["id"] = batch["x"][:, 0]
        out["total"] = batch["x"].sum()
        return out


@pytest.mark.parametrize("group_type", ["consecutive", "orthogonal"])
@pytest.mark.parametrize("rows", [16, 12, 7])
def test_eval_scores_every_row_once(group_type, rows):
    """Full, short and remainder calls: one output per row in row order, the reference's loss and scores."""
    plan, ref = plans(r=4, n=2, group_type=group_type, micro_batch=2, device_iterations=2, gradient_accumulation=2)
    torch.manual_seed(0)
    model = Echo()
    batch = data(rows, seed=4)
    batch["x"][:, 0] = torch.arange(rows, dtype=torch.float32) + 1
    a = ipu_engine(model, plan).eval_step(batch)
    b = ipu_engine(model, ref).eval_step(batch)
    assert torch.equal(a.outputs["id"], batch["x"][:, 0])
    assert torch.equal(a.rows, torch.arange(rows))
    assert torch.allclose(a.outputs["scores"], b.outputs["scores"], atol=1e-6)
    assert a.loss == pytest.approx(b.loss, abs=1e-6)


# --- the whole run --------------------------------------------------------------------------------------


@pytest.mark.parametrize("group_type, reduction", [("consecutive", "mean"), ("orthogonal", "sum")])
@pytest.mark.slow
def test_memnn_with_grouped_replicas_trains_like_half_the_replicas(monkeypatch, group_type, reduction):
    """memnn on babi:1 through accelbatch.run: -rf 4 in groups of 2 feeds the rows of -rf 2 and ends with its
    weights (Sum: with half its learning rate), and evaluates every example once."""
    monkeypatch.setenv(EMULATOR_ENV, "1")
    weights, reports = {}, {}
    lr = 0.5 if reduction == "mean" else 0.5 / 8  # Sum adds an update's G x R = 8 gradients
    for run, extra in (("grouped", {"replication_factor": 4, "ipu_input_replica_grouping": 2,
                                    "ipu_input_replica_grouping_type": group_type}),
                       ("ref", {"replication_factor": 2, "learning_rate": lr * (2 if reduction == "sum" else 1)})):
        opts = Opts(task="babi:1", model="memnn", optimizer="sgd", batchsize=2, learning_rate=lr, embedding_size=8,
                    device_iterations=2, gradient_accumulation=2, reduction=reduction, output_mode="all",
                    max_train_steps=3, num_epochs=1, validation_every_n_epochs=-1, eval_splits="valid",
                    progress=False, device="ipu", ipu_emulator=True, seed=3)
        opts = opts.replace(**extra)
        world = ab.create_world(opts)
        reports[run] = ab.run(world, opts)
        weights[run] = world.get_model_agent().model.state_dict()
    assert reports["grouped"]["train"]["steps"] == reports["ref"]["train"]["steps"] == 3
    assert reports["grouped"]["train"]["exs"] == reports["ref"]["train"]["exs"] == 3 * 2 * 2 * 2 * 2
    initial = ab.create_world(opts).get_model_agent().model.state_dict()
    moved = 0.0
    for k, w in weights["grouped"].items():
        assert torch.allclose(w, weights["ref"][k], atol=1e-5, rtol=0), k
        moved = max(moved, float((w - initial[k]).abs().max()))
    assert moved > 1e-3  # the runs did train
    valid = {k: v for k, v in reports["grouped"]["valid"].items() if k != "time_s"}
    assert valid["exs"] == 1000  # babi:1 valid, each example once
    assert valid == pytest.approx({k: reports["ref"]["valid"][k] for k in valid}, abs=1e-5)


def test_the_engine_loop_refuses_a_grouped_plan():
    """Given through the API (the CLI refuses it earlier), a grouped plan is an IPU placement that the one engine
    loop of cpu and cuda does not run: it would train R / N replicas, right for mean and not for sum."""
    from accelbatch.backends.cpu import PlanEngine

    plan = ExecutionPlan(micro_batch=2, replication_factor=4, input_group_size=2)
    model = torch.nn.Linear(3, 2)
    with pytest.raises(PlanError, match="input replica grouping .* is an IPU placement"):
        PlanEngine(model, torch.optim.SGD(model.parameters(), lr=0.1), plan)
