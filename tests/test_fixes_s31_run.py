"""Session 31 fixes of the run: a continued -mf kept unless this run's model validates better; a torch
regression task refuses a -vmt its reports lack before the first step; hogwild keeps the batching metrics
and each process's bucket leftovers spill within its own shard."""

from __future__ import annotations

import json

import pytest
import torch

from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.hogwild import merge_metric_states
from accelbatch.opts import OptionError, Opts
from accelbatch.run import run

TORCH = ["-t", "torch:torch_task:make_dataset", "-m", "torch:torch_task:Classifier", "-opt", "sgd", "-bs", "4",
         "--no-progress", "--eval-splits", "valid"]


def _continue_from(tmp_path, capsys, record: dict, *extra: str) -> tuple[bytes, dict, str]:
    """Train m.pt (no validation), give it the trainstats ``record``, continue training it with ``extra``
    and no validation; m.pt's bytes before, the continued run's report and its stderr."""
    model_file, report = tmp_path / "m.pt", tmp_path / "r.json"
    assert main(["train", *TORCH, "-mf", str(model_file), "-tstep", "2", "-veps", "-1"]) == 0
    (tmp_path / "m.pt.trainstats").write_text(json.dumps(record))
    before = model_file.read_bytes()
    capsys.readouterr()
    assert main(["train", *TORCH, "-mf", str(model_file), "-tstep", "3", "-veps", "-1", "-lr", "5",
                 "--report-json", str(report), *extra]) == 0
    return before, json.loads(report.read_text()), capsys.readouterr().err


@pytest.mark.slow
def test_a_continued_model_file_is_kept_unless_this_run_validates_better(tmp_path, capsys):
    # accuracy is at most 1.0 and only a strictly better one replaces the file: this record cannot be beaten
    best = {"metric": "accuracy", "mode": "max", "value": 1.0}
    before, report, err = _continue_from(tmp_path, capsys, best)
    assert (tmp_path / "m.pt").read_bytes() == before
    assert json.loads((tmp_path / "m.pt.trainstats").read_text()) == best
    assert "-mf " + str(tmp_path / "m.pt") + " kept: this run's model validated accuracy " in err
    assert "not better than the file's 1" in err
    # the report's valid row scores the kept model: the same as an eval of the file
    assert main(["eval", "-mf", str(tmp_path / "m.pt"), "-t", "torch:torch_task:make_dataset", "-bs", "4",
                 "--report-json", str(tmp_path / "e.json")]) == 0
    assert json.loads((tmp_path / "e.json").read_text())["valid"]["accuracy"] == report["valid"]["accuracy"]


@pytest.mark.slow
def test_a_continued_model_file_is_replaced_by_one_that_validates_better(tmp_path, capsys):
    # every finite loss is below 1e9: this run's model replaces the file, with the record of its validation
    before, report, err = _continue_from(tmp_path, capsys, {"metric": "loss", "mode": "min", "value": 1e9},
                                         "-vmt", "loss")
    assert (tmp_path / "m.pt").read_bytes() != before and "kept" not in err
    stats = json.loads((tmp_path / "m.pt.trainstats").read_text())
    assert stats["metric"] == "loss" and stats["mode"] == "min"
    assert stats["value"] == pytest.approx(report["valid"]["loss"], abs=1e-6)  # the saved model, evaluated
    assert torch.load(tmp_path / "m.pt", weights_only=True)["model"]


REGRESSION = {"task": "torch:torch_task:make_regression", "model": "torch:torch_task:Regressor", "batchsize": 4,
              "progress": False}


def test_a_regression_task_refuses_the_default_validation_metric_before_the_first_step(tmp_path, capsys):
    """Float targets are not scored (no accuracy, f1): the valid report holds exs and the model's loss, so
    the default -vmt accuracy is refused naming loss, before any step, when the run validates."""
    opts = Opts(**REGRESSION, num_epochs=2, validation_every_n_epochs=1, model_file=str(tmp_path / "m.pt"))
    world = create_world(opts)
    with pytest.raises(OptionError, match="^-vmt/--validation-metric accuracy: the valid report of "
                                          "TorchModelAgent on this task has no such metric; choose one of loss$"):
        run(world, opts)
    assert world.get_total_exs() == 0 and not (tmp_path / "m.pt").exists()
    argv = ["train", "-t", REGRESSION["task"], "-m", REGRESSION["model"], "-bs", "4", "--no-progress"]
    assert main([*argv, "-ne", "2", "-veps", "1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "-vmt/--validation-metric accuracy" in err and err.rstrip().endswith("loss")
    # validating on loss trains; so does the default -vmt when nothing validates (2 epochs of 37 items in
    # steps of 4 rows: ceil(74 / 4) = 19 steps, 76 examples)
    assert main([*argv, "-ne", "2", "-veps", "1", "-vmt", "loss", "--eval-splits", ""]) == 0
    assert main([*argv, "-ne", "2", "-veps", "-1", "--eval-splits", "",
                 "--report-json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["train"]["exs"] == 76


def test_hogwild_merges_the_batching_metrics_of_its_processes():
    """pad_fraction weighed by each process's batch_tokens (the tokens fed, padding included); counts summed."""
    states = [{"tasks": [(None, ("report", {"exs": exs}))], "model": ("report", {"loss": 1.0}),
               "model_keeps_exs": False, "batching": batching}
              for exs, batching in ((10, {"pad_fraction": 0.5, "batch_tokens": 100, "dropped_exs": 3}),
                                    (30, {"pad_fraction": 0.1, "batch_tokens": 300, "dropped_exs": 4}))]
    report = merge_metric_states(states)
    # padding: 0.5 x 100 + 0.1 x 300 = 80 of 400 tokens
    assert (report["exs"], report["batch_tokens"], report["dropped_exs"]) == (40, 400, 7)
    assert report["pad_fraction"] == pytest.approx(80 / 400)


def _write_parlai(path, kinds: list[str]) -> str:
    """One single-turn episode per kind: 's' a text of 2 words, 'l' of 3; label candidates for bag."""
    lines = [f"text:w{i} x{' y' if kind == 'l' else ''}\tlabels:l{i % 3}\tlabel_candidates:l0|l1|l2\t"
             "episode_done:True" for i, kind in enumerate(kinds)]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def _hogwild_buckets(tmp_path, data: str, *extra: str) -> dict:
    report = tmp_path / "r.json"
    assert main(["train", "-t", f"parlai:{data}", "-m", "bag", "-bs", "4", "-ne", "1", "--dynamic-batching",
                 "buckets", "--max-batch-tokens", "12", "-nt", "2", "--no-progress", "--eval-splits", "",
                 "-veps", "-1", "--report-json", str(report), *extra]) == 0
    return json.loads(report.read_text())["train"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_hogwild_train_row_has_the_padding_of_every_process(tmp_path):
    # 40 examples, 2 and 3 words alternating in pairs; one bucket: every row padded to 3 words, 12 // 3 = 4
    # rows a batch; each process's 20 examples fill 5 batches (none left out): 40 x 3 = 120 tokens fed, of
    # which 20 x 1 padding: pad_fraction 1/6
    data = _write_parlai(tmp_path / "d.txt", ["s" if i % 4 < 2 else "l" for i in range(40)])
    train = _hogwild_buckets(tmp_path, data, "--num-buckets", "1")
    assert (train["exs"], train["batch_tokens"], train.get("dropped_exs", 0)) == (40, 120, 0)
    assert train["pad_fraction"] == pytest.approx(1 / 6)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_each_hogwild_process_spills_its_own_bucket_leftovers(tmp_path):
    """Process 0 serves the even episodes (14 of 2 words, 10 of 3), process 1 the odd ones (10 and 14); with a
    budget of 12 tokens the 2-word bucket has up to 6 rows, the 3-word one 4. Each planning its own shard:
    process 0: 14 short over 3 batches of 4 (12), 2 spill into the long bucket: 12 long, 3 batches, nothing
    left (6 steps); process 1: 10 short in 2 batches of 5, 14 long: 3 batches of 4 and 2 left out (5 steps).
    46 trained, 2 left out (one process alone leaves out 0: 24 + 24, 4 x 6 short and 6 x 4 long); tokens
    12 x 2 + 12 x 3 + 10 x 2 + 12 x 3 = 116, of which the 2 spilled rows' 2 padding positions."""
    kinds = [("s" * 14 + "l" * 10)[i // 2] if i % 2 == 0 else ("s" * 10 + "l" * 14)[i // 2] for i in range(48)]
    train = _hogwild_buckets(tmp_path, _write_parlai(tmp_path / "d.txt", kinds))
    assert (train["exs"], train["dropped_exs"], train["steps"], train["batch_tokens"]) == (46, 2, 11, 116)
    assert train["pad_fraction"] == pytest.approx(2 / 116)
