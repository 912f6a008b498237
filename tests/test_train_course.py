"""The course of a training over time and validations, as ParlAI's TrainLoop runs it: -vtim counts training
time since the last validation ended; a run out of -ttim stops before a timed validation; a resume of a run
whose training ended (by -ttim, patience or -vcut) only evaluates; a resume judging by another -vmt starts the
best afresh; a -vtim validation cut short by a stop runs again first thing on --resume."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time

import pytest
import torch

from accelbatch.cli import main
from accelbatch.models.bag import BagAgent

QUIET = ["--no-progress", "--eval-splits", ""]
BASE = ["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-bs", "32"]


def _records(log):
    return [json.loads(line) for line in log.read_text().splitlines()]


def _validations(log):
    """The steps of the validations in a metrics log (not the final evaluations)."""
    return [r["step"] for r in _records(log) if r["split"] == "valid" and not r.get("final")]


def _digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _slowed(monkeypatch, train_s: float, eval_s: float) -> None:
    """Every bag batch takes at least ``train_s`` in training and ``eval_s`` in a validation."""
    batch_act = BagAgent.batch_act

    def slow_batch_act(self, observations):
        evaluating = any("eval_labels" in o for o in observations if o)
        time.sleep(eval_s if evaluating else train_s)
        return batch_act(self, observations)

    monkeypatch.setattr(BagAgent, "batch_act", slow_batch_act)


def test_a_timed_validation_waits_for_training_time_since_the_last_one_ended(tmp_path, monkeypatch):
    """A validation (0.3 s) longer than -vtim 0.2 ran after every step, training starved; now each waits for
    0.2 s of training: 4 steps of 0.05 s on a quiet machine, never fewer than 2 unless one step alone took the
    0.2 s (a loaded machine stretches steps, so 4 is not a bound)."""
    _slowed(monkeypatch, train_s=0.05, eval_s=0.3)
    log = tmp_path / "log.jsonl"
    assert main([*BASE, "-tstep", "12", "-vtim", "0.2", "-veps", "-1", "-vme", "64", "--metrics-log", str(log),
                 *QUIET]) == 0
    steps = _validations(log)
    assert steps and all(b - a >= 2 for a, b in zip([0, *steps], steps)), steps


def test_a_run_out_of_time_stops_before_a_timed_validation(tmp_path, monkeypatch):
    """-ttim and -vtim both due at a step: ParlAI stops (the time is up) without validating first."""
    _slowed(monkeypatch, train_s=0.05, eval_s=0.0)
    log, report = tmp_path / "log.jsonl", tmp_path / "r.json"
    assert main([*BASE, "-ttim", "0.3", "-vtim", "0.3", "-veps", "-1", "--metrics-log", str(log),
                 "--report-json", str(report), *QUIET]) == 0
    assert _validations(log) == []
    assert json.loads(report.read_text())["train"]["stopped_by"] == "max_train_time"


@pytest.mark.parametrize("limits, stopped_by", [
    (["-ne", "0.5", "-veps", "0.125", "-vmt", "loss", "-vmm", "max", "-vp", "1"], "validation"),  # patience
    (["-ne", "0.5", "-veps", "0.125", "-vcut", "0"], "validation"),  # any accuracy reaches the cutoff 0
    (["-ne", "1", "-veps", "-1", "-ttim", "0.0001"], "max_train_time"),
])
def test_a_resume_of_a_run_whose_training_ended_only_evaluates(limits, stopped_by, tmp_path, capsys):
    model, report = tmp_path / "m.pt", tmp_path / "r.json"
    assert main([*BASE, *limits, "-mf", str(model), "--report-json", str(report), *QUIET]) == 0
    ended = json.loads(report.read_text())["train"]
    assert ended["stopped_by"] == stopped_by and ended["steps"] < 79, ended  # before -ne's end (79 steps)
    weights = _digest(model)
    assert main(["train", "-mf", str(model), "--resume", "--report-json", str(report), *QUIET]) == 0, \
        capsys.readouterr().err
    resumed = json.loads(report.read_text())["train"]
    assert (resumed["steps"], resumed["stopped_by"]) == (ended["steps"], stopped_by)  # it trained on
    assert _digest(model) == weights


@pytest.mark.parametrize("limits, again, says", [
    (["-vmt", "loss", "-vmm", "max", "-vp", "1"], ["-vp", "3"], "patience: 1 validations without improvement; "
                                                                "a -vp above 1 trains on"),
    (["-vcut", "0"], ["-vcut", "2"], "-vcut 0 met by accuracy"),
], ids=["patience", "cutoff"])
def test_a_resume_given_more_patience_or_another_cutoff_trains_on(limits, again, says, tmp_path, capsys):
    """A run ended by patience (or -vcut): a resume with the same options says what would go on and only
    evaluates; one given a -vp above its validations without improvement (a -vcut not met) trains on to -ne,
    as ParlAI's impatience kept in .trainstats lets a larger -vp go on (it said 'patience and -vcut do not')."""
    model, report = tmp_path / "m.pt", tmp_path / "r.json"
    base = [*BASE, "-ne", "0.5", "-veps", "0.125", "-mf", str(model), "--report-json", str(report), *QUIET]
    assert main([*base, *limits]) == 0
    ended = json.loads(report.read_text())["train"]
    assert ended["stopped_by"] == "validation", ended
    capsys.readouterr()
    assert main(["train", "-mf", str(model), "--resume", "--report-json", str(report), *QUIET]) == 0
    assert says in capsys.readouterr().err and json.loads(report.read_text())["train"]["steps"] == ended["steps"]
    assert main(["train", "-mf", str(model), "--resume", *again, "--report-json", str(report), *QUIET]) == 0
    resumed = json.loads(report.read_text())["train"]
    assert resumed["steps"] > ended["steps"], (ended, resumed)


def test_a_resume_judging_by_another_metric_does_not_read_the_cutoff_off_the_old_one(tmp_path, capsys):
    """Stopped by -vcut 0 on accuracy (0.24 at step 20): a resume with -vmt loss -vcut 1 said '-vcut 1 met by loss
    0.24' (the accuracy) and only evaluated; judged by another metric, it trains on, as the README says."""
    model, report = tmp_path / "m.pt", tmp_path / "r.json"
    assert main([*BASE, "-ne", "0.5", "-veps", "0.125", "-vcut", "0", "-mf", str(model), "--report-json", str(report),
                 *QUIET]) == 0
    ended = json.loads(report.read_text())["train"]["steps"]
    capsys.readouterr()
    assert main(["train", "-mf", str(model), "--resume", "-vmt", "loss", "-vcut", "1", "--report-json",
                 str(report), *QUIET]) == 0
    err = capsys.readouterr().err
    assert "sets the best afresh" in err and "met by" not in err, err
    assert json.loads(report.read_text())["train"]["steps"] > ended


def test_a_checkpoint_that_kept_no_validation_value_keeps_its_cutoff_end():
    """Checkpoints written before the last validation's value was kept: a -vcut end stands (it trained on)."""
    from accelbatch.best_valid import validation_ends
    from accelbatch.opts import Opts
    from accelbatch.train_state import TrainState

    state = TrainState(judged_by="accuracy max")
    state.load_json({"steps": 20, "exs": 640, "validations": 2, "best": 0.3, "stale": 0, "elapsed_s": 1.0,
                     "judged_by": "accuracy max", "ended_by": "validation"})
    assert state.last_valid is None
    assert validation_ends(Opts(validation_cutoff=0.2), state).startswith("-vcut 0.2 (the checkpoint keeps no")
    assert validation_ends(Opts(), state) is None  # no -vcut: only patience, whose count it kept, decides


def _stopped_after_the_first_validation(model, log, monkeypatch, in_validation: bool) -> None:
    """A run of -vtim validations stopped by a SIGINT (a terminal's Ctrl-C) during its first validation, or at
    the second training batch after it."""
    batch_act, seen = BagAgent.batch_act, {"validated": False, "after": 0}

    def signalling_batch_act(self, observations):
        evaluating = any("eval_labels" in o for o in observations if o)
        seen["validated"] |= evaluating
        seen["after"] += seen["validated"] and not evaluating
        if (evaluating and in_validation) or seen["after"] == 2:
            os.kill(os.getpid(), signal.SIGINT)
            seen["validated"], seen["after"] = False, -10 ** 9  # once
        return batch_act(self, observations)

    monkeypatch.setattr(BagAgent, "batch_act", signalling_batch_act)
    assert main([*BASE, "-tstep", "30", "-vtim", "0.0001", "-veps", "-1", "-vme", "64", "-mf", str(model),
                 "--metrics-log", str(log), *QUIET]) == 130
    monkeypatch.undo()


def test_a_timed_validation_cut_short_runs_again_first_on_resume(tmp_path, monkeypatch, capsys):
    model, log = tmp_path / "m.pt", tmp_path / "log.jsonl"
    _stopped_after_the_first_validation(model, log, monkeypatch, in_validation=True)
    assert "the validation was cut short (a resume runs it again)" in capsys.readouterr().err
    assert _validations(log) == []
    assert main(["train", "-mf", str(model), "--resume", "-vtim", "1000", *QUIET]) == 0, capsys.readouterr().err
    assert _validations(log)[0] == 1  # the validation due after step 1, before step 2


def test_a_resume_judging_by_another_metric_starts_the_best_afresh(tmp_path, monkeypatch, capsys):
    model, log = tmp_path / "m.pt", tmp_path / "log.jsonl"
    _stopped_after_the_first_validation(model, log, monkeypatch, in_validation=False)
    assert json.loads((tmp_path / "m.pt.trainstats").read_text())["metric"] == "accuracy"
    capsys.readouterr()
    assert main(["train", "-mf", str(model), "--resume", "-vmt", "loss", "-tstep", "4", *QUIET]) == 0
    assert "--resume: the best validation so far was judged by -vmt/-vmm accuracy max, this run judges by loss " \
           "min: its next validation sets the best afresh (and saves -mf)" in capsys.readouterr().err
    last = [r for r in _records(log) if r["split"] == "valid"][-1]  # the resumed run's one validation
    assert json.loads((tmp_path / "m.pt.trainstats").read_text()) == {"metric": "loss", "mode": "min",
                                                                      "value": last["loss"]}


def test_the_train_speed_leaves_out_the_validations(tmp_path, monkeypatch):
    """Steps of at least 0.05 s of 32 examples train at most 640 examples/s; validations of 0.2 s each inside
    the window took a train record's, and the report's, to a third of that."""
    _slowed(monkeypatch, train_s=0.05, eval_s=0.2)
    log, report = tmp_path / "log.jsonl", tmp_path / "r.json"
    assert main([*BASE, "-tstep", "6", "-veps", "0.0001", "-vme", "32", "--metrics-log", str(log),
                 "--report-json", str(report), *QUIET]) == 0
    assert len(_validations(log)) >= 5
    (train,) = [r for r in _records(log) if r["split"] == "train"]
    assert 0.4 * 640 < train["exs_per_s"] <= 640, train  # with the validations: about 128
    ran = json.loads(report.read_text())["train"]   # the report's row too, its time_s the whole run's
    assert ran["exs"] == 6 * 32 and 0.4 * 640 < ran["exs_per_s"] <= 640 and ran["time_s"] >= 5 * 0.2 + 6 * 0.05, ran


def test_a_resume_of_an_ended_run_says_it_only_evaluates_and_a_later_limit_trains_on(tmp_path, capsys):
    model, report = tmp_path / "m.pt", tmp_path / "r.json"
    patience = ["-ne", "0.5", "-veps", "0.125", "-vmt", "loss", "-vmm", "max", "-vp", "1"]
    assert main([*BASE, *patience, "-mf", str(model), "--report-json", str(report), *QUIET]) == 0
    ended = json.loads(report.read_text())["train"]["steps"]
    capsys.readouterr()
    assert main(["train", "-mf", str(model), "--resume", "-ne", "5", *QUIET]) == 0  # no end of a patience stop
    err = capsys.readouterr().err
    assert "accelbatch: --resume: the training ended (validation; patience: 1 validations without improvement; " \
           "a -vp above 1 trains on): only evaluating" in err and "afresh" not in err, err
    # judged by another -vmt, the patience counts afresh: it trains on, saying so
    assert main(["train", "-mf", str(model), "--resume", "-vmt", "accuracy", "--report-json", str(report),
                 *QUIET]) == 0
    assert "sets the best afresh" in capsys.readouterr().err
    assert json.loads(report.read_text())["train"]["steps"] > ended
    timed = tmp_path / "t.pt"
    assert main([*BASE, "-ttim", "0.0001", "-mf", str(timed), *QUIET]) == 0
    assert main(["train", "-mf", str(timed), "--resume", "-ttim", "-1", "-tstep", "5", "--report-json",
                 str(report), *QUIET]) == 0
    assert json.loads(report.read_text())["train"]["steps"] == 5  # a later end: trained on to it


def test_a_validation_due_at_the_last_step_runs_whether_ne_or_tstep_ends_the_run(tmp_path, write_jsonl):
    """-tstep 20 and -ne 2 train the same 20 steps of 4 rows over 40 examples: both validate at steps 10 and 20
    and keep the same model (-tstep skipped the validation due at its last step, so -mf held step 10's)."""
    task = "jsonl:" + write_jsonl([{"text": f"say {w} please", "labels": [w], "episode_done": True,
                                    "label_candidates": ["red", "blue", "cat", "dog", "green", "cow"]}
                                   for w in ["red", "blue", "cat", "dog", "green"] * 8])
    made = {}
    for name, limit in (("ne", ["-ne", "2"]), ("tstep", ["-ne", "10", "-tstep", "20"])):
        log, model = tmp_path / f"{name}.jsonl", tmp_path / name / "m.pt"
        assert main(["train", "-t", task, "-m", "bag", "-esz", "8", "-bs", "4", *limit, "-mf", str(model),
                     "--metrics-log", str(log), *QUIET]) == 0
        assert _validations(log) == [10, 20], name
        made[name] = torch.load(model, map_location="cpu", weights_only=True)["model"]
    assert all(torch.equal(made["ne"][k], made["tstep"][k]) for k in made["ne"])


def test_a_resume_on_a_data_file_changed_since_says_the_data_changed(tmp_path, write_jsonl, capsys):
    """A line appended to the data before --resume: refused blaming --seed, -bs, -di, -ga, -rf and -nt alike."""
    rows = [{"text": f"say {w}", "labels": [w], "label_candidates": ["red", "blue"], "episode_done": True}
            for w in ["red", "blue"] * 8]
    data, model = write_jsonl(rows), tmp_path / "m.pt"
    args = ["train", "-t", f"jsonl:{data}", "-m", "bag", "-esz", "8", "-bs", "2", "-mf", str(model), *QUIET]
    assert main([*args, "-tstep", "2"]) == 0
    with open(data, "a", encoding="utf-8") as handle:
        handle.write(json.dumps(rows[0]) + "\n")
    capsys.readouterr()
    assert main([*args, "-tstep", "4", "--resume"]) == 2
    err = capsys.readouterr().err
    assert "taken on other data: other episodes or turns (a data file changed since the checkpoint" in err, err
