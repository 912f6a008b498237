"""The report table and the report's JSON: every metric a split reports is a column, numbers of any size
keep their columns, and no file holds a bare NaN."""

from __future__ import annotations

import json
import math

from accelbatch.build import create_world
from accelbatch.opts import Opts
from accelbatch.report_table import format_report
from accelbatch.run import MetricsLog, run


def _columns(table: str) -> list[list[str]]:
    return [line.split() for line in table.splitlines() if line and not line.startswith("-")]


def test_every_metric_a_split_reports_is_a_column_in_parlai_order():
    report = {"train": {"exs": 40, "loss": 3.98, "ppl": 53.55, "token_acc": 0.095, "tokens": 263.0, "ltpb": 52.6,
                        "steps": 5, "epochs": 0.2, "stopped_by": "max_train_steps", "exs_per_s": 880.2,
                        "time_s": 0.045},
              "valid": {"exs": 10, "accuracy": 0.0, "f1": 0.25, "loss": 2.64, "ppl": 14.07, "time_s": 0.06},
              "device": "cpu"}
    rows = _columns(format_report(report))
    assert rows[0] == ["split", "exs", "accuracy", "f1", "loss", "ppl", "token_acc", "ltpb", "tokens", "exs_per_s",
                       "time_s"]
    assert rows[1] == ["train", "40", "3.9800", "53.5500", "0.0950", "52.6000", "263", "880.2", "0.045"]
    assert rows[2] == ["valid", "10", "0.0000", "0.2500", "2.6400", "14.0700", "0.06"]
    assert rows[3] == ["device:", "cpu"]

def test_a_multitask_split_has_a_row_per_task_and_long_names_keep_the_columns():
    report = {"valid": {"exs": 15, "accuracy": 0.75, "f1": 0.75, "jsonl:/tmp/a b/d1.jsonl/exs": 11,
                        "jsonl:/tmp/a b/d1.jsonl/accuracy": 1.0, "jsonl:/tmp/a b/d1.jsonl/f1": 1.0,
                        "parlai:p1.txt/exs": 4, "parlai:p1.txt/accuracy": 0.5, "parlai:p1.txt/f1": 0.5,
                        "time_s": 0.1},
              "train:evalmode": {"exs": 4, "accuracy": 0.25}}
    lines = format_report(report).splitlines()
    assert len({len(line) for line in lines}) == 1  # every row as wide as the header: columns aligned
    starts = [line.index("accuracy") + len("accuracy") for line in lines[:1]]
    assert [line[:starts[0]].split()[-1] for line in lines[2:]] == ["0.7500", "1.0000", "0.5000", "0.2500"]
    assert [line[:30].strip() for line in lines[2:]] == ["valid", "jsonl:/tmp/a b/d1.jsonl", "parlai:p1.txt",
                                                         "train:evalmode"]
    assert lines[3].startswith("  jsonl:") and "11" in lines[3].split()


def test_numbers_too_large_for_the_column_keep_the_table_aligned():
    report = {"train": {"exs": 8, "loss": 1.9721113202e10, "accuracy": math.nan, "time_s": 0.5}}
    header, _, row = format_report(report).splitlines()
    assert len(row) == len(header)
    assert row.split() == ["train", "8", "nan", "1.972e+10", "0.5"]


def test_report_json_and_metrics_log_hold_no_bare_nan(tmp_path):
    log = MetricsLog(str(tmp_path / "log.jsonl"))
    log.write({"split": "train", "loss": math.nan, "ppl": math.inf, "exs": 3})
    log.close()
    assert json.loads((tmp_path / "log.jsonl").read_text(), parse_constant=_refuse) == {
        "split": "train", "loss": None, "ppl": None, "exs": 3, "run": log.run}
    opts = Opts(task="babi:1", model="repeat_label", max_train_steps=2, eval_splits="", progress=False,
                validation_every_n_epochs=-1, report_json=str(tmp_path / "report.json"))
    report = run(create_world(opts), opts)
    report["train"]["loss"] = math.nan  # what a run with --skip-nan may report
    from accelbatch.report_json import write_report_json

    write_report_json(report, opts.report_json)
    assert json.loads((tmp_path / "report.json").read_text(), parse_constant=_refuse)["train"]["loss"] is None


def _refuse(name: str) -> None:
    raise AssertionError(f"bare {name} in a JSON file")


def test_the_progress_bar_is_closed_when_training_fails(monkeypatch):
    """The error line a failed run prints starts a line of its own: the bar was left open, and a killed
    hogwild process's error landed on it, the bar printing again after it."""
    import importlib

    from accelbatch.models.trivial import TrivialAgent

    run_module = importlib.import_module("accelbatch.run")  # the module (accelbatch.run is also the function)

    class Bar:
        n, total, closed = 0, None, 0

        def update(self, n):
            self.n += n

        def set_postfix(self, *args, **kwargs):
            pass

        def close(self):
            self.closed += 1

    bar = Bar()
    monkeypatch.setattr(run_module, "progress_bar", lambda opts, total: bar)

    class Fails(TrivialAgent):
        calls = 0

        def batch_act(self, observations):
            Fails.calls += 1
            if Fails.calls == 3:
                raise RuntimeError("the agent failed")
            return super().batch_act(observations)

    opts = Opts(task="babi:1", model="trivial", num_epochs=1, eval_splits="", validation_every_n_epochs=-1)
    world = create_world(opts, agent=Fails)
    try:
        run(world, opts)
    except RuntimeError:
        pass
    assert bar.n == 64 and bar.closed >= 1
