"""The CPU PlanEngine against single-process references written out here with plain torch.

Each reference is an ordinary training loop (forward over a block of rows, mean loss, backward, SGD step)
that knows nothing of plans, so a wrong split, weight or update count in the engine shows up as a
difference in weights.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from accelbatch.backends.cpu import CPUBackend, PlanEngine

from accelbatch.plan import ExecutionPlan, PlanError

ATOL = 1e-6


class Regressor(torch.nn.Module):
    """The model contract: forward(batch) -> {"loss": mean over rows, "scores": per row, "n": 0-dim}."""

    def __init__(self, d_in: int = 6, d_out: int = 3, loss: str = "mse"):
        super().__init__()
        self.lin = torch.nn.Linear(d_in, d_out)
        self.loss = loss

    def forward(self, batch):
        scores = self.lin(batch["x"])
        out = {"scores": scores}
        if "y" in batch:
            per_row = row_losses(scores, batch["y"], self.loss)
            out["loss"] = per_row.mean()
        return out


def row_losses(scores: torch.Tensor, y: torch.Tensor, kind: str) -> torch.Tensor:
    diff = scores - y
    return (diff.abs() if kind == "l1" else diff.pow(2)).mean(dim=1)


def make_data(n: int, seed: int = 1, d_in: int = 6, d_out: int = 3):
    g = torch.Generator().manual_seed(seed)
    return {"x": torch.randn(n, d_in, generator=g), "y": torch.randn(n, d_out, generator=g)}


def fresh(seed: int = 0, loss: str = "mse") -> Regressor:
    torch.manual_seed(seed)
    return Regressor(loss=loss)


def reference_steps(model: torch.nn.Module, data, blocks, lr: float, kind: str = "mse", scale=None):
    """Plain SGD: one step per (start, stop) block; loss = mean per-row loss (or sum / scale)."""
    losses = []
    for start, stop in blocks:
        x, y = data["x"][start:stop], data["y"][start:stop]
        per_row = row_losses(model.lin(x), y, kind)
        loss = per_row.mean() if scale is None else per_row.sum() / scale
        model.zero_grad()
        loss.backward()
        losses.append(per_row.detach())
        with torch.no_grad():
            for p in model.parameters():
                p -= lr * p.grad
    return losses


def engine_for(model, lr, **plan_kw) -> PlanEngine:
    plan = ExecutionPlan(**plan_kw)
    return CPUBackend().compile(model, torch.optim.SGD(model.parameters(), lr=lr), plan)


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module, atol: float = ATOL):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.allclose(p, q, atol=atol, rtol=0), f"{name}: max diff {(p - q).abs().max():.3g}"


def test_compile_gives_plan_engine_without_process_group():
    model = fresh()
    eng = engine_for(model, 0.1, micro_batch=2, replication_factor=2)
    assert isinstance(eng, PlanEngine) and eng.plan.replication_factor == 2


# --- conformance: gradient accumulation -------------------------------------------------------
def test_mean_accumulation_b8_g4_equals_b32_g1():
    data = make_data(32 * 3)
    acc, big, ref = fresh(), fresh(), fresh()
    e_acc = engine_for(acc, 0.1, micro_batch=8, gradient_accumulation=4)
    e_big = engine_for(big, 0.1, micro_batch=32)
    for call in range(3):
        chunk = {k: v[call * 32:(call + 1) * 32] for k, v in data.items()}
        assert e_acc.train_step(chunk).updates == 1
        e_big.train_step(chunk)
    reference_steps(ref, data, [(0, 32), (32, 64), (64, 96)], lr=0.1)
    assert_same_weights(acc, ref)
    assert_same_weights(big, ref)
    assert not torch.allclose(ref.lin.weight, fresh().lin.weight)  # the steps did move the weights


def test_poptorch_accumulation_vector_l1():
    """PopTorch's test: L1 mean loss; Mean: G=1 == G=2 at one lr; Sum: G=1 at 0.02 == G=2 at 0.01."""
    data = make_data(2 * 5, seed=3)
    calls = [{k: v[i * 2:(i + 1) * 2] for k, v in data.items()} for i in range(5)]
    g1, g2 = fresh(loss="l1"), fresh(loss="l1")
    e1 = engine_for(g1, 0.01, micro_batch=2, gradient_accumulation=1)
    e2 = engine_for(g2, 0.01, micro_batch=1, gradient_accumulation=2)
    s1, s2 = fresh(loss="l1"), fresh(loss="l1")
    es1 = engine_for(s1, 0.02, micro_batch=2, gradient_accumulation=1, reduction="sum")
    es2 = engine_for(s2, 0.01, micro_batch=1, gradient_accumulation=2, reduction="sum")
    for batch in calls:
        for eng in (e1, e2, es1, es2):
            eng.train_step(batch)
    mean_ref, sum_ref = fresh(loss="l1"), fresh(loss="l1")
    blocks = [(i * 2, (i + 1) * 2) for i in range(5)]
    reference_steps(mean_ref, data, blocks, lr=0.01, kind="l1")
    reference_steps(sum_ref, data, blocks, lr=0.02, kind="l1")
    assert_same_weights(g1, g2)
    assert_same_weights(g2, mean_ref)
    assert_same_weights(s1, s2)
    assert_same_weights(s2, sum_ref)
    assert not torch.allclose(mean_ref.lin.weight, sum_ref.lin.weight)  # the two cases differ


# --- conformance: device iterations -------------------------------------------------------------
def test_one_call_d4_equals_four_calls_d1():
    data = make_data(16, seed=5)
    one, four, ref = fresh(), fresh(), fresh()
    e_one = engine_for(one, 0.1, micro_batch=4, device_iterations=4, output_mode="all")
    e_four = engine_for(four, 0.1, micro_batch=4)
    res = e_one.train_step(data)
    assert res.updates == 4
    for i in range(4):
        e_four.train_step({k: v[i * 4:(i + 1) * 4] for k, v in data.items()})
    ref_losses = reference_steps(ref, data, [(i * 4, (i + 1) * 4) for i in range(4)], lr=0.1)
    assert_same_weights(one, ref)
    assert_same_weights(four, ref)
    assert res.loss == pytest.approx(float(torch.stack([r.mean() for r in ref_losses]).mean()), abs=1e-6)


def test_simulated_replicas_average_like_one_big_update():
    """R=2, G=2, D=2 in one process: each update is the mean over its contiguous b*G*R rows."""
    data = make_data(3 * 2 * 2 * 2, seed=7)
    model, ref = fresh(), fresh()
    res = engine_for(model, 0.1, micro_batch=3, device_iterations=2, replication_factor=2,
                     gradient_accumulation=2).train_step(data)
    assert res.updates == 2
    reference_steps(ref, data, [(0, 12), (12, 24)], lr=0.1)
    assert_same_weights(model, ref)


# --- output modes -------------------------------------------------------------------------------
def _frozen_model():
    """A model whose weights do not move (lr 0), so outputs can be checked against F.linear."""
    torch.manual_seed(0)
    return Regressor(6, 20)


def test_output_modes_poptorch_vectors():
    x = torch.randn(10, 1, 5, 6)
    model = _frozen_model()
    want = F.linear(x, model.lin.weight, model.lin.bias).detach()  # [10, 1, 5, 20]

    class Shaped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = model.lin

        def forward(self, batch):
            y = self.lin(batch["x"])
            return {"loss": y.mean(), "y": y}

    expect = {"all": (want, [*range(10)]), "everyn": (want[[4, 9]], [4, 9]),
              "final": (want[9:10], [9]), "sum": (want.sum(0, keepdim=True), None)}
    for mode, (values, rows) in expect.items():
        net = Shaped()
        eng = engine_for(net, 0.0, micro_batch=1, device_iterations=10, output_mode=mode,
                         output_return_period=5 if mode == "everyn" else 1)
        res = eng.train_step({"x": x})
        assert res.outputs["y"].shape == values.shape, mode
        assert torch.allclose(res.outputs["y"], values, atol=1e-5), mode
        assert (res.rows is None) if rows is None else res.rows.tolist() == rows
        assert "loss" not in res.outputs and res.updates == 10


def test_final_rows_with_replicas_and_accumulation():
    model = _frozen_model()
    b, d, r, g = 2, 2, 2, 2
    data = {"x": torch.randn(b * d * r * g, 6), "y": torch.randn(b * d * r * g, 20)}
    res = engine_for(model, 0.0, micro_batch=b, device_iterations=d, replication_factor=r,
                     gradient_accumulation=g).train_step(data)
    last = [((d - 1) * g + g - 1) * r * b + rep * b + i for rep in range(r) for i in range(b)]  # [D, G, R, b]
    assert res.rows.tolist() == last
    assert torch.allclose(res.outputs["scores"], model.lin(data["x"][last]), atol=1e-6)


def test_multiplier_one_leaves_shapes_unchanged():
    class WithCount(Regressor):
        def forward(self, batch):
            out = super().forward(batch)
            out["n"] = torch.tensor(float(batch["x"].shape[0]))
            return out

    torch.manual_seed(0)
    model = WithCount()
    data = make_data(5)
    res = engine_for(model, 0.1, micro_batch=5).train_step(data)
    assert res.outputs["scores"].shape == (5, 3) and res.outputs["n"].shape == ()
    assert res.rows.tolist() == [0, 1, 2, 3, 4]
    res = engine_for(model, 0.1, micro_batch=1, device_iterations=5, output_mode="all").train_step(data)
    assert res.outputs["n"].shape == (5,) and res.outputs["scores"].shape == (5, 3)


# --- the partial-tail policy ----------------------------------------------------------------------
def test_tail_mean_policy_matches_reference():
    """b=4, G=3, D=2, 17 rows, --no-drop-last: updates over rows [0:12] and [12:17], mean over rows."""
    data = make_data(17, seed=11)
    model, ref = fresh(), fresh()
    res = engine_for(model, 0.1, micro_batch=4, device_iterations=2, gradient_accumulation=3,
                     drop_last=False).train_step(data)
    assert res.updates == 2 and res.extras["partial"]
    assert res.rows.tolist() == list(range(17)) and res.outputs["scores"].shape == (17, 3)
    ref_losses = reference_steps(ref, data, [(0, 12), (12, 17)], lr=0.1)
    assert_same_weights(model, ref)
    micro = [ref_losses[0][0:4], ref_losses[0][4:8], ref_losses[0][8:12], ref_losses[1][0:4], ref_losses[1][4:5]]
    # the reported loss: the mean over the 17 rows trained (each micro-batch's mean weighted by its rows)
    assert res.loss == pytest.approx(float(torch.cat(micro).mean()), abs=1e-6)


def test_tail_sum_policy_with_simulated_replicas():
    """b=4, G=2, R=2, D=2 (32 rows), 22-row tail, Sum: updates over [0:16] and [16:22], sum/b."""
    data = make_data(22, seed=13)
    model, ref = fresh(), fresh()
    res = engine_for(model, 0.05, micro_batch=4, device_iterations=2, replication_factor=2,
                     gradient_accumulation=2, reduction="sum", drop_last=False).train_step(data)
    assert res.updates == 2
    reference_steps(ref, data, [(0, 16), (16, 22)], lr=0.05, scale=4)
    assert_same_weights(model, ref)


def test_tail_refused_with_drop_last():
    model = fresh()
    eng = engine_for(model, 0.1, micro_batch=4, device_iterations=2, gradient_accumulation=3)
    with pytest.raises(PlanError, match=r"Invalid batch dimension: In the input .* the batch dimension \(17\)"):
        eng.train_step(make_data(17))


def test_smaller_multiple_infers_micro_batch_like_poptorch():
    data = make_data(12, seed=17)
    model, ref = fresh(), fresh()
    res = engine_for(model, 0.1, micro_batch=8, device_iterations=2, gradient_accumulation=2).train_step(data)
    assert res.updates == 2
    reference_steps(ref, data, [(0, 6), (6, 12)], lr=0.1)
    assert_same_weights(model, ref)


# --- evaluation --------------------------------------------------------------------------------
def test_eval_returns_every_row_and_changes_nothing():
    model = fresh()
    before = copy.deepcopy(model.state_dict())
    eng = engine_for(model, 0.1, micro_batch=4, device_iterations=2, gradient_accumulation=3,
                     output_mode="final")
    for n in (24, 5, 1):
        data = make_data(n, seed=n)
        res = eng.eval_step(data)
        assert res.rows.tolist() == list(range(n)) and res.updates == 0
        want = model.lin(data["x"]).detach()
        assert torch.allclose(res.outputs["scores"], want, atol=1e-6)
        assert res.loss == pytest.approx(float(row_losses(want, data["y"], "mse").mean()), abs=1e-6)
        assert not res.outputs["scores"].requires_grad
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])
    no_labels = eng.eval_step({"x": torch.randn(3, 6)})
    assert no_labels.loss is None and no_labels.outputs["scores"].shape == (3, 3)
    with pytest.raises(PlanError, match="Invalid batch dimension"):
        eng.eval_step(make_data(25))  # more than the combined batch and not a multiple of D x R


def test_train_step_errors_are_clear():
    model = fresh()
    with pytest.raises(PlanError, match="inference plan"):
        CPUBackend().compile(model, torch.optim.SGD(model.parameters(), lr=0.1),
                             ExecutionPlan(training=False)).train_step(make_data(2))
    with pytest.raises(PlanError, match="needs an optimizer"):
        CPUBackend().compile(model, None, ExecutionPlan()).train_step(make_data(2))
    with pytest.raises(PlanError, match="'loss'"):
        engine_for(model, 0.1).train_step({"x": torch.randn(2, 6)})
    class PerRowLoss(Regressor):
        def forward(self, batch):
            return {"loss": row_losses(self.lin(batch["x"]), batch["y"], "mse")}

    with pytest.raises(PlanError, match="must be a scalar"):
        engine_for(PerRowLoss(), 0.1).train_step(make_data(2))
    with pytest.raises(PlanError, match="'y' has 3 rows"):
        engine_for(model, 0.1).train_step({"x": torch.randn(2, 6), "y": torch.randn(3, 3)})


def test_state_dict_round_trip():
    model = fresh()
    eng = engine_for(model, 0.1, micro_batch=4)
    eng.train_step(make_data(4))
    state = copy.deepcopy(eng.state_dict())
    assert set(state) == {"model", "optimizer"}
    other = fresh(seed=9)
    eng2 = engine_for(other, 0.1, micro_batch=4)
    eng2.load_state_dict(state)
    assert_same_weights(other, model, atol=0)


# --- mixed precision -------------------------------------------------------------------------------------
def test_bf16_runs_the_forward_under_cpu_autocast_and_returns_fp32():
    import math
    import types

    seen = []

    class Probe(Regressor):
        def forward(self, batch):
            seen.append(torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"))
            return super().forward(batch)

    torch.manual_seed(0)
    model = Probe()
    before = copy.deepcopy(model.state_dict())
    backend = CPUBackend()
    backend.setup(types.SimpleNamespace(replication_factor=1, mixed_precision="bf16"))
    eng = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan(micro_batch=4))
    res = eng.train_step(make_data(4))
    assert seen == [torch.bfloat16]
    assert res.outputs["scores"].dtype == torch.float32 and math.isfinite(res.loss)
    assert not torch.is_autocast_enabled("cpu")                   # only inside the forward
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert model.lin.weight.dtype == torch.float32                # weights stay fp32
    assert eng.eval_step(make_data(3)).outputs["scores"].dtype == torch.float32 and seen[-1] == torch.bfloat16
    seen.clear()
    engine_for(model, 0.1).train_step(make_data(1))               # no mixed precision: no autocast
    assert seen == [False]


def test_fp16_on_the_cpu_scales_the_loss_as_a_plain_torch_loop_does():
    """fp16: autocast and torch's CPU GradScaler, step for step as the loop torch documents (an update
    whose gradients overflow at the initial scale is skipped and the scale halved)."""
    import types

    from accelbatch.backends.cpu import fp16_on_cpu_supported

    if not fp16_on_cpu_supported():
        pytest.skip(f"torch {torch.__version__} has no fp16 CPU autocast")
    data = [{**b, "y": b["y"] * 100} for b in (make_data(4, seed=s) for s in range(6))]   # large grads
    ref = fresh()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    scales, ref_losses = [], []
    for batch in data:                       # the plain loop: one micro batch per step
        opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = ref(batch)["loss"]
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        ref_losses.append(loss.item())
    assert scales[0] < 65536.0               # the data overflows at the initial scale: a skipped update
    model = fresh()
    backend = CPUBackend()
    backend.setup(types.SimpleNamespace(replication_factor=1, mixed_precision="fp16"))
    eng = backend.compile(model, torch.optim.SGD(model.parameters(), lr=0.1), ExecutionPlan(micro_batch=4))
    losses = [eng.train_step(batch).loss for batch in data]
    assert losses == pytest.approx(ref_losses, rel=1e-6)
    assert eng.hooks.scaler.get_scale() == scales[-1]
    assert_same_weights(model, ref, atol=0)
    fp32 = fresh()
    fp32_losses = [engine_for(fp32, 0.1, micro_batch=4).train_step(batch).loss for batch in data[:1]]
    assert losses[0] != fp32_losses[0]        # autocast really ran in fp16
