"""--loss-normalization: micro (each micro-batch's mean loss, PopTorch's Mean) and token (the per-token mean
of the whole update, as one big batch) on the cpu engine, the cuda engine (on the CPU), the emulated IPU and
two gloo replicas, against plain
torch computed here. The micro-batches hold uneven token counts, so the two settings differ."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends.cpu import CPUBackend
from accelbatch.backends.cuda import CUDABackend
from accelbatch.backends.distributed import spawn_replicas
from accelbatch.backends.ipu import IPUBackend
from torch import nn

from accelbatch.opts import Opts
from accelbatch.plan import LOSS_TOKENS, ExecutionPlan, PlanError

VOCAB, WIDTH, LR = 7, 6, 0.5
PLAN = dict(micro_batch=2, device_iterations=2, gradient_accumulation=2, replication_factor=2)


class TokenModel(nn.Module):
    """Per-token logits from an embedding; the loss is the mean NLL over the micro-batch's non-pad targets."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, 5)
        self.out = nn.Linear(5, VOCAB)

    def forward(self, batch):
        assert LOSS_TOKENS not in batch and "_loss_scale" not in batch, "the engine's keys reached the model"
        logits = self.out(self.embed(batch["src"]))
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), batch["tgt"], ignore_index=0, reduction="none")
        loss = nll.sum() / (batch["tgt"] != 0).sum().clamp_min(1)
        return {"loss": loss, "logits": logits.detach()}


def data(rows: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Rows of 1..WIDTH target tokens (padding 0), so micro-batches hold different token counts."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, WIDTH + 1, (rows,), generator=g)
    lengths[0], lengths[1] = WIDTH, 1  # at least one very uneven pair
    live = torch.arange(WIDTH).unsqueeze(0) < lengths.unsqueeze(1)
    src = torch.randint(1, VOCAB, (rows, WIDTH), generator=g) * live
    tgt = torch.randint(1, VOCAB, (rows, WIDTH), generator=g) * live
    return {"src": src, "tgt": tgt, LOSS_TOKENS: lengths}


def reference(batch, updates: list[list[tuple[int, int]]], token: bool) -> TokenModel:
    """Plain torch SGD: per update, one big batch's per-token mean (token) or the mean of its micro-batches'
    per-token means (micro); ``updates`` lists each update's micro-batch row ranges."""
    model = TokenModel()
    for blocks in updates:
        nll_sum, tokens, means = 0.0, 0, []
        for s, e in blocks:
            logits = model.out(model.embed(batch["src"][s:e]))
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), batch["tgt"][s:e], ignore_index=0,
                                              reduction="sum")
            count = int((batch["tgt"][s:e] != 0).sum())
            nll_sum, tokens = nll_sum + nll, tokens + count
            means.append(nll / count)
        loss = nll_sum / tokens if token else sum(means) / len(means)
        model.zero_grad()
        loss.backward()
        with torch.no_grad():
            for p in model.parameters():
                p -= LR * p.grad
    return model


def full_updates(rows: int, per_update: int, b: int) -> list[list[tuple[int, int]]]:
    return [[(s, s + b) for s in range(u, u + per_update, b)] for u in range(0, rows, per_update)]


def assert_same(a: nn.Module, b: nn.Module, atol: float = 1e-6) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        diff = (p - q).abs().max().item()
        assert diff <= atol, f"{name}: max diff {diff:.3g}"


def cpu_engine(plan: ExecutionPlan):
    model = TokenModel()
    return CPUBackend().compile(model, torch.optim.SGD(model.parameters(), lr=LR), plan), model


def cuda_engine(plan: ExecutionPlan):
    """The CUDA backend's engine on accelerate's CPU device (its hooks, the same loop)."""
    backend = CUDABackend(cpu=True)
    backend.setup(Opts(device="cuda"))
    model = TokenModel()
    return backend.compile(model, torch.optim.SGD(model.parameters(), lr=LR), plan), model


def ipu_engine(plan: ExecutionPlan):
    backend = IPUBackend()
    backend.setup(Opts(ipu_emulator=True, seed=0))
    model = TokenModel()
    return backend.compile(model, torch.optim.SGD(model.parameters(), lr=LR), plan), model


ENGINES = {"cpu": cpu_engine, "cuda": cuda_engine, "ipu": ipu_engine}


@pytest.mark.parametrize("device", list(ENGINES))
@pytest.mark.parametrize("norm", ["micro", "token"])
def test_uneven_micro_batches_give_the_one_big_batch_gradient_under_token(device, norm):
    plan = ExecutionPlan(**PLAN, loss_normalization=norm)
    batch = data(plan.combined_batch)
    engine, model = ENGINES[device](plan)
    result = engine.train_step(batch)
    if device == "ipu":
        engine.sync_to_host()
    assert result.updates == 2
    updates = full_updates(plan.combined_batch, 8, 2)
    assert_same(model, reference(batch, updates, token=norm == "token"))
    # the data make the settings differ, so the comparison above tells them apart
    other = reference(batch, updates, token=norm != "token")
    assert (other.out.weight - model.out.weight).abs().max() > 1e-3
    # the reported loss is the model's own (unscaled) loss of the micro-batches the output mode returns
    # (Final: the last micro-batch of each replica, rows 12:14 and 14:16, run after the first update)
    before = reference(batch, updates[:1], token=norm == "token")
    with torch.no_grad():
        shown = [before(dict(src=batch["src"][s:s + 2], tgt=batch["tgt"][s:s + 2]))["loss"] for s in (12, 14)]
    assert result.loss == pytest.approx(float(sum(shown)) / 2, abs=1e-6)


def test_token_weights_follow_the_partial_tail_policy_on_the_cpu():
    plan = ExecutionPlan(micro_batch=2, device_iterations=2, gradient_accumulation=2, drop_last=False,
                         loss_normalization="token")
    batch = data(7, seed=3)  # micro-batches [0:2] [2:4] | [4:6] [6:7]
    engine, model = cpu_engine(plan)
    engine.train_step(batch)
    assert_same(model, reference(batch, [[(0, 2), (2, 4)], [(4, 6), (6, 7)]], token=True))


def test_without_loss_tokens_token_keeps_the_row_weights():
    batch = data(16, seed=5)
    del batch[LOSS_TOKENS]
    models = []
    for norm in ("micro", "token"):
        engine, model = cpu_engine(ExecutionPlan(**PLAN, loss_normalization=norm))
        engine.train_step(batch)
        models.append(model)
    assert_same(*models, atol=0)


def test_token_with_sum_reduction_is_refused_in_one_line():
    with pytest.raises(PlanError, match="--loss-normalization token .* --reduction sum") as info:
        ExecutionPlan(reduction="sum", loss_normalization="token")
    assert "\n" not in str(info.value)
    with pytest.raises(PlanError, match="--loss-normalization: 'tokens' is not one of micro, token"):
        ExecutionPlan(loss_normalization="tokens")
    assert ExecutionPlan.from_opts(Opts(loss_normalization="token"), training=True).loss_normalization.value == \
        "token"
    assert ExecutionPlan.from_opts(Opts(loss_normalization="token"), training=False).loss_normalization.value == \
        "micro"


def _replica_worker(rank: int) -> dict[str, torch.Tensor]:
    plan = ExecutionPlan(**PLAN, loss_normalization="token")
    model = TokenModel()
    engine = CPUBackend().compile(model, torch.optim.SGD(model.parameters(), lr=LR), plan)
    engine.train_step(plan.shard(data(plan.combined_batch), rank))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_two_gloo_replicas_share_the_update_token_count():
    """Each replica sees only its own rows; one all-reduce of the update's tokens gives the big-batch mean."""
    states = spawn_replicas(_replica_worker, 2, timeout_s=120)
    batch = data(16)
    expected = reference(batch, full_updates(16, 8, 2), token=True)
    for state in states:
        for k, v in expected.state_dict().items():
            diff = (state[k] - v).abs().max().item()
            assert diff <= 1e-6, f"{k}: max diff {diff:.3g}"
