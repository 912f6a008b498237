"""accelbatch report (plots.py) and the TensorBoard scalars writer (tensorboard_log.py)."""

from __future__ import annotations

import json
import os
import sys

import pytest

from accelbatch import plots
from accelbatch.plots import MetricsLogError, MissingDependency
from accelbatch.tensorboard_log import TensorBoardLog


def _records(steps=20, restart_at=None):
    out = []
    for step in range(1, steps + 1):
        logged = step if restart_at is None or step < restart_at else step - restart_at // 2
        out.append({"split": "train", "step": logged, "epoch": step / 10, "exs_per_s": 1000.0 + 10 * step,
                    "loss": 2.0 / step, "accuracy": 1 - 1.0 / step, "exs": 32})
        if step % 5 == 0:
            out.append({"split": "valid", "exs": 100, "time_s": 0.5, "loss": 2.5 / step, "accuracy": 0.5})
    out.append({"split": "test", "exs": 100, "time_s": 0.25, "loss": 0.2, "accuracy": 0.9,
                "stopped_by": "num_epochs"})
    return out


def _write(path, records, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + tail, encoding="utf-8")
    return path


def test_series_places_reports_at_the_last_train_step_and_derives_throughput():
    data = plots.series(_records(10))
    assert data[("valid", "loss")] == [[(5.0, 0.5), (10.0, 0.25)]]
    assert data[("valid", "exs_per_s")] == [[(5.0, 200.0), (10.0, 200.0)]]
    assert data[("test", "exs_per_s")] == [[(10.0, 400.0)]]
    assert [len(s) for s in data[("train", "loss")]] == [10]


def test_the_final_evaluations_are_points_of_their_own():
    """The best model's valid record after training (an earlier step's model) ended the valid line at the last
    step, a drop the model there never scored."""
    records = [{"split": "train", "step": 5, "loss": 1.0}, {"split": "valid", "loss": 0.5},
               {"split": "train", "step": 10, "loss": 0.9}, {"split": "valid", "loss": 0.7},
               {"split": "valid", "loss": 0.5, "final": True}, {"split": "test", "loss": 0.6, "final": True}]
    data = plots.series(records)
    assert data[("valid", "loss")] == [[(5.0, 0.5), (10.0, 0.7)]]
    assert data[("valid (final)", "loss")] == [[(10.0, 0.5)]] and data[("test", "loss")] == [[(10.0, 0.6)]]


def test_a_file_that_is_no_metrics_log_is_one_line(tmp_path):
    """A report JSON or TensorBoard events file gave pages of per-line errors and 'fix or delete these lines'."""
    report = tmp_path / "r.json"
    report.write_text(json.dumps({"train": {"exs": 4}}, indent=2), encoding="utf-8")
    events = tmp_path / "events.out.tfevents.1"
    events.write_bytes(bytes(range(256)) * 40)
    for path in (report, events):
        with pytest.raises(MetricsLogError) as info:
            plots.read_metrics(path, warn=pytest.fail)
        text = str(info.value)
        assert text.count("\n") == 0 and text.startswith(f"{path}: not a metrics log: none of its lines") \
            and "Fix or delete" not in text, text


def test_a_restart_starts_a_new_segment():
    data = plots.series(_records(10, restart_at=6))
    assert [s[0][0] for s in data[("train", "loss")]] == [1.0, 3.0]


def test_runs_sharing_a_log_are_a_line_each_however_their_records_interleave():
    records = [{"split": "train", "step": s, "loss": loss, "run": run}
               for s, loss, run in [(1, 3.0, "a"), (1, 9.0, "b"), (2, 2.0, "a"), (2, 8.0, "b"), (3, 1.0, "a")]]
    assert plots.series(records)[("train", "loss")] == [[(1, 3.0), (2, 2.0), (3, 1.0)], [(1, 9.0), (2, 8.0)]]
    records.append({"split": "valid", "accuracy": 0.5, "run": "b"})  # no step: at run b's last, not a's 3
    assert plots.series(records)[("valid", "accuracy")] == [[(2, 0.5)]]


def test_plot_run_writes_a_png(tmp_path):
    matplotlib = pytest.importorskip("matplotlib")
    _write(tmp_path / "metrics.jsonl", _records())
    png = plots.plot_run(tmp_path)
    assert png == str(tmp_path / "metrics.png")
    with open(png, "rb") as handle:
        assert handle.read(8) == b"\x89PNG\r\n\x1a\n"
    import matplotlib.image

    height, width = matplotlib.image.imread(png).shape[:2]
    assert width >= 600 and height >= 600  # three panels: loss, examples/s, accuracy
    assert matplotlib.get_backend()  # untouched global state is still usable
    out = plots.plot_run(tmp_path / "metrics.jsonl", tmp_path / "sub" / "curves.png")
    assert out == str(tmp_path / "sub" / "curves.png")


def test_malformed_line_is_reported_with_file_and_line(tmp_path):
    log = tmp_path / "run.jsonl"
    lines = [json.dumps(r) for r in _records(3)]
    lines[1] = '{"split": "train", "step": 2, "loss": '
    lines[2] = "[1, 2]"
    lines.append('{"split": 1, "step": 4}')
    log.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(MetricsLogError) as info:
        plots.read_metrics(tmp_path)
    text = str(info.value)
    assert f"{log}:2: not valid JSON" in text and f"{log}:3: expected a JSON object, got list" in text
    assert f"{log}:{len(lines)}: the record's 'split' is 1, not a split's name" in text
    assert "--skip-bad" in text
    warnings = []
    records = plots.read_metrics(log, skip_bad=True, warn=warnings.append)
    assert len(records) == len(lines) - 3 and len(warnings) == 3 and f"{log}:2: skipped" in warnings[0]


def test_an_unfinished_last_line_is_skipped_with_a_notice(tmp_path):
    log = _write(tmp_path / "metrics.jsonl", _records(3), tail='{"split": "train", "st')
    warnings = []
    records = plots.read_metrics(log, warn=warnings.append)
    assert len(records) == len(_records(3)) and "unfinished last line" in warnings[0]
    assert f"{log}:{len(records) + 1}:" in warnings[0]


def test_finding_the_log(tmp_path):
    with pytest.raises(MetricsLogError, match="no metrics.jsonl"):
        plots.find_metrics_log(tmp_path)
    (tmp_path / "d" / "metrics.jsonl").mkdir(parents=True)
    with pytest.raises(MetricsLogError, match="metrics.jsonl there is a directory"):
        plots.find_metrics_log(tmp_path / "d")
    _write(tmp_path / "a.jsonl", _records(2))
    assert plots.find_metrics_log(tmp_path) == str(tmp_path / "a.jsonl")
    _write(tmp_path / "b.jsonl", _records(2))
    with pytest.raises(MetricsLogError, match=r"several JSONL files \(a.jsonl, b.jsonl\)"):
        plots.find_metrics_log(tmp_path)
    _write(tmp_path / "metrics.jsonl", _records(2))
    assert plots.find_metrics_log(tmp_path) == str(tmp_path / "metrics.jsonl")
    with pytest.raises(MetricsLogError, match="no such file"):
        plots.find_metrics_log(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "metrics.jsonl").write_text("\n")
    with pytest.raises(MetricsLogError, match="no metric records"):
        plots.read_metrics(tmp_path / "empty")


def test_without_matplotlib_the_command_says_what_to_install(tmp_path, monkeypatch, capsys):
    _write(tmp_path / "metrics.jsonl", _records(3))
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(MissingDependency, match="pip install matplotlib"):
        plots.plot_run(tmp_path)
    assert plots.main([str(tmp_path)]) == 2
    assert "pip install matplotlib" in capsys.readouterr().err


def test_command_exit_codes(tmp_path, capsys):
    assert plots.main([str(tmp_path / "missing")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    pytest.importorskip("matplotlib")
    _write(tmp_path / "metrics.jsonl", _records(3))
    assert plots.main([str(tmp_path), "-o", str(tmp_path / "r.png")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "r.png")


@pytest.mark.parametrize("out, says", [("r.pdf", "give a file path ending in .png"), ("", "ending in .png"),
                                       ("a_dir.png/", "ending in .png"), ("/proc/x.png", "cannot write it")])
def test_an_output_path_that_cannot_take_the_png_is_refused_naming_the_option(tmp_path, capsys, out, says):
    pytest.importorskip("matplotlib")
    _write(tmp_path / "metrics.jsonl", _records(3))
    if out == "a_dir.png/":
        (tmp_path / "a_dir.png").mkdir()
        out = str(tmp_path / "a_dir.png")
    elif out == "r.pdf":  # a PNG written under a .pdf name, before
        out = str(tmp_path / out)
    assert plots.main([str(tmp_path), "-o", out]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("accelbatch: error: -o/--out ") and says in err and "\n" not in err, err
    assert not (tmp_path / "r.pdf").exists()


# --- TensorBoard --------------------------------------------------------------------------------------
def test_scalars_mapping():
    record = {"split": "valid", "step": 3, "loss": 0.5, "accuracy": 1, "stopped_by": "x", "flag": True,
              "bad": float("nan")}
    assert TensorBoardLog.scalars(record) == {"valid/loss": 0.5, "valid/accuracy": 1.0}
    assert TensorBoardLog.scalars({**record, "final": True}) == {"valid_final/loss": 0.5, "valid_final/accuracy": 1.0}


def test_tensorboard_missing_is_a_noop_with_one_notice(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    notices = []
    log = TensorBoardLog(str(tmp_path / "tb"), notice=notices.append)
    for record in _records(3):
        log.write(record)
    log.close()
    assert not log.enabled and len(notices) == 1 and "pip install tensorboard" in notices[0]
    assert notices[0].startswith(f"accelbatch: --tensorboard-logdir {tmp_path / 'tb'}: the tensorboard package")
    assert not (tmp_path / "tb").exists()
    assert TensorBoardLog(None, notice=notices.append).enabled is False and len(notices) == 1


def test_tensorboard_scalars_are_written(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardLog(str(tmp_path / "tb")) as log:
        assert log.enabled
        for record in _records(10):
            log.write(record)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"train/loss", "train/exs_per_s", "valid/loss", "test/accuracy"} <= tags
    assert [e.step for e in events.Scalars("valid/loss")] == [5, 10]
    assert [e.step for e in events.Scalars("train/loss")] == list(range(1, 11))


def _scalar_steps(folder, tag):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(folder))
    events.Reload()
    return [(e.step, e.value) for e in events.Scalars(tag)]


def test_a_resumed_log_purges_what_the_stopped_run_wrote_after_its_checkpoint(tmp_path):
    pytest.importorskip("tensorboard")
    records = _records(10)                 # train steps 1-10, valid after steps 5 and 10, a test at the end
    saved_after = records.index({**records[5], "split": "valid"}) + 1  # the valid record at step 5
    stopped = TensorBoardLog(str(tmp_path / "tb"))
    for record in records[:saved_after]:
        stopped.write(record)
    saved = stopped.position()
    assert saved["step"] == 5 and len(saved["scalars"]) == 2  # step 5's train and valid records
    for record in records[saved_after:saved_after + 3]:  # written after the checkpoint, then killed
        stopped.write({**record, "loss": 99.0})
    stopped.writer.flush()
    with TensorBoardLog(str(tmp_path / "tb")) as resumed:
        resumed.resume_at(saved)
        for record in records[saved_after:]:
            resumed.write(record)
    whole = tmp_path / "whole"
    with TensorBoardLog(str(whole)) as log:
        for record in records:
            log.write(record)
    for tag in ("train/loss", "valid/loss", "valid/accuracy", "test/accuracy"):
        assert _scalar_steps(tmp_path / "tb", tag) == _scalar_steps(whole, tag), tag
    with TensorBoardLog(str(tmp_path / "other")) as elsewhere:
        elsewhere.write(records[0])
        elsewhere.resume_at(saved)  # a checkpoint of another folder: left alone
        assert elsewhere.last_step == 1


def test_a_line_nested_too_deeply_or_a_number_beyond_a_float_is_no_traceback(tmp_path):
    """json's RecursionError is a malformed line (named, or skipped with --skip-bad); an integer too big for a
    float is left out of the plot, as inf is."""
    deep = tmp_path / "deep.jsonl"
    deep.write_text(json.dumps(_records(1)[0]) + "\n" + "[" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(MetricsLogError, match=f"{deep}:2: not valid JSON"):
        plots.read_metrics(deep)
    assert len(plots.read_metrics(deep, skip_bad=True, warn=lambda text: None)) == 1
    big = _write(tmp_path / "big.jsonl", [*_records(3), {"split": "train", "step": 4, "loss": 10 ** 400}])
    assert [step for step, _ in plots.series(plots.read_metrics(big))[("train", "loss")][0]] == [1, 2, 3]


def test_the_log_may_be_a_pipe_and_an_out_path_under_a_file_is_said_so(tmp_path):
    fifo = tmp_path / "metrics.fifo"
    os.mkfifo(fifo)
    assert plots.find_metrics_log(fifo) == str(fifo)
    (tmp_path / "file").write_text("")
    with pytest.raises(MetricsLogError, match="cannot write it \\(a part of its directory is a file\\)"):
        plots.plot_run(_write(tmp_path / "m.jsonl", _records(3)), tmp_path / "file" / "x.png")
