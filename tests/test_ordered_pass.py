"""An ordered training pass whose episodes do not fill its last steps: what this run cannot train as one
process would is refused in one line before the first step (replica processes trained 16 examples of 14,
starting the next pass early; a plan that cannot lay a partial step out failed after the whole pass)."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main
from accelbatch.data.episodes import EpisodeTable
from accelbatch.opts import Opts
from accelbatch.ordered_pass import partial_steps, reached

QUIET = ["--no-progress", "--eval-splits", "", "-veps", "-1", "-ne", "1", "-dt", "train:ordered"]


def _rows(path, count: int) -> str:
    with open(path, "w") as f:
        for i in range(count):
            f.write(json.dumps({"text": f"q {i}", "labels": [f"a {i % 2}"], "label_candidates": ["a 0", "a 1"],
                                "episode_done": True}) + "\n")
    return f"jsonl:{path}"


def test_partial_steps_are_where_some_rows_have_served_their_part():
    # 14 one-turn episodes dealt to 4 rows in turn: rows 0, 1 serve 4, rows 2, 3 serve 3
    table = EpisodeTable.of_lengths([1] * 14)
    steps = partial_steps(table, 4, seed=0)
    assert [(step, real.tolist()) for step, real in steps] == [(3, [0, 1])]
    assert partial_steps(EpisodeTable.of_lengths([1] * 16), 4, seed=0) == []
    # episodes of 2, 1, 3 turns over 2 rows: row 0 serves 2 + 3 turns, row 1 serves 1 turn
    uneven = partial_steps(EpisodeTable.of_lengths([2, 1, 3]), 2, seed=0)
    assert [(step, real.tolist()) for step, real in uneven] == [(1, [0]), (2, [0]), (3, [0]), (4, [0])]


def test_only_the_partial_steps_the_run_reaches_are_checked():
    # 13 one-turn episodes over 6 rows: steps 0, 1 full (12 examples), step 2 holds 1 row
    steps = partial_steps(EpisodeTable.of_lengths([1] * 13), 6, seed=0)
    assert [step for step, _ in steps] == [2]
    assert reached(Opts(max_train_steps=2), steps, 6, 13) == []  # stops after step 2 of the pass
    assert len(reached(Opts(max_train_steps=3), steps, 6, 13)) == 1
    assert reached(Opts(num_epochs=12 / 13), steps, 6, 13) == []  # 12 examples: the full steps only
    assert len(reached(Opts(num_epochs=0.95), steps, 6, 13)) == 1  # 12.35 examples: step 2 runs
    assert len(reached(Opts(num_epochs=-1, max_train_steps=-1), steps, 6, 13)) == 1


def _err_lines(capfd) -> list[str]:
    return [line for line in capfd.readouterr().err.splitlines() if line.strip()]


@pytest.mark.timeout(120)
def test_a_step_the_plan_cannot_lay_out_is_refused_before_training_naming_no_drop_last(tmp_path, capfd):
    task = _rows(tmp_path / "d13.jsonl", 13)
    model = tmp_path / "m.pt"
    args = ["train", "-t", task, "-m", "bag", "-bs", "2", "-ga", "3", *QUIET]
    assert main([*args, "-mf", str(model)]) == 2
    err = _err_lines(capfd)
    assert len(err) == 1 and "a step of 1 rows (step 3)" in err[0] and "add --no-drop-last" in err[0], err
    assert not model.exists()  # refused before any step, not after the pass
    report = tmp_path / "r.json"
    assert main([*args, "--no-drop-last", "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["train"]["exs"] == 13  # the tail trains
    for limit in (["-tstep", "2"], ["-ne", "0.4"]):  # a run that stops before the partial step needs no check
        assert main([*args, *limit, "--report-json", str(report)]) == 0
        assert json.loads(report.read_text())["train"]["exs"] == (12 if limit[0] == "-tstep" else 6)


@pytest.mark.timeout(120)
def test_a_partial_step_on_the_ipu_is_refused_before_training(tmp_path, capfd):
    task = _rows(tmp_path / "d13.jsonl", 13)
    for drop in ("--drop-last", "--no-drop-last"):
        assert main(["train", "-t", task, "-m", "bag", "-bs", "2", "-ga", "3", *QUIET, drop, "--device", "ipu",
                     "--ipu-emulator"]) == 2
        err = _err_lines(capfd)
        assert len(err) == 1 and "-dt train:ordered" in err[0] and "train shuffled (-dt train" in err[0], err


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
def test_replica_processes_refuse_a_pass_whose_last_step_they_hold_unevenly(tmp_path, capfd):
    uneven = _rows(tmp_path / "d14.jsonl", 14)
    assert main(["train", "-t", uneven, "-m", "repeat_label", "-bs", "2", "-rf", "2", *QUIET]) == 2
    err = _err_lines(capfd)
    assert len(err) == 1 and "replica process 0 holds rows [0, 1] where one process gives it [0]" in err[0], err
    nine = _rows(tmp_path / "d9.jsonl", 9)  # 6 rows: step 2 holds rows 0-2, all replica 0's
    assert main(["train", "-t", nine, "-m", "repeat_label", "-bs", "3", "-rf", "2", *QUIET]) == 2
    err = _err_lines(capfd)
    assert len(err) == 1 and "--no-drop-last" not in err[0], err  # replica processes: it would not help
    assert main(["train", "-t", nine, "-m", "repeat_label", "-bs", "3", "-rf", "2", "--no-drop-last", *QUIET]) == 2
    err = _err_lines(capfd)
    assert len(err) == 1 and "a step of 3 rows (step 2) of which replica 1 holds none" in err[0], err
    twelve = _rows(tmp_path / "d12.jsonl", 12)  # 8 rows (-bs 2 -di 2 -rf 2): step 2 holds rows 0-3
    assert main(["train", "-t", twelve, "-m", "repeat_label", "-bs", "2", "-di", "2", "-rf", "2", *QUIET]) == 2
    err = _err_lines(capfd)  # 2 rows each, as the plan gives, but not the rows one process gives each replica
    assert len(err) == 1 and "replica process 0 holds rows [0, 1] where one process gives it [0, 2]" in err[0], err
    seven = _rows(tmp_path / "d7.jsonl", 7)  # 4 rows: step 2 holds 3, laid out as one process's, 2 and 1 (the
    # replicas counted the pass apart and ended it at other steps: a gloo abort, or a hang to the timeout)
    assert main(["train", "-t", seven, "-m", "repeat_label", "-bs", "2", "-rf", "2", "--no-drop-last", *QUIET]) == 2
    err = _err_lines(capfd)
    assert len(err) == 1 and "a step of 3 rows (step 2) that the replica processes hold unevenly (2 and 1 rows)" \
        in err[0], err
    even, report = _rows(tmp_path / "d16.jsonl", 16), tmp_path / "r.json"
    assert main(["train", "-t", even, "-m", "repeat_label", "-bs", "2", "-rf", "2", *QUIET,
                 "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["train"]["exs"] == 16  # one pass: each example once


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_hogwild_processes_train_their_own_share_s_partial_step(tmp_path, capfd):
    """14 episodes over 4 rows end with a 2-row step, which D = 2 lays out; each of 2 processes serves 7,
    ending with 3 rows, which it trains as a tail, --drop-last or not (it was refused before training): 14
    examples, each once."""
    task, report = _rows(tmp_path / "d14.jsonl", 14), tmp_path / "r.json"
    assert main(["train", "-t", task, "-m", "bag", "-bs", "2", "-di", "2", *QUIET, "-tstep", "-1"]) == 0
    assert main(["train", "-t", task, "-m", "bag", "-bs", "2", "-di", "2", "-nt", "2", *QUIET,
                 "--report-json", str(report)]) == 0
    train = json.loads(report.read_text())["train"]
    assert (train["exs"], train["epochs"]) == (14, 1.0)
    assert not any("error" in line for line in _err_lines(capfd))
