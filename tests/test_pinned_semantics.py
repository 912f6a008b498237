"""Semantics pinned against hand-computed values (ParlAI's rules where it has them): the best validation's
score and the improvement rule, dynamic batching's per-epoch shuffle and token budget, the row schedule's
dealing across epochs, the options a resume keeps, --skip-nan's reported loss, answer normalisation and
BLEU's reference length, and the counts a merged or evaluation report holds."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from accelbatch.backends.base import EngineOptions
from accelbatch.backends.cpu import PlanEngine
from torch import nn

from accelbatch import checkpoint as ck
from accelbatch.best_valid import BestValid, continued_best, write_best
from accelbatch.checkpoint import CheckpointError
from accelbatch.cli import main
from accelbatch.data.batching import BatchingConfig, TokenBatcher
from accelbatch.data.episodes import EpisodeTable
from accelbatch.data.orders import DataOrder, permutation
from accelbatch.data.schedule import BatchPlan, RowSchedule
from accelbatch.metrics import bleu4, exact_match, normalize_answer
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan
from accelbatch.report_merge import merge_reports


# --- the best validation ------------------------------------------------------------------------------
def test_a_minimised_metric_scores_its_negation(tmp_path: Path) -> None:
    """Larger scores are better, so a loss of 1.0 scores -1.0: a continued run's lower loss (0.5) beats the
    stored model and a higher one (2.0) does not."""
    assert BestValid("loss", "min", 1.0).score() == -1.0
    assert BestValid("accuracy", "max", 0.9).score() == 0.9
    model_file = tmp_path / "m.pt"
    model_file.write_bytes(b"")
    write_best(str(model_file), BestValid("loss", "min", 1.0))
    best = continued_best(Opts(model_file=str(model_file), validation_metric="loss"), False)
    assert best == -1.0
    assert -0.5 > best and not -2.0 > best  # the run scores a loss of x as -x


def test_a_best_chosen_under_another_mode_is_forgotten(tmp_path: Path) -> None:
    """A model chosen on accuracy (max) says nothing of a run choosing on accuracy (min): -inf."""
    model_file = tmp_path / "m.pt"
    model_file.write_bytes(b"")
    write_best(str(model_file), BestValid("accuracy", "max", 0.9))
    opts = Opts(model_file=str(model_file), validation_metric="accuracy", validation_metric_mode="min")
    assert continued_best(opts, False) == -math.inf


def test_a_validation_that_ties_the_best_is_not_an_improvement(tmp_path: Path) -> None:
    """repeat_label validates at accuracy 1.0 each time: -veps 0.25 -vp 2 stops at the third validation
    (the first sets the best, two ties follow), i.e. after 0.75 of babi:1's 5000 training examples, rounded up
    to whole batches of 32: 118 steps, 3776 examples (not the 10000 of -ne 2)."""
    report = tmp_path / "r.json"
    rc = main(["train", "-t", "babi:1", "-m", "repeat_label", "-ne", "2", "-veps", "0.25", "-vp", "2",
               "--device", "cpu", "--no-progress", "--report-json", str(report)])
    assert rc == 0
    train = json.loads(report.read_text())["train"]
    assert train["stopped_by"] == "validation"
    assert train["exs"] == math.ceil(0.75 * 5000 / 32) * 32 == 3776


# --- dynamic batching and the row schedule ------------------------------------------------------------
def _groups(plan: BatchPlan, epoch: int) -> set[frozenset[int]]:
    return {frozenset(int(i) for i in batch.items) for batch in plan.batches(epoch)}


@pytest.mark.parametrize("strategy", ["batchsort", "full"])
def test_dynamic_batching_draws_a_fresh_shuffle_each_epoch(strategy: str) -> None:
    """Eight one-turn episodes, a cache of 4: each epoch cuts its batches from its own seeded order, so the
    groups change from epoch to epoch; batchsort (batch 4 = cache 4) groups each 4 consecutive examples of
    permutation(8, seed, epoch, rank)."""
    table = EpisodeTable.of_lengths([1] * 8)
    plan = BatchPlan(table, 0, np.arange(1, 9), BatchingConfig(strategy=strategy, batch_size=4, max_tokens=16,
                                                               cache_size=4),
                     training=True, shuffle=True, seed=1, drop_last=True)
    assert _groups(plan, 1) != _groups(plan, 0)
    if strategy == "batchsort":
        for epoch in range(3):
            order = permutation(8, 1, epoch, 0).tolist()
            assert _groups(plan, epoch) == {frozenset(order[:4]), frozenset(order[4:])}


def test_the_row_schedule_deals_the_epochs_stream_to_the_rows_in_turn() -> None:
    """Five one-turn episodes in data order on two rows: the stream 0..4, 0..4 is dealt out two at a time."""
    table = EpisodeTable.of_lengths([1] * 5)
    schedule = RowSchedule(table, rows=2, order=DataOrder(5), loop=True, pad=-1)
    stream = [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]
    dealt = [[stream[2 * step], stream[2 * step + 1]] for step in range(5)]
    assert dealt == [[0, 1], [2, 3], [4, 0], [1, 2], [3, 4]]
    assert schedule.block(5).tolist() == dealt


def test_full_batches_round_their_rows_down_to_the_row_multiple() -> None:
    """Budget 10 and length 3 fit 3 rows, rounded down to a multiple of 2: four batches of 2 x 3 = 6 tokens."""
    batcher: TokenBatcher[int] = TokenBatcher(max_tokens=10, cache_size=100, row_multiple=2)
    batches = list(batcher.run((i, 3) for i in range(8)))
    assert [b.shape for b in batches] == [(2, 3)] * 4
    assert all(b.padded_tokens <= 10 for b in batches)
    assert sorted(i for b in batches for i in b.items) == list(range(8))


# --- resuming -----------------------------------------------------------------------------------------
# each option a resume must keep: its flag as the message names it, and a valid value other than the checkpoint's
IPU = {"device": "ipu", "replication_factor": 4, "ipu_input_replica_grouping": 2}  # the run the IPU options need
CHANGED: dict[str, tuple[str, Any]] = {
    "model": ("--model", "bag"),
    "embedding_size": ("--embedding-size", 32),
    "text_truncate": ("--text-truncate", 128),
    "label_truncate": ("--label-truncate", 10),
    "task": ("--task", "babi:2"),
    "multitask_weights": ("--multitask-weights", "1,3"),
    "datatype": ("--datatype", "train:ordered"),
    "seed": ("--seed", 1),
    "batchsize": ("--batchsize", 16),
    "device_iterations": ("--device-iterations", 2),
    "replication_factor": ("--replication-factor", 2),
    "gradient_accumulation": ("--gradient-accumulation", 2),
    "numthreads": ("--numthreads", 2),
    "reduction": ("--reduction", "sum"),
    "loss_normalization": ("--loss-normalization", "token"),
    "drop_last": ("--drop-last", False),
    "dynamic_batching": ("--dynamic-batching", "full"),
    "context_length": ("--context-length", 2),
    "include_labels": ("--include-labels", False),
    "optimizer": ("--optimizer", "sgd"),
    "ipu_input_replica_grouping": ("--ipu-input-replica-grouping", 4),
    "ipu_input_replica_grouping_type": ("--ipu-input-replica-grouping-type", "orthogonal"),
}


def test_every_option_a_resume_keeps_is_checked_here() -> None:
    assert set(ck.RESUME_OPTS) <= set(CHANGED)


@pytest.mark.parametrize("key", sorted(CHANGED))
def test_a_resume_refuses_each_option_changed_naming_its_flag(key: str) -> None:
    flag, value = CHANGED[key]
    saved = Opts(**IPU) if key.startswith("ipu_") else Opts()
    checkpoint = ck.Checkpoint(path="x.ckpt", model_state={}, opts=saved.to_dict())
    ck.check_resumable(checkpoint, saved)
    message = f"{flag} {value!r} (checkpoint: {getattr(saved, key)!r})"
    with pytest.raises(CheckpointError, match=re.escape(message)):
        ck.check_resumable(checkpoint, saved.replace(**{key: value}))


# --- --skip-nan's reported loss -----------------------------------------------------------------------
class Poisonable(nn.Module):
    """A linear regression whose rows with p > 0 give a NaN loss."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(3, 2)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        pred = self.lin(batch["x"])
        poison = torch.where(batch["p"] > 0, float("nan"), 0.0)
        per_row = ((pred - batch["y"]) ** 2).mean(1) + pred.sum(1) * poison
        return {"loss": per_row.mean(), "pred": pred.detach()}


def _clean_losses_by_hand(batch: dict[str, torch.Tensor], micro: int, updates: int) -> list[float]:
    """SGD one micro-batch per update, skipping (not applying) the NaN ones: the clean updates' losses."""
    model = Poisonable()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for u in range(updates):
        loss = model({k: v[u * micro:(u + 1) * micro] for k, v in batch.items()})["loss"]
        if torch.isfinite(loss):
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            losses.append(loss.item())
    return losses


def test_skip_nan_with_every_output_reports_the_mean_of_the_clean_micro_batches() -> None:
    g = torch.Generator().manual_seed(2)
    batch = {"x": torch.randn(8, 3, generator=g), "y": torch.randn(8, 2, generator=g), "p": torch.zeros(8)}
    batch["p"][4] = 1.0  # the third of four updates (rows 4-5) is NaN
    clean = _clean_losses_by_hand(batch, micro=2, updates=4)
    assert len(clean) == 3
    model = Poisonable()
    engine = PlanEngine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                        ExecutionPlan(micro_batch=2, device_iterations=4, output_mode="all"),
                        EngineOptions(skip_nan=True))
    result = engine.train_step(batch)
    assert result.extras["skipped_updates"] == 1 and result.updates == 3
    assert result.loss == pytest.approx(sum(clean) / 3, rel=1e-5)


# --- metrics and reports ------------------------------------------------------------------------------
def test_answers_drop_the_articles_a_an_the() -> None:
    """ParlAI's normalize_answer: lower case, no punctuation, no articles, single spaces."""
    assert normalize_answer("An apple, the pear") == "apple pear"
    assert exact_match("an apple", ["apple"]) is True


def test_bleu_takes_the_shorter_reference_on_a_length_tie() -> None:
    """nltk's closest_ref_length (ParlAI's bleu): references of 3 and 5 words are both 1 from a 4-word
    hypothesis; the shorter (3) is taken, so no brevity penalty, and every n-gram of "x y z w" is in the
    5-word reference: BLEU-4 is 1."""
    assert bleu4("x y z w", ["x y z", "x y z w q"]) == pytest.approx(1.0)


def test_a_multitask_merge_keeps_the_scored_counts_per_task_only() -> None:
    merged = merge_reports([("t1", {"exs": 4, "accuracy": 0.5, "scored_exs": 2, "loss": 1.0, "loss_exs": 3}),
                            ("t2", {"exs": 3, "accuracy": 1.0, "loss": 2.0})])
    top = {k: v for k, v in merged.items() if "/" not in k}
    assert top == {"exs": 7, "accuracy": 0.75, "loss": 1.5}
    assert merged["t1/scored_exs"] == 2 and merged["t1/loss_exs"] == 3


def test_an_evaluation_counts_only_its_labelled_turns(tmp_path: Path) -> None:
    """Episodes of an unlabelled context turn then a labelled question: valid's exs are the 4 questions, the
    loss scored them all, so the report holds no separate loss_exs."""
    for split in ("train", "valid", "test"):
        with open(tmp_path / f"{split}.jsonl", "w") as f:
            for i in range(4):
                f.write(json.dumps({"text": f"context {i} sky", "episode_done": False}) + "\n")
                f.write(json.dumps({"text": f"what colour {i}", "labels": ["blue"],
                                    "label_candidates": ["blue", "red", "green"], "episode_done": True}) + "\n")
    report = tmp_path / "r.json"
    rc = main(["train", "-t", f"jsonl:{tmp_path}", "-m", "bag", "-ne", "1", "-bs", "2", "--device", "cpu",
               "--no-progress", "-veps", "-1", "-esz", "16", "--report-json", str(report)])
    assert rc == 0
    valid = json.loads(report.read_text())["valid"]
    assert valid["exs"] == 4
    assert "loss" in valid and "loss_exs" not in valid
