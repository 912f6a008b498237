"""A --resume started from another folder goes on writing the stopped run's --metrics-log and --report-json,
not new files of the same relative names there."""

from __future__ import annotations

import json

import pytest
from test_resume_model_opts import STEPS, _opts, _signalling_bag

from accelbatch.cli import main


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
