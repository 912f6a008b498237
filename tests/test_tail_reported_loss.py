"""A tail's micro-batches differ in rows; the train row's loss is the mean loss of the rows trained (each
micro-batch's mean weighted by its rows, as the tail policy weighs its gradient), not the mean of the
micro-batches' means. Checked against `eval -dt train` of the same weights: a learning rate of 1e-30 leaves
them as they start, so training and evaluation score the same model on the same three examples."""

from __future__ import annotations

import json

import pytest
from accelbatch.backends.engine import _reported_loss

from accelbatch.cli import main
from accelbatch.layout import compute_layout
from accelbatch.plan import ExecutionPlan

FROZEN = ("-m", "bag", "-lr", "1e-30", "-opt", "sgd", "-veps", "-1", "--no-progress", "--eval-splits", "")


FRUIT = ["apple", "banana", "cherry", "date", "elder", "fig", "grape", "honey", "iris", "jade", "kiwi", "lemon"]
TEXTS = [("apple elder iris honey say grape", "grape"), ("honey fig jade say grape", "grape"),
         ("cherry elder cherry lemon banana say date", "date")]  # losses about 9, 6 and 0.7 as the model starts


def _write_three(folder):
    for split in ("train", "valid", "test"):
        (folder / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": text, "labels": [label], "label_candidates": FRUIT}) + "\n" for text, label in TEXTS))


@pytest.mark.parametrize("plan", [("-bs", "2", "-ga", "2"), ("-bs", "2", "-di", "2")])
def test_a_tail_reports_the_mean_loss_of_its_rows(tmp_path, plan):
    _write_three(tmp_path)
    model, trained, scored = tmp_path / "m.pt", tmp_path / "train.json", tmp_path / "eval.json"
    assert main(["train", "-t", f"jsonl:{tmp_path}", "-dt", "train:ordered", *plan, "--no-drop-last",
                 "--output-mode", "all", "-ne", "1", "-mf", str(model), "--report-json", str(trained),
                 *FROZEN]) == 0  # one call of 3 rows: micro-batches of 2 and 1
    assert main(["eval", "-mf", str(model), "-t", f"jsonl:{tmp_path}", "-dt", "train", "--no-progress",
                 "--report-json", str(scored)]) == 0
    train, evaluated = json.loads(trained.read_text())["train"], json.loads(scored.read_text())["train"]
    assert train["exs"] == evaluated["exs"] == 3
    assert train["loss"] == pytest.approx(evaluated["loss"], abs=1e-4)


def test_the_weighting_by_rows_is_for_tails_alone():
    plan = ExecutionPlan(micro_batch=2, gradient_accumulation=2, drop_last=False)
    tail, full = compute_layout(plan, 3), compute_layout(plan, 4)
    assert tail.partial and (tail.stops[0] - tail.starts[0], tail.stops[1] - tail.starts[1]) == (2, 1)
    assert _reported_loss(tail, [(0, 3.0), (1, 6.0)]) == pytest.approx((2 * 3.0 + 6.0) / 3)
    assert _reported_loss(full, [(0, 3.0), (1, 6.0)]) == 4.5
    assert _reported_loss(tail, []) is None
