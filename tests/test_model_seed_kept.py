"""A model file keeps the --seed it was trained with: the generated tasks (dialogues, reverse) draw their data
by it, so eval, display-model and interactive given only -mf score the data the model was made for (they
scored the default seed's data: valid loss 3.2822 where the training's own valid row said 3.2948)."""

from __future__ import annotations

import json

import pytest
from helpers import eval_valid

from accelbatch.cli import main

QUIET = ["--no-progress"]
SCORES = ("accuracy", "f1", "loss", "exs")


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[str, dict]:
    """A bag model trained on dialogues:60 drawn with --seed 7; its final valid report."""
    folder = tmp_path_factory.mktemp("seed")
    path, report = str(folder / "m.pt"), folder / "train.json"
    assert main(["train", "-t", "dialogues:60", "-m", "bag", "-tstep", "6", "--seed", "7", "-mf", path,
                 "--eval-splits", "valid", "-veps", "-1", "--report-json", str(report), *QUIET]) == 0
    return path, json.loads(report.read_text())["valid"]




@pytest.mark.timeout(180)
def test_eval_given_only_mf_scores_the_data_of_the_models_seed(trained, tmp_path, capsys):
    path, valid = trained
    assert json.loads(open(f"{path}.opt").read())["seed"] == 7
    scores, err = eval_valid(path, tmp_path, capsys)
    assert scores == {k: valid[k] for k in SCORES}
    assert "--seed 7" in err and "was trained with" in err
    other, err = eval_valid(path, tmp_path, capsys, "--seed", "0")  # given, it wins: another seed's valid split
    assert other != scores and "--seed" not in err


@pytest.mark.timeout(180)
def test_a_model_file_without_its_opt_file_is_said_to_run_on_defaults(trained, tmp_path, capsys):
    """Without PATH.opt nothing says what the model was trained with: eval ran on the defaults silently."""
    path, _ = trained
    bare = tmp_path / "bare.pt"
    bare.write_bytes(open(path, "rb").read())
    _, err = eval_valid(str(bare), tmp_path, capsys, "-m", "bag", "-t", "dialogues:60")
    assert f"-mf {bare}: no {bare}.opt beside it" in err and "running with the options given and the defaults" in err
    _, err = eval_valid(path, tmp_path, capsys)
    assert "beside it" not in err


@pytest.mark.timeout(180)
def test_eval_of_an_untrained_model_says_so(trained, tmp_path, capsys):
    """display-model and interactive said it; eval scored an untrained model silently."""
    path, _ = trained
    _, err = eval_valid(path, tmp_path, capsys)
    assert "untrained" not in err
    capsys.readouterr()
    assert main(["eval", "-t", "dialogues:60", "-m", "bag", *QUIET]) == 0
    assert "no -mf/--model-file: eval scored an untrained -m bag" in capsys.readouterr().err
    assert main(["eval", "-t", "dialogues:60", "-m", "repeat_label", *QUIET]) == 0  # nothing to train: no note
    assert "untrained" not in capsys.readouterr().err
