"""-vmt TASK/metric of a file task given relative names the same task when a run continues from -mf, whose
PATH.opt keeps the task's path absolute: the continued run took the absolute spelling for the report's rows, so
the same -vmt was refused ("no such metric") and the absolute one was taken for another metric than the saved
best's (its first validation replaced the best model whatever it scored)."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main
from accelbatch.teachers import task_metric_spelled


def _write(folder, n):
    folder.mkdir(parents=True)
    for split, count in (("train", n), ("valid", 7), ("test", 5)):
        rows = [{"text": f"the colour is c{i % 3}", "labels": [f"c{i % 3}"], "label_candidates": ["c0", "c1", "c2"],
                 "episode_done": True} for i in range(count)]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


@pytest.mark.timeout(180)
def test_a_continued_run_keeps_a_relative_task_metric(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _write(tmp_path / "data" / "a", 24)
    _write(tmp_path / "data" / "b", 24)
    args = ["train", "-m", "bag", "-esz", "8", "-bs", "4", "-ne", "1", "--eval-splits", "", "--no-progress",
            "-vmt", "jsonl:data/a/accuracy", "-mf", "m/m.pt"]
    assert main([*args, "-t", "jsonl:data/a,jsonl:data/b"]) == 0
    capsys.readouterr()
    assert main(args) == 0  # the task from m/m.pt.opt, its paths absolute
    err = capsys.readouterr().err
    assert "holds a model whose validation had jsonl:data/a/accuracy" in err and "only a better one" in err, err


def test_a_task_metric_is_spelled_as_the_task_when_both_name_one_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    task = f"jsonl:{tmp_path}/data/a,babi:1"
    assert task_metric_spelled("jsonl:data/a/accuracy", task, None) == f"jsonl:{tmp_path}/data/a/accuracy"
    assert task_metric_spelled("jsonl:data/b/accuracy", task, None) == "jsonl:data/b/accuracy"  # another file
    assert task_metric_spelled("babi:1/accuracy", task, None) == "babi:1/accuracy"
    assert task_metric_spelled("accuracy", task, None) == "accuracy"
