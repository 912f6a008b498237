"""Merged and subtracted reports are exact where some rows are not scored; empty labels are misses; --metrics
keeps each task's row; a generator's ltpb counts micro-batches (session 31). Expected values are hand counts."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import TwoReplicas

import accelbatch as ab
from accelbatch.metric_names import select_metrics
from accelbatch.metrics import Metrics, combine_reports, merge_reports, score_counted
from accelbatch.models.generator import TransformerGeneratorAgent
from accelbatch.report_merge import reduce_report

YES = ("yes",)


def _metrics(*batches: list[str | None]) -> Metrics:
    """Metrics of these batches of replies, each row's answer 'yes' (None: a reply without text)."""
    m = Metrics()
    for preds in batches:
        m.add_rows(preds, [YES] * len(preds), len(preds))
    return m


def test_log_windows_and_a_resumed_train_row_use_the_scored_rows():
    first = ["yes", None, None, "no"]  # 4 exs, 2 scored, 1 correct
    second = ["yes", "yes"]  # 2 exs, 2 scored, 2 correct
    third = [None]  # 1 ex, none scored
    r1, r2, r3 = _metrics(first).report(), _metrics(first, second).report(), _metrics(first, second, third).report()
    window = combine_reports(r2, r1, sign=-1)
    assert (window["exs"], window["accuracy"]) == (2, 1.0)  # was 1.25: (0.75 x 6 - 0.5 x 4) / 2
    assert window == {"exs": 2, "accuracy": 1.0, "f1": 1.0}
    assert (r2["exs"], r2["scored_exs"], r2["accuracy"]) == (6, 4, 0.75)
    assert combine_reports(r1, {}, sign=-1) == {"exs": 4, "scored_exs": 2, "accuracy": 0.5, "f1": 0.5}
    assert combine_reports(r3, r2, sign=-1) == {"exs": 1}  # nothing scored: no accuracy (was 0.75)
    resumed = combine_reports(r1, _metrics(second).report())  # before the resume, then since
    assert resumed == {"exs": 6, "scored_exs": 4, "accuracy": 0.75, "f1": 0.75}


def _reduce(first: dict, second: dict) -> dict:
    recorder = TwoReplicas()
    reduce_report(second, recorder)
    return reduce_report(first, TwoReplicas(recorder.sent))


def test_replica_reports_merge_as_one_process():
    a, b = ["yes", None], ["no", None, None, None]  # 1 of 1 scored right, 0 of 1: one process 1 / 2
    merged = _reduce(_metrics(a).report(), _metrics(b).report())
    assert merged == {"exs": 6, "scored_exs": 2, "accuracy": 0.5, "f1": 0.5}  # was 1/3, weighted by exs
    assert merged == _metrics(a, b).report()
    tasks = [("t1", (a, b)), ("t2", (["yes", "no"], ["yes"]))]
    replicas = [merge_reports([(name, _metrics(parts[i]).report()) for name, parts in tasks]) for i in (0, 1)]
    got = _reduce(*replicas)
    want = merge_reports([(name, _metrics(*parts).report()) for name, parts in tasks])
    assert got == pytest.approx(want, rel=1e-12) and set(got) == set(want)
    assert (got["t1/exs"], got["t2/exs"]) == (6, 3) and all(type(got[k]) is int for k in ("t1/exs", "t2/exs"))
    assert got["accuracy"] == pytest.approx((1 / 2 + 2 / 3) / 2)  # the mean of the tasks'


def test_an_example_with_an_empty_list_of_labels_is_a_miss():
    preds, answers = ["yes", "yes", "no", "no"], [YES, (), YES, YES]
    rows = Metrics()
    rows.add_rows(preds, answers, 4)
    batch = Metrics()
    batch.add_batch(preds, answers)
    for m in (rows, batch):
        assert m.report() == {"exs": 4, "accuracy": 0.25, "f1": 0.25}  # was 1 of 3 scored
    assert score_counted({(): {"yes": 2}, YES: {"yes": 1, None: 3}})[:2] == (3, 1)
    none = Metrics()
    none.add_rows(["yes"], [None], 0)  # no labels at all: not an example, not scored
    assert none.report() == {"exs": 0}


def test_a_metrics_list_keeps_each_tasks_row():
    report = {"valid": {"exs": 13, "accuracy": 0.4, "f1": 0.7, "t1/exs": 8, "t1/accuracy": 0.5, "t1/f1": 0.8,
                        "t2/exs": 5, "t2/accuracy": 0.3, "t2/f1": 0.6, "time_s": 1.0}}
    assert select_metrics(report, "accuracy") == {"valid": {"exs": 13, "accuracy": 0.4, "t1/exs": 8,
                                                            "t1/accuracy": 0.5, "t2/exs": 5, "t2/accuracy": 0.3,
                                                            "time_s": 1.0}}


def test_generator_ltpb_counts_micro_batches_of_bs_rows_not_calls():
    agent = TransformerGeneratorAgent(ab.Opts(model="transformer/generator", embedding_size=8, batchsize=3))
    agent.metrics = Metrics()
    for rows in (6, 4):  # -di 2: a call of 2 micro-batches, then one of 3 + 1 rows: 4 micro-batches of -bs 3
        outputs = {"nll": torch.ones(rows), "tokens": torch.full((rows,), 2.0), "correct": torch.ones(rows)}
        agent.replies(outputs, [{}] * rows)
    report = agent.metrics.report()
    assert report["tokens"] == 20 and report["ltpb"] == 5.0  # 20 tokens / 4 (was / 2)
    assert "tpb" not in report  # ParlAI's tpb counts the context's tokens too


def _cli(tmp_path, *args: str) -> dict:
    out = tmp_path / "r.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "accelbatch", "eval", *args, "--report-json", str(out)],
                          capture_output=True, text=True, timeout=240, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(out.read_text())["valid"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_cli_two_replicas_and_empty_labels_give_the_hand_counts(tmp_path):
    (tmp_path / "guess_s31.py").write_text(
        "from accelbatch.agents import Agent\nfrom accelbatch.messages import Message\n\n\n"
        "class GuessAgent(Agent):\n    def act(self):\n        obs = self.observation or {}\n"
        "        return Message(id='g', text=obs['guess']) if 'guess' in obs else Message(id='g')\n")
    rows = [("yes", "yes"), ("yes", None), ("yes", "no"), ("yes", "no")]
    (tmp_path / "norep.jsonl").write_text("".join(
        json.dumps({"text": str(i), "labels": [lab], **({"guess": g} if g else {})}) + "\n"
        for i, (lab, g) in enumerate(rows)))
    (tmp_path / "empty.jsonl").write_text('{"text": "e1", "labels": [], "episode_done": true}\n'
                                          '{"text": "e2", "labels": ["foo"], "episode_done": true}\n')
    two = _cli(tmp_path, "-t", "jsonl:norep.jsonl", "-m", "guess_s31:GuessAgent", "-bs", "1", "-rf", "2")
    assert (two["exs"], two["accuracy"]) == (4, pytest.approx(1 / 3))  # was 0.25
    assert two["scored_exs"] == 3
    empty = _cli(tmp_path, "-t", "jsonl:empty.jsonl", "-m", "repeat_label", "-bs", "1")
    assert (empty["exs"], empty["accuracy"]) == (2, 0.5)  # was 1.0: the empty labels left out
