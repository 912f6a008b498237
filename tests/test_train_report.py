"""The report's train row and the metrics log: functions of the data and the seed, not of the clock."""

from __future__ import annotations

import json
import runpy

import pytest

ARGS = ["--no-progress", "-tstep", "20", "-bs", "8", "--eval-splits", "", "-veps", "-1"]


@pytest.fixture(scope="module")
def example():
    return runpy.run_path("examples/custom_agent.py", run_name="example")["main"]


def test_train_row_covers_every_example_whatever_the_log_interval(example):
    every_step = example(ARGS + ["-ltim", "0"])["train"]
    never = example(ARGS + ["-ltim", "1000"])["train"]
    assert every_step["exs"] == never["exs"] == 20 * 8
    for key in ("loss", "accuracy", "f1"):
        assert every_step[key] == pytest.approx(never[key], abs=1e-9), key


def test_log_interval_minus_one_logs_the_train_row_only_at_the_end(example, tmp_path):
    """-ltim -1: no record during training, one at the end holding every example; -ltim 0: one per step."""
    records = {}
    for interval in ("-1", "0"):
        path = tmp_path / f"log{interval}.jsonl"
        example(ARGS + ["-ltim", interval, "--metrics-log", str(path)])
        records[interval] = [r for r in map(json.loads, path.read_text().splitlines()) if r["split"] == "train"]
    assert [(r["step"], r["exs"]) for r in records["-1"]] == [(20, 20 * 8)]
    assert [(r["step"], r["exs"]) for r in records["0"]] == [(step, 8) for step in range(1, 21)]


@pytest.mark.parametrize("plan", [["-ga", "4"], ["-di", "2", "-ga", "2"]], ids=["ga4", "di2-ga2"])
def test_train_row_is_the_same_on_cpu_and_emulated_ipu(example, plan):
    """Same plan, same numbers: each backend reports the loss of the micro-batches the output mode returns."""
    cpu = example(ARGS + plan)
    ipu = example(ARGS + plan + ["--device", "ipu", "--ipu-emulator"])
    assert cpu["train"]["exs"] == ipu["train"]["exs"]
    assert ipu["train"]["loss"] == pytest.approx(cpu["train"]["loss"], rel=1e-5)
    assert ipu["train"]["accuracy"] == cpu["train"]["accuracy"]


def test_metrics_log_places_every_record_and_logs_the_last_train_window(example, tmp_path):
    path = tmp_path / "metrics.jsonl"
    report = example(["--no-progress", "-tstep", "30", "-bs", "8", "-ltim", "1000", "-veps", "0.01",
                      "--eval-splits", "valid,test", "--metrics-log", str(path)])
    records = [json.loads(line) for line in path.read_text().splitlines()]
    train = [r for r in records if r["split"] == "train"]
    evals = [r for r in records if r["split"] != "train"]
    # -ltim 1000: no window closed during training; the examples since the start are logged at the end
    assert [r["exs"] for r in train] == [report["train"]["exs"]] == [30 * 8]
    assert all("step" in r and "epoch" in r for r in records)
    during = [r for r in evals if not r.get("final")]
    final = [r for r in evals if r.get("final")]
    assert len(during) >= 2 and all(r["split"] == "valid" for r in during)
    assert [r["step"] for r in during] == sorted(r["step"] for r in during) and during[0]["step"] < 30
    assert [r["split"] for r in final] == ["valid", "test"] and all(r["step"] == 30 for r in final)
    assert final[1]["exs"] == report["test"]["exs"]


@pytest.mark.parametrize("options", [[], pytest.param(["--num-workers", "1"], marks=pytest.mark.multiprocess),
                                     ["--dynamic-batching", "full"]], ids=["clones", "loader", "dynamic"])
def test_display_examples_prints_every_row_of_a_batched_step(options, capsys, tmp_path):
    from accelbatch.cli import main

    rc = main(["train", "-t", "babi:1", "-m", "memnn", "-bs", "3", "-tstep", "2", "--display-examples",
               "--no-progress", "--eval-splits", "", "-veps", "-1", "--report-json", str(tmp_path / "r.json"),
               *options])
    out = capsys.readouterr().out
    trained = json.loads((tmp_path / "r.json").read_text())["train"]["exs"]
    assert rc == 0 and trained >= 2
    assert out.count("  (labels: ") == trained  # every example of the two steps, with its labels
    assert out.count("[MemNNAgent]: ") == trained  # and the model's reply to it
