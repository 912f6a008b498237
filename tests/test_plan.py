"""ExecutionPlan: sizes, host layout, output selection, validation texts and the partial-tail policy.

Expected values are computed here from the semantics table (DESIGN.md), never by the plan itself.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan, OutputMode, PlanError, Reduction, batch_rows

SMALL = st.integers(min_value=1, max_value=4)


def combined_index(d: int, g: int, r: int, i: int, G: int, R: int, b: int) -> int:
    """Row of the combined batch holding row i of replica r's micro-batch at step (d, g): the table's order."""
    return ((d * G + g) * R + r) * b + i


# --- construction ----------------------------------------------------------------------------
def test_defaults_resolve_per_mode():
    assert ExecutionPlan(training=True).output_mode is OutputMode.FINAL
    assert ExecutionPlan(training=False).output_mode is OutputMode.ALL
    assert ExecutionPlan(output_mode="sum").output_mode is OutputMode.SUM
    assert ExecutionPlan(output_mode="EveryN", output_return_period=1).output_mode is OutputMode.EVERY_N
    assert ExecutionPlan(reduction="sum").reduction is Reduction.SUM


def test_combined_batch_and_from_opts():
    opts = Opts(batchsize=8, device_iterations=3, replication_factor=2, gradient_accumulation=4,
                output_mode="everyn", output_return_period=3, reduction="sum", drop_last=False)
    plan = ExecutionPlan.from_opts(opts, training=True)
    assert (plan.micro_batch, plan.device_iterations, plan.replication_factor,
            plan.gradient_accumulation) == (8, 3, 2, 4)
    assert plan.combined_batch == 8 * 3 * 2 * 4
    assert plan.output_mode is OutputMode.EVERY_N and plan.output_return_period == 3
    assert plan.reduction is Reduction.SUM and plan.drop_last is False
    inf = ExecutionPlan.from_opts(opts, training=False)
    assert (inf.micro_batch, inf.device_iterations, inf.replication_factor, inf.gradient_accumulation) == (
        32, 3, 2, 1)
    assert inf.output_mode is OutputMode.ALL and not inf.training
    assert inf.combined_batch == plan.combined_batch


def test_for_inference_keeps_world_rows():
    plan = ExecutionPlan(micro_batch=4, device_iterations=2, replication_factor=3, gradient_accumulation=5,
                         output_mode="sum")
    inf = plan.for_inference()
    assert inf.combined_batch == plan.combined_batch == 4 * 2 * 3 * 5
    assert (inf.micro_batch, inf.device_iterations, inf.replication_factor, inf.gradient_accumulation) == (
        20, 2, 3, 1)
    assert inf.output_mode is OutputMode.ALL and inf.training is False


def test_plan_is_frozen_and_hashable():
    plan = ExecutionPlan(micro_batch=2)
    with pytest.raises(Exception):
        plan.micro_batch = 3  # type: ignore[misc]
    assert hash(plan) == hash(ExecutionPlan(micro_batch=2))


# --- validation texts ------------------------------------------------------------------------
def test_invalid_batch_dimension_mirrors_poptorch():
    plan = ExecutionPlan(micro_batch=4, device_iterations=3, gradient_accumulation=2, replication_factor=1)
    with pytest.raises(PlanError) as err:
        plan.validate_batch(torch.zeros(10, 3), "text_vec")
    text = str(err.value)
    assert text.startswith(
        "Invalid batch dimension: In the input torch.Size([10, 3]), the batch dimension (10) must be a "
        "multiple of Options.deviceIterations(3) * (Options.replicationFactor(1) / "
        "Options.inputReplicaGrouping.input_group_size(1)) * Options.Training.gradientAccumulation(2) = 6")
    assert "--batchsize(4)" in text and "= 24" in text and "'text_vec'" in text
    assert "--gradient-accumulation" in text and "--device-iterations" in text
    assert plan.validate_batch(12) == 12
    assert isinstance(err.value, ValueError)


def test_invalid_batch_dimension_with_replicas_and_int_rows():
    plan = ExecutionPlan(micro_batch=2, replication_factor=4)
    with pytest.raises(PlanError, match=r"the batch dimension \(6\) must be a multiple of "
                                        r"Options.deviceIterations\(1\) \* \(Options.replicationFactor\(4\)"):
        plan.validate_batch(6)


@pytest.mark.parametrize("field,flag", [("micro_batch", "--batchsize"),
                                        ("device_iterations", "--device-iterations"),
                                        ("replication_factor", "--replication-factor"),
                                        ("gradient_accumulation", "--gradient-accumulation")])
def test_factors_must_be_positive(field, flag):
    with pytest.raises(PlanError, match=f"{flag}: must be an integer of at least 1, got 0"):
        ExecutionPlan(**{field: 0})


def test_everyn_period_must_divide_iterations():
    with pytest.raises(PlanError) as err:
        ExecutionPlan(device_iterations=10, output_mode="everyn", output_return_period=3)
    assert "--output-return-period 3" in str(err.value) and "--device-iterations 10" in str(err.value)
    assert "1, 2, 5, 10" in str(err.value)
    # the period counts device iterations, as PopTorch's: D=5 with G=2 takes N=5 and refuses N=2 and N=10
    ExecutionPlan(device_iterations=5, gradient_accumulation=2, output_mode="everyn", output_return_period=5)
    for period in (2, 10):
        with pytest.raises(PlanError, match=f"--output-return-period {period}: .*--device-iterations 5"):
            ExecutionPlan(device_iterations=5, gradient_accumulation=2, output_mode="everyn",
                          output_return_period=period)


def test_return_period_only_with_everyn():
    with pytest.raises(PlanError, match="applies only to --output-mode everyn"):
        ExecutionPlan(device_iterations=4, output_mode="final", output_return_period=2)


def test_gradient_accumulation_refused_in_inference():
    with pytest.raises(PlanError) as err:
        ExecutionPlan(gradient_accumulation=2, training=False)
    assert "--gradient-accumulation 2" in str(err.value) and "inference" in str(err.value)
    assert "inferenceModel" in str(err.value)


def test_unknown_mode_and_reduction():
    with pytest.raises(PlanError, match="--output-mode"):
        ExecutionPlan(output_mode="median")
    with pytest.raises(PlanError, match="--reduction"):
        ExecutionPlan(reduction="max")


def test_batch_rows_disagreement():
    with pytest.raises(PlanError, match="'y' has 3 rows"):
        batch_rows({"x": torch.zeros(4, 2), "y": torch.zeros(3)})


# --- host layout -----------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(b=SMALL, d=SMALL, r=SMALL, g=SMALL, width=st.integers(0, 3))
def test_split_merge_round_trip(b, d, r, g, width):
    plan = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g)
    n = plan.combined_batch
    x = torch.arange(n * max(width, 1)).reshape(n, *([width] if width else []))
    host = plan.split({"x": x})["x"]
    assert tuple(host.shape[:4]) == (d, g, r, b)
    for di in range(d):
        for gi in range(g):
            for ri in range(r):
                for i in range(b):
                    assert torch.equal(host[di, gi, ri, i], x[combined_index(di, gi, ri, i, g, r, b)])
    assert torch.equal(plan.merge({"x": host})["x"], x)


@settings(max_examples=60, deadline=None)
@given(b=SMALL, d=SMALL, r=SMALL, g=SMALL)
def test_shards_partition_a_full_call(b, d, r, g):
    plan = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g)
    x = torch.arange(plan.combined_batch)
    seen = []
    for rep in range(r):
        shard = plan.shard({"x": x}, rep)["x"]
        expect = [combined_index(di, gi, rep, i, g, r, b)
                  for di in range(d) for gi in range(g) for i in range(b)]
        assert shard.tolist() == expect
        seen += shard.tolist()
    assert sorted(seen) == list(range(plan.combined_batch))


def test_merge_rejects_wrong_layout():
    plan = ExecutionPlan(micro_batch=2, device_iterations=2)
    with pytest.raises(PlanError, match="host layout"):
        plan.merge({"x": torch.zeros(3, 1, 1, 2)})


# --- output selection: PopTorch's vectors ------------------------------------------------------
@pytest.fixture()
def poptorch_vectors():
    torch.manual_seed(0)
    lin = torch.nn.Linear(6, 20)
    x = torch.randn(10, 1, 5, 6)
    with torch.no_grad():
        y = torch.stack([lin(x[k]) for k in range(10)])  # per micro-batch, [10, 1, 5, 20]
    return x, y


def _plan10(mode: str, n: int = 1) -> ExecutionPlan:
    return ExecutionPlan(micro_batch=1, device_iterations=10, output_mode=mode, output_return_period=n)


def test_poptorch_vectors_select_tensor(poptorch_vectors):
    _, y = poptorch_vectors
    out = _plan10("all").select_tensor(y)
    assert out.shape == (10, 1, 5, 20) and torch.equal(out, y)
    out = _plan10("everyn", 5).select_tensor(y)
    assert out.shape == (2, 1, 5, 20) and torch.equal(out, y[[4, 9]])
    out = _plan10("final").select_tensor(y)
    assert out.shape == (1, 1, 5, 20) and torch.equal(out, y[9:10])
    out = _plan10("sum").select_tensor(y)
    assert out.shape == (1, 1, 5, 20) and torch.allclose(out, y.sum(0, keepdim=True))


def test_poptorch_vectors_select_outputs(poptorch_vectors):
    _, y = poptorch_vectors
    per_micro = [{"y": y[k:k + 1], "loss": y[k].mean()} for k in range(10)]  # micro batch 1: x[k:k+1]
    expect = {"all": (y, list(range(10))), "everyn": (y[[4, 9]], [4, 9]), "final": (y[9:10], [9]),
              "sum": (y.sum(0, keepdim=True), None)}
    for mode, (want, rows) in expect.items():
        out, got_rows = _plan10(mode, 5 if mode == "everyn" else 1).select_outputs(per_micro)
        assert set(out) == {"y"}
        assert out["y"].shape == want.shape and torch.allclose(out["y"], want), mode
        assert (got_rows is None) if rows is None else got_rows.tolist() == rows


def test_selection_rows_with_replicas_and_accumulation():
    b, d, r, g = 2, 2, 2, 3
    x = torch.arange(b * d * r * g)
    per_micro = [{"y": x[j * b:(j + 1) * b].float()} for j in range(d * g * r)]
    final = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g)
    out, rows = final.select_outputs(per_micro)
    expect = [combined_index(d - 1, g - 1, rep, i, g, r, b) for rep in range(r) for i in range(b)]
    assert rows.tolist() == expect and out["y"].tolist() == [float(v) for v in expect]
    every = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g,
                          output_mode="everyn", output_return_period=2)
    out, rows = every.select_outputs(per_micro)
    # device iteration 1 (the last of the period of 2), with all G of its micro-batches
    expect = [combined_index(1, k, rep, i, g, r, b) for k in range(g) for rep in range(r) for i in range(b)]
    assert rows.tolist() == expect and out["y"].shape[0] == r * b * d * g // 2
    summed = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g,
                           output_mode="sum")
    out, rows = summed.select_outputs(per_micro)
    want = [sum(float(combined_index(k // g, k % g, rep, i, g, r, b)) for k in range(d * g))
            for rep in range(r) for i in range(b)]
    assert rows is None and out["y"].tolist() == want


def test_multiplier_one_keeps_shapes():
    plan = ExecutionPlan(micro_batch=4)
    scores = torch.randn(4, 3)
    out, rows = plan.select_outputs([{"loss": torch.tensor(1.0), "scores": scores, "n": torch.tensor(4)}])
    assert out["scores"].shape == (4, 3) and out["n"].shape == () and rows.tolist() == [0, 1, 2, 3]
    # m > 1 turns a scalar into [m]
    plan = ExecutionPlan(micro_batch=1, device_iterations=3, output_mode="all")
    out, _ = plan.select_outputs([{"n": torch.tensor(float(k))} for k in range(3)], rows=3)
    assert out["n"].shape == (3,)
    # Final with R = 1 has multiplier 1: a scalar stays a scalar; with R = 2 it becomes [2]
    plan = ExecutionPlan(micro_batch=1, device_iterations=4)
    out, _ = plan.select_outputs([{"n": torch.tensor(float(k))} for k in range(4)], rows=4)
    assert out["n"].shape == () and float(out["n"]) == 3.0
    plan = ExecutionPlan(micro_batch=1, device_iterations=2, replication_factor=2)
    out, _ = plan.select_outputs([{"n": torch.tensor(float(k))} for k in range(4)], rows=4)
    assert out["n"].tolist() == [2.0, 3.0]
    assert ExecutionPlan().select_tensor(torch.tensor(2.5)).shape == ()


# --- call layouts and the partial-tail policy ---------------------------------------------------
def test_full_call_layout():
    plan = ExecutionPlan(micro_batch=3, device_iterations=2, replication_factor=2, gradient_accumulation=2)
    lay = plan.layout(24)
    assert not lay.partial and lay.num_updates == 2 and lay.num_micro_batches == 8
    assert lay.updates == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert lay.replica == (0, 1) * 4 and set(lay.weight) == {0.25}
    assert ExecutionPlan(micro_batch=3, device_iterations=2, gradient_accumulation=2,
                         reduction="sum").layout(12).weight == (1.0,) * 4


def test_multiple_of_factor_infers_micro_batch():
    plan = ExecutionPlan(micro_batch=8, device_iterations=2, gradient_accumulation=2)
    lay = plan.layout(12)  # PopTorch: micro batch = 12 / (2*1*2) = 3
    assert lay.micro_batch == 3 and lay.num_updates == 2 and not lay.partial


def test_tail_refused_with_drop_last():
    plan = ExecutionPlan(micro_batch=4, device_iterations=2, gradient_accumulation=3)
    with pytest.raises(PlanError, match="Invalid batch dimension"):
        plan.layout(17)


def test_tail_policy_example():
    """b=4, G=3, D=2, R=1, 17 rows: micro-batches 4,4,4 | 4,1 -> two updates, mean over rows present."""
    plan = ExecutionPlan(micro_batch=4, device_iterations=2, gradient_accumulation=3, drop_last=False)
    lay = plan.layout(17)
    assert lay.partial and lay.updates == ((0, 1, 2), (3, 4))
    assert [lay.micro_rows(j) for j in range(5)] == [4, 4, 4, 4, 1]
    assert lay.weight == pytest.approx([4 / 12] * 3 + [4 / 5, 1 / 5])
    assert lay.mode is OutputMode.ALL and lay.out_rows.tolist() == list(range(17))
    summed = ExecutionPlan(micro_batch=4, device_iterations=2, gradient_accumulation=3, drop_last=False,
                           reduction="sum").layout(17)
    assert summed.weight == pytest.approx([1, 1, 1, 1, 0.25])
    # a multiple of D x R x G (6) is no tail, drop_last or not: D updates of micro batch 18 / 6 = 3
    lay = plan.layout(18)
    assert not lay.partial and lay.micro_batch == 3 and lay.updates == ((0, 1, 2), (3, 4, 5))
    # more rows than the combined batch (24), not a multiple of 6: micro-batches of ceil(25 / 6) = 5 rows
    lay = plan.layout(25)
    assert lay.partial and [lay.micro_rows(j) for j in range(5)] == [5, 5, 5, 5, 5] and lay.num_updates == 2


@settings(max_examples=80, deadline=None)
@given(b=SMALL, d=SMALL, r=SMALL, g=SMALL, data=st.data(), red=st.sampled_from(["mean", "sum"]))
def test_tail_policy_properties(b, d, r, g, data, red):
    plan = ExecutionPlan(micro_batch=b, device_iterations=d, replication_factor=r, gradient_accumulation=g,
                         drop_last=False, reduction=red)
    f = plan.factor
    n = data.draw(st.integers(1, 2 * plan.combined_batch + f), label="rows")
    lay = plan.layout(n)
    if n % f == 0:  # a multiple of D x R x G is a full call with micro batch n / f
        assert not lay.partial and lay.micro_batch == n // f and lay.num_updates == d
        return
    b = max(b, math.ceil(n / f))  # b rows a micro-batch, more only when n exceeds the combined batch
    m = math.ceil(n / b)
    assert lay.partial and lay.num_micro_batches == m <= f
    assert lay.starts == tuple(range(0, n, b)) and lay.stops[-1] == n
    assert all(lay.micro_rows(j) == b for j in range(m - 1))
    assert lay.num_updates == math.ceil(m / (g * r)) <= d
    for j in range(m):
        assert lay.update[j] == j // (g * r) and lay.replica[j] == j % r
    for js in lay.updates:
        rows_u = sum(lay.micro_rows(j) for j in js)
        for j in js:
            want = lay.micro_rows(j) / (rows_u if red == "mean" else b)
            assert lay.weight[j] == pytest.approx(want)
    shards = [lay.replica_index(rep).tolist() for rep in range(r)]
    assert sorted(sum(shards, [])) == list(range(n))
    x = torch.arange(n)
    for rep in range(r):
        assert plan.shard({"x": x}, rep)["x"].tolist() == shards[rep]


def test_inference_layout_cuts_partial_eval_batches():
    inf = ExecutionPlan(micro_batch=4, device_iterations=2, replication_factor=2, gradient_accumulation=2
                        ).for_inference()
    lay = inf.layout(19)  # combined 32, micro batch 8
    assert [lay.micro_rows(j) for j in range(lay.num_micro_batches)] == [8, 8, 3]
    assert lay.out_rows.tolist() == list(range(19))
    lay = inf.layout(64)  # more than the combined batch: a multiple of D x R, micro batch 16
    assert lay.micro_batch == 16 and lay.num_micro_batches == 4
