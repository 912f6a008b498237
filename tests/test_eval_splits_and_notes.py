"""The splits a training run evaluates (--eval-splits: a train split scored once, in order; every split's data
checked before the first step), and what a model file's PATH.opt gives a later run: the learning rate a
continued training keeps, the shaping options of --init-model, and no learning-rate note where nothing trains."""

from __future__ import annotations

import json

import pytest
import torch

from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.opts import OptionError, Opts
from accelbatch.run import evaluate

EXAMPLES = 11  # the lines of the file below, one example each
CANDIDATES = ["hi", "bye", "what", "fine", "good"]


@pytest.fixture
def data(tmp_path):
    """A jsonl file of EXAMPLES examples (episodes of 1 and 2 turns), each with label candidates."""
    lines = []
    for n in range(EXAMPLES):
        label = CANDIDATES[n % len(CANDIDATES)]
        lines.append(json.dumps({"text": f"say {label} {n}", "labels": [label], "label_candidates": CANDIDATES,
                                 "episode_done": n % 3 != 1}))
    path = tmp_path / "d1.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _train(data, *args: str) -> list[str]:
    return ["train", "-t", f"jsonl:{data}", "-m", "bag", "-bs", "2", "-tstep", "2", "--no-progress", *args]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("split, evaluated", [("train", "train:evalmode"), ("train:ordered", "train:evalmode"),
                                              ("train:stream", "train:evalmode:stream")])
def test_a_train_split_in_eval_splits_is_scored_once_in_order(data, tmp_path, capsys, split, evaluated):
    """It looped forever (the train datatype repeats its data) and the report was lost: it is scored as
    ParlAI's train:evalmode, under that name (the train row keeps the training's own numbers)."""
    report_path = tmp_path / "r.json"
    assert main(_train(data, "--eval-splits", split, "--report-json", str(report_path))) == 0
    report = json.loads(report_path.read_text())
    assert report[evaluated]["exs"] == EXAMPLES
    assert report["train"]["steps"] == 2 and report["train"]["exs"] == 4
    assert evaluated in capsys.readouterr().out


@pytest.mark.timeout(60)
def test_evaluate_refuses_a_training_world_and_scores_train_evalmode_once(data):
    """evaluate() of a world serving -dt train never ended (it trained on the repeating data)."""
    opts = Opts(task=f"jsonl:{data}", model="bag", batchsize=2, progress=False)
    world = create_world(opts.replace(datatype="train:stream"))
    try:
        with pytest.raises(OptionError, match=r"^evaluate\(world\): the world serves -dt train:stream, .* "
                                              r"datatype='train:evalmode:stream' to score the training data once"):
            evaluate(world)
    finally:
        world.shutdown()
    world = create_world(opts.replace(datatype="train:evalmode"))
    try:
        assert evaluate(world)["exs"] == EXAMPLES
    finally:
        world.shutdown()


def test_an_unknown_eval_split_is_refused_when_the_options_are_read(data, tmp_path, capsys):
    """It was found after the training, named as -dt/--datatype, and no report was printed."""
    with pytest.raises(OptionError, match=r"^--eval-splits: 'foo' is not a split; give comma-separated "):
        Opts(eval_splits="valid, foo")
    model = tmp_path / "m.pt"
    assert main(_train(data, "--eval-splits", "valid,foo", "-mf", str(model))) == 2
    err = capsys.readouterr().err
    assert err.startswith("accelbatch: error: --eval-splits: 'foo' is not a split") and err.count("\n") == 1
    assert not model.exists()  # nothing trained


def test_a_split_without_data_is_named_before_training(data, tmp_path, capsys):
    """A folder with train and valid but no test trained and saved, then failed at the test evaluation with
    no report; now the run stops before its first step, naming the file and the option."""
    folder = tmp_path / "fold"
    folder.mkdir()
    for name in ("train", "valid"):
        (folder / f"{name}.jsonl").write_text(data.read_text())
    model = tmp_path / "m.pt"
    args = ["train", "-t", f"jsonl:{folder}", "-m", "bag", "-bs", "2", "-tstep", "2", "--no-progress"]
    assert main([*args, "-mf", str(model)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"accelbatch: error: --eval-splits valid,test: test: {folder}/test.jsonl: no such file; check "
                   "the path given to -t, or leave test out (--eval-splits valid)"]
    assert not model.exists()
    # not validating during training: the valid split is checked as well
    assert main([*args, "-veps", "-1", "--eval-splits", "test,valid", "-mf", str(model)]) == 2
    assert "test: " in capsys.readouterr().err and not model.exists()
    assert main([*args, "--eval-splits", "valid", "-mf", str(model)]) == 0
    assert model.exists()


def _saved_lr(path) -> float:
    return torch.load(path, weights_only=True)["optimizer"]["param_groups"][0]["lr"]


def test_a_continued_training_keeps_the_files_learning_rate_unless_given(data, tmp_path, capsys):
    """PATH.opt keeps -lr: a continued `train -mf PATH` without -lr went on with the default 0.01; eval, which
    trains nothing, said it was 'continuing with -lr 0.01'."""
    model = str(tmp_path / "g.pt")
    once = ["-mf", model, "-veps", "-1", "--eval-splits", ""]
    assert main(_train(data, *once, "-lr", "0.002")) == 0
    assert json.loads((tmp_path / "g.pt.opt").read_text())["learning_rate"] == 0.002
    capsys.readouterr()
    assert main(["eval", "-t", f"jsonl:{data}", "-mf", model, "--no-progress"]) == 0
    assert "-lr" not in capsys.readouterr().err
    assert main(_train(data, *once)) == 0
    err = capsys.readouterr().err
    assert f"accelbatch: -mf {model} was trained with -lr 0.002 ({model}.opt); using them" in err
    assert "continuing with -lr" not in err and _saved_lr(model) == 0.002
    assert main(_train(data, *once, "-lr", "0.005")) == 0  # given: it wins, and is said
    assert f"--model-file {model}: continuing with -lr 0.005 (the file's optimizer had 0.002)" in \
        capsys.readouterr().err
    assert _saved_lr(model) == 0.005
    assert json.loads((tmp_path / "g.pt.opt").read_text())["learning_rate"] == 0.005


def test_a_continued_training_keeps_the_files_optimizer_unless_given(data, tmp_path, capsys):
    """PATH.opt keeps -opt as ParlAI's MODEL.opt does: `train -mf PATH` alone after an SGD run went on with a
    fresh Adam (the default) at the SGD run's -lr."""
    model = str(tmp_path / "s.pt")
    once = ["-mf", model, "-veps", "-1", "--eval-splits", ""]
    assert main(_train(data, *once, "-opt", "sgd", "-lr", "0.5")) == 0
    capsys.readouterr()
    assert main(_train(data, *once)) == 0
    err = capsys.readouterr().err
    assert f"accelbatch: -mf {model} was trained with -lr 0.5 -opt sgd ({model}.opt); using them" in err
    assert "starts fresh" not in err
    assert "momentum" in torch.load(model, weights_only=True)["optimizer"]["param_groups"][0]  # still SGD's
    assert main(_train(data, *once, "-opt", "adam")) == 0  # given: it wins, and is said
    assert "Adam starts fresh" in capsys.readouterr().err
    assert "betas" in torch.load(model, weights_only=True)["optimizer"]["param_groups"][0]


def test_init_model_takes_the_shaping_options_of_its_opt_file(data, tmp_path, capsys):
    """--init-model FILE of a bag model failed (the default -m memnn cannot load its weights): FILE.opt's -m
    and -esz are used as -mf's are, unless the command line gives them."""
    start = tmp_path / "b.pt"
    assert main(_train(data, "-esz", "16", "-mf", str(start), "--eval-splits", "")) == 0
    capsys.readouterr()
    args = ["train", "-t", f"jsonl:{data}", "-bs", "2", "-tstep", "2", "--no-progress", "--eval-splits", "",
            "--init-model", str(start)]
    model = tmp_path / "im" / "x.pt"
    assert main([*args, "-mf", str(model)]) == 0
    assert (f"accelbatch: --init-model {start} was trained with -m bag -esz 16 ({start}.opt); using them"
            in capsys.readouterr().err)
    assert json.loads((tmp_path / "im" / "x.pt.opt").read_text()) == {"model": "bag", "embedding_size": 16,
                                                                       "text_truncate": 256, "label_truncate": -1,
                                                                       "learning_rate": 0.01, "optimizer": "adam",
                                                                       "task": f"jsonl:{data}",
                                                                       "multitask_weights": "1",
                                                                       "context_length": -1, "include_labels": True,
                                                                       "seed": 0}
    assert main([*args, "-m", "memnn", "-mf", str(tmp_path / "y.pt")]) == 2  # given: it wins, and is refused
    assert "its weights are not a MemNNAgent's" in capsys.readouterr().err
