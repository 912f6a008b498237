"""Validation of several tasks capped by -vme scores every task, about equally (ParlAI gives each task's
valid world an equal share of the cap); the final, uncapped evaluation still scores every example once.
The same with data workers and dynamic batching (a performance option never changes results: sorted by length,
the capped examples were the first task's, or the shortest task's)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from accelbatch.cli import main
from accelbatch.data.orders import make_order
from accelbatch.data.schedule import EpisodeTable


def _write(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.fixture
def two_tasks(tmp_path):
    """Task `small` (5 valid examples) and task `big` (30), each with train/valid/test files."""
    for name, sizes in (("small", (11, 5, 3)), ("big", (40, 30, 4))):
        for split, n in zip(("train", "valid", "test"), sizes):
            _write(tmp_path / name / f"{split}.jsonl",
                   [{"text": f"{name} {split} {i}", "labels": [f"a{i % 3}"], "label_candidates": ["a0", "a1", "a2"],
                     "episode_done": True} for i in range(n)])
    return tmp_path


def test_the_order_takes_the_next_episode_from_the_task_that_served_fewest_examples():
    # task 0: episodes of 1 and 3 turns; task 1: three of 1 turn. Served before each: task 0 [0, 1], task 1
    # [0, 1, 2]; by (served, task): t0e0, t1e2, t0e1, t1e3, t1e4
    table = EpisodeTable.of_lengths([1, 3, 1, 1, 1], tasks=(2, 3))
    assert make_order(table, False, 0, balance_tasks=True)(0).tolist() == [0, 2, 1, 3, 4]
    # uncapped: one episode of each task in turn, as ParlAI's MultiTaskTeacher serves ordered data
    assert make_order(table, False, 0)(0).tolist() == [0, 2, 1, 3, 4]
    table = EpisodeTable.of_lengths([3, 1, 1, 1, 1], tasks=(3, 2))  # the orders differ: served [0, 3, 4], [0, 1]
    assert make_order(table, False, 0, balance_tasks=True)(0).tolist() == [0, 3, 4, 1, 2]
    assert make_order(table, False, 0)(0).tolist() == [0, 3, 1, 4, 2]


def _valid_records(root, monkeypatch, *extra):
    monkeypatch.chdir(root)
    code = main(["train", "-t", "jsonl:small,jsonl:big", "-m", "bag", "-bs", "4", "-tstep", "3", "-veps", "0.02",
                 "-vme", "4", "--metrics-log", "log.jsonl", "-ltim", "-1", "--no-progress",
                 *extra])
    assert code == 0
    records = map(json.loads, (root / "log.jsonl").read_text().splitlines())
    return [r for r in records if r.get("split") == "valid"]


@pytest.mark.parametrize("extra", [[], ["-dynb", "batchsort"], ["-dynb", "full"],
                                   pytest.param(["--num-workers", "2"], marks=[pytest.mark.multiprocess,
                                                                              pytest.mark.timeout(120)])])
def test_capped_validation_scores_each_task_and_the_final_one_every_example(two_tasks, monkeypatch, extra):
    *capped, final = _valid_records(two_tasks, monkeypatch, *extra)
    counts = [(r["exs"], r["jsonl:small/exs"], r.get("jsonl:big/exs", 0)) for r in capped]
    assert counts and all(c == (4, 2, 2) for c in counts), counts
    assert (final["exs"], final["jsonl:small/exs"], final["jsonl:big/exs"]) == (35, 5, 30)
    assert np.isclose(final["accuracy"], (final["jsonl:small/accuracy"] + final["jsonl:big/accuracy"]) / 2)
