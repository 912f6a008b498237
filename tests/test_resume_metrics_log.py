"""--metrics-log across a resume: a resume started from another folder goes on writing the stopped run's
--metrics-log and --report-json, not new files of the same relative names there; a checkpoint keeps where the log
ended, and --resume cuts the log back there, so the records of the steps trained again are not written twice."""

from __future__ import annotations

import json

import pytest
from test_resume_model_opts import STEPS, _opts, _signalling_bag

from accelbatch.cli import main
from accelbatch.report_table import MetricsLog


@pytest.mark.timeout(180)
def test_a_resume_from_another_folder_appends_to_the_runs_own_log(tmp_path, monkeypatch):
    from accelbatch.build import create_world
    from accelbatch.run import run

    first, other = tmp_path / "first", tmp_path / "other"
    first.mkdir()
    other.mkdir()
    monkeypatch.chdir(first)
    opts = _opts(first / "m.pt").replace(metrics_log="log.jsonl", report_json="report.json", log_every_n_secs=0)
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(opts, agent=_signalling_bag()), opts)
    before = len((first / "log.jsonl").read_text().splitlines())
    monkeypatch.chdir(other)
    assert main(["train", "-mf", str(first / "m.pt"), "--resume", "--no-progress"]) == 0
    assert not (other / "log.jsonl").exists() and not (other / "report.json").exists()
    assert json.loads((first / "report.json").read_text())["train"]["steps"] == STEPS
    records = [json.loads(line) for line in (first / "log.jsonl").read_text().splitlines()]
    assert len(records) > before
    assert max(r["step"] for r in records if r["split"] == "train") == STEPS  # the whole run, in one file


TIMINGS = ("exs_per_s", "data_wait_share", "time_s")


def _records(path):
    return [{k: v for k, v in json.loads(line).items() if k not in TIMINGS}
            for line in path.read_text().splitlines()]


def test_resuming_a_finished_run_leaves_the_log_as_the_run_wrote_it(tmp_path, capsys):
    pytest.importorskip("tensorboard")
    model, log = tmp_path / "m" / "model.pt", tmp_path / "m" / "log.jsonl"
    args = ["train", "-t", "babi:1", "-bs", "8", "-tstep", "12", "-veps", "-1", "--no-progress", "-ltim", "-1",
            "-mf", str(model)]
    board = tmp_path / "m" / "tb"
    assert main([*args, "--metrics-log", str(log), "--tensorboard-logdir", str(board)]) == 0
    written, scalars = _records(log), _board(board)
    assert [(r["split"], r["step"]) for r in written] == [("train", 12), ("valid", 12), ("test", 12)]
    # the end-of-training checkpoint was saved before the final evaluations, which the resume runs again
    assert main(["train", "-mf", str(model), "--resume", "--no-progress"]) == 0
    assert "2 records written after the checkpoint removed" in capsys.readouterr().err
    assert _records(log) == written
    assert _board(board) == scalars and scalars["valid_final/accuracy"] == [(12, written[1]["accuracy"])]


def _board(folder):
    """TensorBoard's scalars in ``folder`` as TensorBoard shows them: {tag: [(step, value)]}, timings left out."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return {tag: [(e.step, round(e.value, 6)) for e in events.Scalars(tag)] for tag in events.Tags()["scalars"]
            if tag.split("/")[1] not in TIMINGS}


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


def test_a_cut_removes_only_the_resumed_runs_records_from_a_shared_log(tmp_path, capsys):
    path = tmp_path / "log.jsonl"
    lines = ['{"run": "a", "step": 1}\n', '{"run": "a", "step": 2}\n', '{"run": "b", "step": 1}\n',
             '{"run": "a", "step": 3}\n', '{"run": "b", "step": 2}\n', '{"run": "a", "st']  # a's torn last write
    path.write_text("".join(lines))
    log = MetricsLog(str(path))
    log.cut_to({"path": str(path), "bytes": len(lines[0]), "run": "a"})
    assert path.read_text() == lines[0] + lines[2] + lines[4] and log.run == "a"  # goes on as run a
    assert "3 records written after the checkpoint removed (this run writes them again); 2 of other runs after " \
           "it kept" in capsys.readouterr().err
    path.write_text("".join(lines[:3]))  # a checkpoint of a log whose records had no run name: all after it go
    MetricsLog(str(path)).cut_to({"path": str(path), "bytes": len(lines[0])})
    assert path.read_text() == lines[0]


@pytest.mark.timeout(180)
def test_a_resume_keeps_another_runs_records_in_the_log_they_share(tmp_path, capsys):
    from accelbatch.build import create_world
    from accelbatch.run import run

    log = tmp_path / "log.jsonl"
    opts = _opts(tmp_path / "m.pt").replace(metrics_log=str(log), log_every_n_secs=0)
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(opts, agent=_signalling_bag()), opts)
    stopped = [json.loads(line) for line in log.read_text().splitlines()]
    other = MetricsLog(str(log))  # another run writing the same log meanwhile
    for step in (1, 2):
        other.write({"split": "train", "step": step})
    other.close()
    assert main(["train", "-mf", str(tmp_path / "m.pt"), "--resume", "--no-progress"]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records if r["run"] == other.run] == [1, 2]
    ours = [r for r in records if r["run"] != other.run]
    assert {r["run"] for r in ours} == {stopped[0]["run"]}  # the resumed run goes on under its name
    assert max(r["step"] for r in ours if r["split"] == "train") == STEPS
