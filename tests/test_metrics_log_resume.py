"""--metrics-log across a resume: a checkpoint keeps where the log ended, and --resume cuts the log back there,
so the records of the steps trained again are not written twice."""

from __future__ import annotations

import json

from accelbatch.cli import main
from accelbatch.report_table import MetricsLog

TIMINGS = ("exs_per_s", "data_wait_share", "time_s")


def _records(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in path.read_text().splitlines()]


def test_resuming_a_finished_run_leaves_the_log_as_the_run_wrote_it(tmp_path, capsys):
    model, log = tmp_path / "m" / "model.pt", tmp_path / "m" / "log.jsonl"
    args = ["train", "-t", "babi:1", "-bs", "8", "-tstep", "12", "-veps", "-1", "--no-progress", "-ltim", "-1",
            "-mf", str(model)]
    assert main([*args, "--metrics-log", str(log)]) == 0
    written = _records(log)
    assert [(r["split"], r["step"]) for r in written] == [("train", 12), ("valid", 12), ("test", 12)]
    # the end-of-training checkpoint was saved before the final evaluations, which the resume runs again
    assert main(["train", "-mf", str(model), "--resume", "--no-progress"]) == 0
    assert "2 records written after the checkpoint removed" in capsys.readouterr().err
    assert _records(log) == written


def test_a_cut_leaves_alone_a_log_it_cannot_be_sure_of(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    path.write_text('{"a": 1}\n{"a": 2}\n{"a": 3}\n')
    saved = {"path": str(path), "bytes": len('{"a": 1}\n')}
    MetricsLog(str(tmp_path / "other.jsonl")).cut_to(saved)   # the resume writes another file
    MetricsLog(str(path)).cut_to({**saved, "bytes": 4})        # no record ends there: not the log it saved
    MetricsLog(str(path)).cut_to({**saved, "bytes": 100})      # shorter than saved: replaced meanwhile
    MetricsLog(str(path)).cut_to(None)                         # a checkpoint that kept no log
    assert path.read_text() == '{"a": 1}\n{"a": 2}\n{"a": 3}\n' and capsys.readouterr().err == ""
    MetricsLog(str(path)).cut_to(saved)
    assert path.read_text() == '{"a": 1}\n'
    assert "2 records written after the checkpoint removed" in capsys.readouterr().err
    MetricsLog(str(path)).cut_to({**saved, "bytes": 0})        # the log was empty when the checkpoint was saved
    assert path.read_text() == ""


def test_the_end_of_a_log_is_its_size_and_none_for_a_stream(tmp_path):
    log = MetricsLog(str(tmp_path / "log.jsonl"))
    assert log.end() == 0
    log.write({"split": "train"})
    assert log.end() == (tmp_path / "log.jsonl").stat().st_size > 0
    log.close()
    assert MetricsLog(None).end() is None and MetricsLog("/dev/null").end() is None
