from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import zipfile

import pytest
import torch

from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.models.memnn import MemNNAgent
from accelbatch.models.utility import RepeatLabelAgent
from accelbatch.opts import OptionError, Opts
from accelbatch.run import run
from accelbatch.tasks.files import DataFileError


@pytest.mark.slow
def test_demo_defaults_train_the_bundled_task_past_95_percent(tmp_path, capsys):
    """`accelbatch train` with no task or model: the README's demo."""
    report_path = tmp_path / "report.json"
    log_path = tmp_path / "metrics.jsonl"
    rc = main(["train", "--no-progress", "--report-json", str(report_path), "--metrics-log", str(log_path),
               "-ltim", "0.5"])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["valid"]["accuracy"] >= 0.95 and report["valid"]["exs"] == 1000
    assert report["test"]["exs"] == 1000
    assert report["train"]["epochs"] >= 5.0
    assert report["device"] == "cpu"
    records = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert {r["split"] for r in records} >= {"train", "valid", "test"}
    shares = [r["data_wait_share"] for r in records if r["split"] == "train"]
    assert shares and all(0.0 < share < 1.0 for share in shares)  # teacher acts + vectorize: some, not all
    out = capsys.readouterr().out
    assert "valid" in out and "accuracy" in out


def test_eval_of_a_single_jsonl_file_serves_every_example(write_jsonl, capsys):
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(37)])
    for datatype in ("valid", "test"):
        opts = Opts(task=f"jsonl:{path}", model="repeat_label", datatype=datatype, batchsize=8,
                    progress=False)
        report = run(create_world(opts), opts)
        assert report[datatype]["exs"] == 37 and report[datatype]["accuracy"] == 1.0
    assert main(["eval", "-t", f"jsonl:{path}", "-m", "repeat_label", "--no-progress"]) == 0
    assert " 37 " in capsys.readouterr().out


def test_random_candidate_scores_near_chance():
    opts = Opts(task="babi:1", model="random_candidate", datatype="valid", progress=False)
    report = run(create_world(opts), opts)["valid"]
    assert report["exs"] == 1000 and 0.08 < report["accuracy"] < 0.26  # 6 candidates -> ~1/6


def test_module_class_paths_work_for_task_and_model(tmp_path, monkeypatch, capsys):
    (tmp_path / "mytask.py").write_text(
        "from accelbatch.teachers import FixedTeacher\n"
        "from accelbatch.messages import Message\n"
        "class Squares(FixedTeacher):\n"
        "    def setup_data(self):\n"
        "        return [[Message(text=str(i), labels=[str(i * i)], episode_done=True)] for i in range(9)]\n"
        "class Echo:\n"
        "    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["eval", "-t", "mytask:Squares", "-m", "accelbatch.models.utility:RepeatLabelAgent",
                 "--no-progress", "--report-json", str(tmp_path / "r.json")]) == 0
    assert json.loads((tmp_path / "r.json").read_text())["valid"]["exs"] == 9


def test_model_file_round_trip_and_refusal_of_a_bad_file(tmp_path):
    path = str(tmp_path / "model.pt")
    opts = Opts(task="babi:1", max_train_steps=5, model_file=path, progress=False, eval_splits="",
                validation_every_n_epochs=-1)
    trained = create_world(opts)
    run(trained, opts)
    loaded = MemNNAgent(opts)
    for p, q in zip(trained.get_model_agent().model.parameters(), loaded.model.parameters()):
        assert torch.equal(p, q)
    with open(path, "r+b") as handle:
        handle.truncate(100)
    with pytest.raises(ValueError, match="--model-file .*cannot load"):
        MemNNAgent(opts)


@pytest.mark.multiprocess
def test_python_dash_m_lists_tasks():
    out = subprocess.run([sys.executable, "-m", "accelbatch", "tasks"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert "babi:1" in out and "repeat_label" in out
    rows = [line for line in out.splitlines() if line.startswith("  ")]
    starts = {len(line) - len(line[line.index(" ", 2):].lstrip()) for line in rows}  # where each text begins
    assert len(starts) == 1, rows  # one column for every description, however long a name


def _ranking_rows(n: int) -> list[dict]:
    """Examples a candidate ranker learns: the answer is the question's word."""
    words = ["red", "green", "blue", "black"]
    return [{"text": f"say {words[i % 4]}", "labels": [words[i % 4]], "label_candidates": words} for i in range(n)]


def _weights(path: str) -> dict[str, torch.Tensor]:
    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.mark.slow
def test_eval_of_the_train_split_scores_it_once_and_never_trains_nor_saves(write_jsonl, tmp_path):
    data = write_jsonl(_ranking_rows(40))
    model_file = str(tmp_path / "e.pt")
    common = ["-t", f"jsonl:{data}", "-m", "bag", "-bs", "8", "--no-progress", "-mf", model_file]
    assert main(["train", *common, "-tstep", "2", "--eval-splits", "", "-veps", "-1"]) == 0
    before, saved = open(model_file, "rb").read(), _weights(model_file)
    for datatype in ("train", "train:stream", "train:ordered"):
        report_path = tmp_path / f"{datatype}.json"
        assert main(["eval", *common, "-dt", datatype, "--report-json", str(report_path)]) == 0
        report = json.loads(report_path.read_text())
        assert set(report) == {"train", "device"}
        assert report["train"]["exs"] == 40 and "steps" not in report["train"]  # each example once, no update
        assert open(model_file, "rb").read() == before
    # the score is the saved model's: the same as evaluating it on the (single-file) valid split
    valid = run(create_world(opts := Opts(task=f"jsonl:{data}", model="bag", batchsize=8, datatype="valid",
                                          model_file=model_file, progress=False)), opts)["valid"]
    assert report["train"]["accuracy"] == valid["accuracy"]
    assert all(torch.equal(saved[k], v) for k, v in _weights(model_file).items())


def test_eval_with_a_missing_model_file_is_a_one_line_error(tmp_path, capsys):
    missing = str(tmp_path / "typo.pt")
    assert main(["eval", "-m", "repeat_label", "-mf", missing, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and missing in err and "no such file" in err


@pytest.mark.parametrize("flag, value", [("-ga", "2"), ("--gradient-accumulation", "2"), ("-lr", "0.1"),
                                          ("-ne", "2"), ("--resume", None), ("-vmt", "loss")])
def test_eval_refuses_training_options(flag, value, capsys):
    argv = ["eval", "-m", "repeat_label", "--no-progress", flag] + ([value] if value else [])
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag.lstrip("-") in err and "training option" in err


@pytest.mark.parametrize("device", ["cpu", "ipu"])
def test_gradient_accumulation_in_an_evaluation_run_is_refused(device):
    opts = Opts(task="babi:1", model="repeat_label", datatype="valid", gradient_accumulation=2, device=device,
                ipu_emulator=True, progress=False)
    with pytest.raises(OptionError, match="-ga/--gradient-accumulation 2: gradient accumulation is a training"):
        run(create_world(opts), opts)


def test_eval_help_lists_no_training_option(capsys):
    from accelbatch.opts import train_only_flags

    with pytest.raises(SystemExit):
        main(["eval", "--help"])
    text = capsys.readouterr().out
    assert "--datatype" in text and "--model-file" in text
    for flags in train_only_flags().values():
        for flag in flags.split("/"):
            assert f" {flag} " not in text and f" {flag}," not in text and f"[{flag}" not in text, flag


def _train_memnn(path: str, **changes) -> Opts:
    fields = {"task": "babi:1", "max_train_steps": 2, "model_file": path, "progress": False, "eval_splits": "",
              "validation_every_n_epochs": -1, "embedding_size": 16}
    opts = Opts(**{**fields, **changes})
    run(create_world(opts), opts)
    return opts


@pytest.mark.slow
def test_continuing_a_model_file_replaces_it_only_with_a_model_that_validates_better(tmp_path, capsys):
    """As ParlAI's best_valid: the model in -mf keeps its validation score (PATH.trainstats), and a run that
    continues from it saves only a model whose validation beats that score (here a rate of 0.5 makes the
    later validations worse); a run that chooses on another metric starts its own record."""
    path, log = tmp_path / "m.pt", tmp_path / "log.jsonl"
    first = Opts(task="babi:1", model="memnn", batchsize=32, num_epochs=1, validation_every_n_epochs=0.5,
                 model_file=str(path), eval_splits="valid", progress=False, embedding_size=16,
                 learning_rate=0.05)
    kept = run(create_world(first), first)["valid"]["accuracy"]
    saved = path.read_bytes()
    assert json.loads((tmp_path / "m.pt.trainstats").read_text()) == {"metric": "accuracy", "mode": "max",
                                                                      "value": kept}
    capsys.readouterr()
    second = first.replace(learning_rate=0.5, metrics_log=str(log))
    report = run(create_world(second), second)
    assert f"holds a model whose validation had accuracy {kept:.4g}; only a better one" in capsys.readouterr().err
    validated = [json.loads(line)["accuracy"] for line in log.read_text().splitlines() if '"valid"' in line][:-1]
    assert len(validated) == 2
    assert report["valid"]["accuracy"] == max([kept, *validated])  # the final row evaluates -mf
    if max(validated) <= kept:
        assert path.read_bytes() == saved
    by_loss = second.replace(validation_metric="loss", metrics_log=None, num_epochs=0.5)
    run(create_world(by_loss), by_loss)  # its one validation is the first of its record: saved
    assert "chooses on loss (min): its first validation replaces it" in capsys.readouterr().err
    assert json.loads((tmp_path / "m.pt.trainstats").read_text())["metric"] == "loss"


def test_continuing_a_model_file_applies_a_new_learning_rate_and_says_so(tmp_path, capsys):
    path = str(tmp_path / "m.pt")
    opts = _train_memnn(path, learning_rate=0.01)
    saved = torch.load(path, map_location="cpu", weights_only=True)["optimizer"]
    agent = MemNNAgent(opts.replace(learning_rate=0.05))
    assert [g["lr"] for g in agent.optimizer.param_groups] == [0.05]
    steps = [float(s["step"]) for s in agent.optimizer.state_dict()["state"].values()]
    assert steps == [float(s["step"]) for s in saved["state"].values()] and steps[0] == 2  # Adam's state kept
    assert agent.load_notes == [f"--model-file {path}: continuing with -lr 0.05 (the file's optimizer had 0.01)"]
    assert MemNNAgent(opts).load_notes == []  # the same -lr: nothing to say
    argv = ["train", "-t", "babi:1", "-mf", path, "-esz", "16", "-tstep", "1", "--no-progress", "-veps", "-1",
            "--eval-splits", "", "-lr", "0.02"]
    assert main(argv) == 0
    assert capsys.readouterr().err.count("continuing with -lr 0.02 (the file's optimizer had 0.01)") == 1


def test_continuing_a_model_file_with_another_optimizer_starts_it_fresh(tmp_path, capsys):
    path = str(tmp_path / "m.pt")
    opts = _train_memnn(path, optimizer="adam")
    weights = torch.load(path, map_location="cpu", weights_only=True)["model"]
    sgd = opts.replace(optimizer="sgd", max_train_steps=1)
    agent = MemNNAgent(sgd)
    assert isinstance(agent.optimizer, torch.optim.SGD) and not agent.optimizer.state_dict()["state"]
    assert all(torch.equal(weights[k], v) for k, v in agent.model.state_dict().items())
    assert agent.load_notes == [f"--model-file {path}: saved with Adam optimizer state; SGD starts fresh "
                                "(weights loaded)"]
    run(create_world(sgd), sgd)  # trains on with SGD
    assert "SGD starts fresh" in capsys.readouterr().err
    assert torch.load(path, map_location="cpu", weights_only=True)["optimizer_class"] == "SGD"


def test_continuing_a_model_file_without_optimizer_state_says_it_starts_fresh(tmp_path):
    path = str(tmp_path / "m.pt")
    opts = _train_memnn(path, optimizer="adam")
    saved = torch.load(path, map_location="cpu", weights_only=True)
    torch.save({"model": saved["model"]}, path)  # weights alone, as a hand-made file holds
    agent = MemNNAgent(opts)
    assert isinstance(agent.optimizer, torch.optim.Adam) and not agent.optimizer.state_dict()["state"]
    assert all(torch.equal(saved["model"][k], v) for k, v in agent.model.state_dict().items())
    assert agent.load_notes == [f"--model-file {path}: holds no optimizer state; Adam starts fresh (weights loaded)"]
    assert MemNNAgent(opts.replace(datatype="valid")).load_notes == []  # evaluation builds no optimizer


def _one_bit_flipped(raw: bytes) -> bytes:
    """A torch save with one bit flipped inside its largest tensor's bytes (it loads as other weights)."""
    with zipfile.ZipFile(io.BytesIO(raw)) as archive:
        entry = max(archive.infolist(), key=lambda info: info.file_size)
    header = entry.header_offset
    name_len, extra_len = struct.unpack("<HH", raw[header + 26:header + 30])
    at = header + 30 + name_len + extra_len + entry.file_size // 2
    return raw[:at] + bytes([raw[at] ^ 0x40]) + raw[at + 1:]


def _foreign_files(tmp_path, good: str) -> dict[str, tuple[str, str]]:
    """name -> (path, expected fragment) of files that are not a 16-wide memnn's save."""
    raw = open(good, "rb").read()
    (tmp_path / "truncated.pt").write_bytes(raw[: len(raw) // 2])
    (tmp_path / "text.pt").write_text("hello\n")
    (tmp_path / "empty.pt").write_bytes(b"")
    torch.save({"weights": torch.zeros(2)}, tmp_path / "dict.pt")
    torch.save(torch.zeros(3), tmp_path / "tensor.pt")
    _train_memnn(str(tmp_path / "wide.pt"), embedding_size=24)
    (tmp_path / "flipped.pt").write_bytes(_one_bit_flipped(raw))
    return {"truncated": (str(tmp_path / "truncated.pt"), "not a model file saved by accelbatch"),
            "flipped": (str(tmp_path / "flipped.pt"), "fails its CRC-32 check (the file was damaged after it was "
                        "saved)"),
            "text": (str(tmp_path / "text.pt"), "not a model file saved by accelbatch"),
            "empty": (str(tmp_path / "empty.pt"), "not a model file saved by accelbatch"),
            "dict": (str(tmp_path / "dict.pt"), "holds no model weights"),
            "tensor": (str(tmp_path / "tensor.pt"), "holds no model weights"),
            "wide": (str(tmp_path / "wide.pt"), "is [4096, 24] in the file but [4096, 16] in this MemNNAgent")}


def test_a_model_file_saved_without_crc32s_loads(tmp_path):
    """torch.serialization.set_crc32_options(False) writes 0 for every CRC-32: not damage."""
    good = str(tmp_path / "good.pt")
    opts = _train_memnn(good)
    state = torch.load(good, map_location="cpu", weights_only=True)
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(state, good)
    finally:
        torch.serialization.set_crc32_options(True)
    with zipfile.ZipFile(good) as archive:
        assert {entry.CRC for entry in archive.infolist()} == {0}
    loaded = MemNNAgent(opts.replace(model_file=good))
    assert all(torch.equal(state["model"][k], v) for k, v in loaded.model.state_dict().items())


def test_unloadable_model_files_are_one_line_errors(tmp_path, capsys):
    good = str(tmp_path / "good.pt")
    _train_memnn(good)
    for name, (path, fragment) in _foreign_files(tmp_path, good).items():
        capsys.readouterr()
        assert main(["eval", "-mf", path, "-esz", "16", "--no-progress"]) == 2, name
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"--model-file {path}: cannot load" in err and fragment in err, err
    capsys.readouterr()
    assert main(["eval", "-mf", good, "-m", "bag", "-esz", "16", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "its weights are not a BagAgent's" in err


def test_init_model_starts_from_its_weights_with_a_fresh_optimizer(tmp_path):
    source = str(tmp_path / "source.pt")
    opts = _train_memnn(source)
    weights = torch.load(source, map_location="cpu", weights_only=True)["model"]
    target = str(tmp_path / "target.pt")
    agent = MemNNAgent(opts.replace(model_file=target, init_model=source))
    assert all(torch.equal(weights[k], v) for k, v in agent.model.state_dict().items())
    assert not agent.optimizer.state_dict()["state"]
    fresh = MemNNAgent(opts.replace(model_file=target))
    assert not all(torch.equal(weights[k], v) for k, v in fresh.model.state_dict().items())
    _train_memnn(target, init_model=source, seed=1)
    continued = MemNNAgent(opts.replace(model_file=target, init_model=source))  # -mf exists: it wins
    saved = torch.load(target, map_location="cpu", weights_only=True)["model"]
    assert all(torch.equal(saved[k], v) for k, v in continued.model.state_dict().items())
    assert f"--init-model {source}: not used: -mf {target} exists and is continued" in continued.load_notes[-1]
    with pytest.raises(OptionError, match="--init-model .*nope.pt: no such file"):
        MemNNAgent(opts.replace(model_file=None, init_model=str(tmp_path / "nope.pt")))
    with pytest.raises(OptionError, match="--init-model .*: a directory, not a model file"):
        MemNNAgent(opts.replace(model_file=None, init_model=str(tmp_path)))


def test_a_validation_metric_of_a_run_that_does_not_read_it_is_noted_not_refused(capsys):
    """No validation during training and no -mf: -vmt is noted as unused (and changes nothing), not refused
    after that note; the final valid report says it lacks the name."""
    base = ["train", "-t", "babi:1", "-tstep", "2", "-veps", "-1", "--no-progress", "--eval-splits", "valid"]
    assert main([*base, "-vmt", "hits@1"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("accelbatch: -vmt/--validation-metric: not used by this run")
    assert err[1].startswith("accelbatch: -vmt/--validation-metric hits@1: the final valid report has no such "
                             "metric") and len(err) == 2


class _OwnRepeatLabel(RepeatLabelAgent):
    """A user's agent: it may report metrics of its own, so -vmt is checked against its first valid report."""


def test_a_validation_metric_no_report_has_is_refused(write_jsonl, capsys):
    data = write_jsonl(_ranking_rows(16))
    opts = Opts(task=f"jsonl:{data}", model="repeat_label", batchsize=4, num_epochs=3, validation_metric="acuracy",
                validation_patience=2, progress=False)
    world = create_world(opts)  # accelbatch's own agent and teacher: refused before the first step
    with pytest.raises(OptionError, match="-vmt/--validation-metric acuracy: the valid report of RepeatLabelAgent "
                                          "on this task has no such metric; choose one of accuracy, f1$"):
        run(world, opts)
    assert world.get_total_exs() == 0
    assert main(["train", "-t", f"jsonl:{data}", "-m", "repeat_label", "-bs", "4", "-vmt", "nosuch",
                 "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "accuracy" in err
    own = create_world(opts.replace(validation_metric="nosuch"), agent=_OwnRepeatLabel(opts))
    with pytest.raises(OptionError, match="-vmt/--validation-metric nosuch: .*choose one of exs, accuracy, f1"):
        run(own, opts.replace(validation_metric="nosuch"))  # at the first validation, naming what it reported
    assert own.get_total_exs() > 0


def test_metric_names_nothing_reports_are_refused_before_the_run(write_jsonl, capsys, tmp_path):
    """--metrics and -vmt against the names accelbatch's own pieces report: a typo is one line and exit 2
    before any step; a multitask run's TASK/metric names and the run's counts are known. (-vmt is read by a
    run that validates or writes -mf: these write one each.)"""
    data = write_jsonl(_ranking_rows(16))
    files = iter(range(10))

    def mf() -> list[str]:
        return ["-mf", str(tmp_path / f"m{next(files)}.pt")]

    base = ["train", "-m", "repeat_label", "-bs", "4", "-tstep", "1", "--no-progress", "-veps", "-1",
            "--eval-splits", ""]
    assert main([*base, "-t", f"jsonl:{data}", "--metrics", "accuracy,f1-score"]) == 2
    assert capsys.readouterr().err.strip() == ("accelbatch: error: --metrics: no report of this run has f1-score; "
                                               "name metrics such as accuracy,f1,loss, or give 'default' or 'all'")
    two = f"jsonl:{data},babi:1"
    assert main([*base, "-t", two, "--metrics", f"jsonl:{data}/accuracy,babi:1/f1,exs_per_s",
                 "-vmt", "babi:1/accuracy", *mf()]) == 0
    assert "error" not in capsys.readouterr().err
    assert main([*base, "-t", two, "-vmt", "babi:2/accuracy", *mf()]) == 2  # not one of the run's tasks
    assert "-vmt/--validation-metric babi:2/accuracy" in capsys.readouterr().err
    # a metric other models report: memnn has no token metrics; bleu-4 is scored when --metrics asks for it
    memnn = ["train", "-m", "memnn", "-t", "babi:1", "-tstep", "1", "--no-progress", "-veps", "-1", "--eval-splits", ""]
    assert main([*memnn, "-vmt", "token_acc", *mf()]) == 2
    assert "choose one of accuracy, f1, loss\n" in capsys.readouterr().err
    assert main([*memnn, "-vmt", "bleu-4", *mf()]) == 2
    assert "bleu-4 is scored with --metrics bleu-4 (or all)" in capsys.readouterr().err
    assert main([*memnn, "-vmt", "bleu-4", "--metrics", "all", *mf()]) == 0
    generator = ["train", "-m", "transformer/generator", "-t", "reverse:20", "-tstep", "1", "--no-progress",
                 "-veps", "-1", "--eval-splits", "", "-bs", "4"]
    assert main([*generator, "-vmt", "token_acc", "--metrics", "ppl,token_acc", *mf()]) == 0


@pytest.mark.parametrize("mode, metric, stops_after", [("min", "accuracy", 2), ("max", "accuracy", 4),
                                                        (None, "accuracy", 4), (None, "loss", 2)])
def test_validation_metric_mode_decides_what_improves(monkeypatch, mode, metric, stops_after):
    """Rising values (0.1, 0.2, ...): an improvement when larger is better, stale when smaller is."""
    import importlib

    run_module = importlib.import_module("accelbatch.run")

    values = iter([0.1, 0.2, 0.3, 0.4])
    monkeypatch.setattr(run_module, "evaluate", lambda *args, **kwargs: {"exs": 4, metric: next(values)})
    opts = Opts(validation_metric=metric, validation_metric_mode=mode, validation_patience=1)
    state = run_module.TrainState()
    stopped = [run_module._validate(None, opts, None, state, None, None) for _ in range(4)]
    assert stopped.index(True) + 1 == stops_after if True in stopped else stops_after == 4


def test_a_validation_that_scores_nan_is_never_the_best_and_patience_waits_for_a_best():
    """-vmt loss NaN at every validation: the first one was no best, yet -vp 1 stopped the run there, and the
    end said -mf was 'removed after the validation that wrote it' (none wrote it)."""
    from accelbatch.best_valid import judge
    from accelbatch.train_state import TrainState

    opts, state = Opts(validation_metric="loss", validation_patience=1), TrainState()
    nan = float("nan")
    assert [judge(v, opts, state) for v in (nan, nan)] == [(False, False)] * 2 and state.stale == 0
    assert judge(0.5, opts, state) == (True, False) and state.best == -0.5
    assert judge(nan, opts, state) == (False, True) and state.stale == 1  # no improvement on a best


@pytest.mark.timeout(120)
def test_a_run_whose_validations_score_nan_says_so_and_writes_its_last_model(tmp_path, capsys):
    model = tmp_path / "m.pt"
    argv = ["train", "-t", "torch:torch_task:make_dataset", "-m", "torch:torch_task:NanInEval", "-bs", "8",
            "-ne", "2", "-vmt", "loss", "-vp", "1", "-mf", str(model), "--no-progress", "--eval-splits", "",
            "--report-json", str(tmp_path / "r.json")]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.count("scored -vmt loss nan: its model cannot be the best") == 2, err  # both epochs validated
    assert "removed after" not in err and "no validation scored -vmt loss as a number" in err, err
    assert model.is_file() and json.loads((tmp_path / "r.json").read_text())["train"]["stopped_by"] == "num_epochs"


@pytest.mark.slow
def test_validation_options_of_parlai(write_jsonl, tmp_path):
    """-vme caps the examples of each validation during training, not the final evaluation; -vtim validates
    on a clock; --metrics keeps the listed metrics in the report."""
    data = write_jsonl(_ranking_rows(40))
    log = tmp_path / "log.jsonl"
    opts = Opts(task=f"jsonl:{data}", model="bag", batchsize=8, num_epochs=2, validation_max_exs=16,
                metrics_log=str(log), progress=False, eval_splits="valid", metrics="accuracy")
    report = run(create_world(opts), opts)
    valid = [json.loads(line) for line in log.read_text().splitlines() if '"valid"' in line]
    assert [r["exs"] for r in valid] == [16, 16, 40]  # two validations during training, then the final one
    assert report["valid"]["exs"] == 40 and set(report["valid"]) == {"exs", "accuracy", "time_s"}
    assert "loss" not in report["train"] and "accuracy" in report["train"]
    log.unlink()
    timed = opts.replace(num_epochs=-1, max_train_steps=3, validation_every_n_epochs=-1, validation_max_exs=-1,
                         validation_every_n_secs=1e-9, eval_splits="", metrics="default")
    report = run(create_world(timed), timed)
    valid = [json.loads(line) for line in log.read_text().splitlines() if '"valid"' in line]
    assert len(valid) == 2 and "loss" in report["train"]  # after steps 1 and 2 (step 3 ends the run)


def test_no_drop_last_on_ipu_is_refused_before_any_work(monkeypatch, capsys):
    import accelbatch.build as build

    def no_world(*args, **kwargs):
        raise AssertionError("a world was built")

    monkeypatch.setattr(build, "build_world", no_world)
    opts = Opts(device="ipu", ipu_emulator=True, drop_last=False, dynamic_batching="batchsort", progress=False)
    with pytest.raises(OptionError, match="--no-drop-last: --device ipu runs graphs of static shapes"):
        create_world(opts)
    assert main(["train", "--device", "ipu", "--ipu-emulator", "--no-drop-last", "--dynamic-batching", "batchsort",
                 "--no-progress"]) == 2
    assert capsys.readouterr().err.count("\n") == 1
    monkeypatch.undo()
    # evaluation has no tail to train
    evaluation = opts.replace(datatype="valid", model="repeat_label", dynamic_batching="none")
    assert run(create_world(evaluation), evaluation)["valid"]["exs"] == 1000


@pytest.mark.parametrize("argv, fragment", [
    (["-m", "os:path"], "model 'os:path' is a module, not a model"),
    (["-m", "os:sep"], "model 'os:sep' is a str, not a model"),
    (["-m", "os:stat_result"], "model 'os:stat_result' is a class without act(), not a model"),
    (["-t", "collections:OrderedDict", "-m", "repeat_label"], "task 'collections:OrderedDict' is a class without"),
])
def test_a_module_path_that_is_no_agent_or_teacher_is_one_line(argv, fragment, capsys):
    assert main(["eval", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err


@pytest.mark.parametrize("argv, fragment", [
    (["-nt", "2"], "--numthreads 2 (hogwild) runs on --device cpu only"),
    (["-rf", "3"], "-rf/--replication-factor 3: an IPU system reserves a power of 2"),
    (["--no-drop-last", "--dynamic-batching", "batchsort"], "--no-drop-last: --device ipu runs graphs of static"),
])
def test_an_option_the_device_refuses_is_one_line_before_any_agent_is_built(argv, fragment, capsys, monkeypatch):
    """Said before the agent (whose model's imports alone took seconds: a generator imports torch._dynamo)."""
    import accelbatch.build as build

    def no_agent(*args, **kwargs):
        raise AssertionError("an agent was built")

    monkeypatch.setattr(build, "make_agent", no_agent)
    assert main(["train", "--device", "ipu", "--ipu-emulator", *argv, "-tstep", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and fragment in err, err


def test_a_parlai_training_line_without_labels_is_one_line(tmp_path, capsys):
    path = tmp_path / "train.txt"
    path.write_text("text:a\tlabels:b\tepisode_done:True\ntext:hello\tepisode_done:True\n")
    assert main(["train", "-t", f"parlai:{path}", "-m", "repeat_label", "-tstep", "2", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{path}:2: no labels: field" in err


def test_resume_applies_a_new_learning_rate_and_refuses_another_optimizer(tmp_path, capsys):
    from accelbatch.checkpoint import CheckpointError

    path = str(tmp_path / "m.pt")
    opts = _train_memnn(path, save_every_n_secs=1000.0, learning_rate=0.01)  # a checkpoint at the end
    resumed = opts.replace(resume=True, max_train_steps=3, learning_rate=0.05)
    world = create_world(resumed)
    optimizer, parley, rates = world.get_model_agent().engine.host_optimizer(), world.parley, []
    world.parley = lambda: (rates.append([g["lr"] for g in optimizer.param_groups]), parley())
    run(world, resumed)
    assert rates == [[0.05]]  # the resumed run's one step
    assert "--resume: continuing with -lr 0.05 (the checkpoint's optimizer had 0.01)" in capsys.readouterr().err
    other = resumed.replace(optimizer="sgd", max_train_steps=4)
    with pytest.raises(CheckpointError, match=r"-opt/--optimizer 'sgd' \(checkpoint: 'adam'\)"):
        run(create_world(other), other)


@pytest.mark.slow
def test_mixed_precision_on_the_cpu_changes_the_run(tmp_path):
    """`--mixed-precision` on --device cpu runs autocast (bf16; fp16 with a loss scaler where torch has it):
    the valid loss differs from fp32's after the same steps, and stays close to it."""
    from accelbatch.backends.cpu import fp16_on_cpu_supported

    losses = {}
    for mp in ("no", "bf16") + (("fp16",) if fp16_on_cpu_supported() else ()):
        path = tmp_path / f"{mp}.json"
        assert main(["train", "-t", "babi:1", "-m", "memnn", "-bs", "8", "--max-train-steps", "4", "-veps", "-1",
                     "--eval-splits", "valid", "--no-progress", "--mixed-precision", mp,
                     "--report-json", str(path)]) == 0
        losses[mp] = json.loads(path.read_text())["valid"]["loss"]
    for mp, loss in losses.items():
        if mp != "no":
            assert loss != losses["no"] and loss == pytest.approx(losses["no"], rel=0.05), (mp, losses)


def test_a_model_file_for_an_agent_without_a_model_says_nothing_was_written(tmp_path, capsys):
    model = tmp_path / "rl.pt"
    assert main(["train", "-m", "repeat_label", "-mf", str(model), "-tstep", "3", "--no-progress",
                 "--eval-splits", "", "-veps", "-1"]) == 0
    err = capsys.readouterr().err
    assert f"-mf/--model-file {model}: RepeatLabelAgent is not a TorchAgent" in err and "nothing was written" in err
    assert not model.exists()


def test_max_train_time_stops_training_then_evaluates_as_the_other_limits(capsys):
    """ParlAI's -ttim: the run stops at the first step past the time (here: the first one), then saves and
    evaluates as at -ne or -tstep; 0 and negative times other than -1 are refused like -tstep's."""
    opts = Opts(task="babi:1", model="repeat_label", max_train_time=1e-9, num_epochs=-1, progress=False,
                validation_every_n_epochs=-1, eval_splits="valid")
    report = run(create_world(opts), opts)
    assert (report["train"]["stopped_by"], report["train"]["steps"]) == ("max_train_time", 1)
    assert report["valid"]["exs"] == 1000
    for bad in ("0", "-3"):
        assert main(["train", "-ttim", bad, "--no-progress"]) == 2
        assert f"-ttim/--max-train-time: must be positive, or -1 for no limit, got {float(bad)}" in \
            capsys.readouterr().err
    for bad in ("0", "-2"):
        assert main(["train", "-veps", bad, "--no-progress"]) == 2
        assert "-veps/--validation-every-n-epochs: must be positive, or -1" in capsys.readouterr().err


def test_a_run_without_resume_says_it_starts_over_an_earlier_checkpoint(tmp_path, capsys):
    """A checkpoint left by a stopped run is not resumed without --resume (as the README says); the run says
    so, since its own checkpoints then replace that position."""
    path = str(tmp_path / "m.pt")
    opts = Opts(task="babi:1", model="memnn", max_train_steps=2, model_file=path, progress=False,
                eval_splits="", validation_every_n_epochs=-1, embedding_size=16, save_every_n_secs=3600)
    run(create_world(opts), opts)  # saves PATH.ckpt at the end (a resume goes on from there)
    assert "holds an earlier run's position" not in capsys.readouterr().err
    run(create_world(opts), opts)
    assert (f"accelbatch: {path}.ckpt holds an earlier run's position; this run starts afresh and its checkpoints "
            "replace it (--resume continues that run instead)") in capsys.readouterr().err
    run(create_world(opts.replace(resume=True)), opts.replace(resume=True))
    assert "holds an earlier run's position" not in capsys.readouterr().err


def test_a_missing_or_bad_valid_file_is_found_before_training(tmp_path):
    """A folder task's valid file is read before the first step when the run validates: it was read at the
    first validation, after an epoch of training, and the run then ended with nothing saved."""
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "train.jsonl").write_text("".join(json.dumps({"text": f"q{i}", "labels": ["a"]}) + "\n"
                                                for i in range(8)))
    opts = Opts(task=f"jsonl:{folder}", model="repeat_label", batchsize=2, num_epochs=1, progress=False)
    world = create_world(opts)
    with pytest.raises(DataFileError, match="valid.jsonl"):
        run(world, opts)
    assert world.get_total_exs() == 0
    (folder / "valid.jsonl").write_text('{"text": "q", "labels": ["a"]}\n{"text": "q"\n')
    world = create_world(opts)
    with pytest.raises(DataFileError, match="valid.jsonl:2"):
        run(world, opts)
    assert world.get_total_exs() == 0


def test_a_task_listed_twice_is_refused(capsys):
    """Each task's metrics are reported under its name (TASK/accuracy): -t X,X reported X/exs 3 while exs was
    6, the second task's numbers overwriting the first's."""
    assert main(["train", "-t", "babi:1, babi:2,babi:1", "-tstep", "1", "--no-progress"]) == 2
    assert capsys.readouterr().err == ("accelbatch: error: -t/--task babi:1, babi:2,babi:1: names babi:1 more than "
                                       "once; list each task once\n")


def test_a_model_file_names_its_model_so_eval_needs_only_mf(tmp_path, capsys):
    """As ParlAI's MODEL.opt: PATH.opt keeps -m and -esz, so eval, display-model and interactive -mf PATH
    need nothing else (it assumed -m memnn and refused a bag model's file); the command line still wins."""
    path = str(tmp_path / "m.pt")
    assert main(["train", "-m", "bag", "-esz", "16", "-tstep", "3", "-mf", path, "--no-progress",
                 "--eval-splits", "", "-veps", "-1"]) == 0
    assert json.loads((tmp_path / "m.pt.opt").read_text()) == {"model": "bag", "embedding_size": 16,
                                                                 "text_truncate": 256, "label_truncate": -1,
                                                                 "learning_rate": 0.01, "optimizer": "adam",
                                                                 "task": "babi:1", "multitask_weights": "1",
                                                                 "seed": 0,
                                                                 "context_length": -1, "include_labels": True}
    capsys.readouterr()
    assert main(["eval", "-mf", path, "--no-progress"]) == 0
    out = capsys.readouterr()
    assert f"accelbatch: -mf {path} was trained with -m bag -esz 16 ({path}.opt); using them" in out.err
    assert out.out.splitlines()[2].split()[:2] == ["valid", "1000"]
    assert main(["eval", "-mf", path, "--model=bag", "-esz", "16", "--no-progress"]) == 0  # all given: no note
    assert "was trained with" not in capsys.readouterr().err
    assert main(["eval", "-mf", path, "-m", "memnn", "--no-progress"]) == 2  # given: it wins, and is refused
    assert "its weights are not a MemNNAgent's" in capsys.readouterr().err


def test_what_a_new_user_meets_following_the_readme(tmp_path, monkeypatch, capsys):
    """A module in the current folder (not searched by the accelbatch command) is named with the way out; a
    torch: task with a registered model says it needs -m torch:...; an agent whose build_model returns None
    is told so; display-model without -mf says its model is untrained."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mypkg").mkdir()
    (tmp_path / "mypkg" / "__init__.py").write_text("")
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    assert main(["train", "-t", "mypkg.tasks:MyTeacher", "-tstep", "1", "--no-progress"]) == 2
    assert ("no module named 'mypkg' (mypkg is in the current folder, which the accelbatch command does not "
            "search: run `PYTHONPATH=. accelbatch ...` or `python -m accelbatch ...`)") in capsys.readouterr().err
    assert main(["train", "-t", "torch:torch_task:make_dataset", "-tstep", "1", "--no-progress"]) == 2
    assert "a torch Dataset task is trained by your model, -m torch:pkg.mod:Model" in capsys.readouterr().err

    class NoModel(MemNNAgent):
        def build_model(self):
            return None

    with pytest.raises(TypeError, match=r"NoModel.build_model\(\) returned NoneType: it must return the torch"):
        NoModel(Opts())
    assert main(["display-model", "-n", "1"]) == 0
    assert "no -mf/--model-file: display-model answers with an untrained -m memnn" in capsys.readouterr().err


@pytest.mark.parametrize("datatype", ["train", "train:stream"])
def test_a_training_example_with_eval_labels_only_is_refused(tmp_path, capsys, datatype):
    """Such a row was trained on only when its batch also held labelled rows (not alone, -bs 1): ParlAI
    refuses eval_labels in training data, naming the file and line whether it is loaded or streamed;
    evaluation reads them as before."""
    data = tmp_path / "mixed.jsonl"
    data.write_text('{"text": "q0", "labels": ["a"]}\n{"text": "q1", "labels": ["a"]}\n'
                    '{"text": "q2", "eval_labels": ["b"]}\n')
    assert main(["train", "-t", f"jsonl:{data}", "-dt", datatype, "-m", "repeat_label", "-tstep", "1",
                 "--no-progress", "--eval-splits", "", "-veps", "-1"]) == 2
    err = capsys.readouterr().err
    assert "a training example has eval_labels and no labels (text 'q2')" in err
    assert f"error: {data}: the episode at line 3: a training example" in err
    assert main(["eval", "-t", f"jsonl:{data}", "-m", "repeat_label", "--no-progress"]) == 0


@pytest.mark.parametrize("datatype", ["valid", "test", "train:evalmode"])
def test_train_with_an_evaluation_datatype_is_refused_in_one_line(tmp_path, capsys, datatype):
    """train -dt valid evaluated instead, exit 0, and wrote no -mf: its -ne, -lr and -mf went unheeded."""
    model_file = tmp_path / "m.pt"
    assert main(["train", "-dt", datatype, "-ne", "3", "-mf", str(model_file), "--no-progress"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"-dt/--datatype {datatype}: train trains on a training datatype" in err[0], err
    assert f"accelbatch eval -dt {datatype}" in err[0] and not model_file.exists()


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (a file every write to fails)")
def test_a_report_file_that_cannot_be_written_is_one_line_after_the_model_is_saved(tmp_path, capsys):
    model = tmp_path / "m.pt"
    assert main(["train", "-t", "babi:1", "-tstep", "2", "-bs", "8", "-mf", str(model), "--report-json",
                 "/dev/full", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("accelbatch: error: --report-json /dev/full: cannot be written (No space left on device); "
                       "the run finished (its -mf, if given, is saved): choose another path")
    assert model.is_file()


def test_a_model_file_keeps_its_task_so_a_verb_given_only_mf_works_on_it(tmp_path, capsys):
    """As ParlAI's MODEL.opt keeps the task: eval -mf PATH of a model trained on dialogues scores dialogues
    (it scored babi:1, the default, silently), and -t on the command line wins."""
    from accelbatch.opts import Opts
    from accelbatch.teachers import create_teacher

    path = str(tmp_path / "m.pt")
    assert main(["train", "-t", "dialogues:50", "-m", "bag", "-esz", "8", "-tstep", "2", "-mf", path,
                 "--no-progress", "--eval-splits", "", "-veps", "-1"]) == 0
    capsys.readouterr()
    assert main(["eval", "-mf", path, "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "-t dialogues:50" in out.err.splitlines()[0]
    valid = create_teacher(Opts(task="dialogues:50", datatype="valid")).num_examples()
    assert out.out.splitlines()[2].split()[:2] == ["valid", str(valid)] and valid != 1000
    assert main(["eval", "-mf", path, "-t", "babi:1", "--no-progress"]) == 0
    assert capsys.readouterr().out.splitlines()[2].split()[:2] == ["valid", "1000"]
