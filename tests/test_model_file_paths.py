"""Where a training run writes around ``-mf PATH``: a link is followed, so the model, its PATH.opt,
PATH.trainstats, PATH.ckpt and the lock sit together beside the file a save writes (a worse model never replaces
the best one through a link); a dangling link's folder is made, as a missing folder of a plain path is; a
PATH.opt that is a folder is refused before training, not after."""

from __future__ import annotations

import json
import os

import pytest

from accelbatch.cli import main
from accelbatch.opts import Opts

TORCH = ["-t", "torch:torch_task:make_dataset", "-m", "torch:torch_task:Classifier", "-opt", "sgd", "-bs", "4",
         "--no-progress", "--eval-splits", "valid", "-veps", "-1"]


def test_opts_follow_a_link_to_the_file_a_save_writes(tmp_path):
    (tmp_path / "store").mkdir()
    (tmp_path / "m.pt").symlink_to(tmp_path / "store" / "best.pt")  # dangling until the first save
    assert Opts(model_file=str(tmp_path / "m.pt")).model_file == str(tmp_path / "store" / "best.pt")
    assert Opts(model_file=str(tmp_path / "plain.pt")).model_file == str(tmp_path / "plain.pt")


@pytest.mark.slow
def test_a_link_to_the_best_model_keeps_it_against_a_worse_run(tmp_path, capsys):
    store, runs = tmp_path / "store", tmp_path / "runs"
    store.mkdir()
    runs.mkdir()
    best = store / "best.pt"
    assert main(["train", *TORCH, "-mf", str(best), "-tstep", "2"]) == 0
    record = {"metric": "accuracy", "mode": "max", "value": 1.0}  # cannot be beaten
    (store / "best.pt.trainstats").write_text(json.dumps(record))
    before = best.read_bytes()
    (runs / "m.pt").symlink_to(os.path.join("..", "store", "best.pt"))
    capsys.readouterr()
    assert main(["train", *TORCH, "-mf", str(runs / "m.pt"), "-tstep", "3", "-lr", "5"]) == 0
    err = capsys.readouterr().err
    assert f"-mf {best} kept: this run's model validated accuracy" in err, err
    assert best.read_bytes() == before and json.loads((store / "best.pt.trainstats").read_text()) == record
    assert sorted(p.name for p in runs.iterdir()) == ["m.pt"]  # nothing written beside the link


@pytest.mark.slow
def test_a_dangling_link_is_followed_and_its_folder_made(tmp_path, capsys):
    (tmp_path / "links").mkdir()
    (tmp_path / "links" / "m.pt").symlink_to(os.path.join("..", "nowhere", "x.pt"))
    assert main(["train", *TORCH, "-mf", str(tmp_path / "links" / "m.pt"), "-tstep", "2"]) == 0, \
        capsys.readouterr().err
    assert {"x.pt", "x.pt.opt"} <= {p.name for p in (tmp_path / "nowhere").iterdir()}


def test_a_folder_where_the_model_options_go_is_refused_before_training(tmp_path, capsys):
    (tmp_path / "m.pt.opt").mkdir()
    assert main(["train", *TORCH, "-mf", str(tmp_path / "m.pt"), "-tstep", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"{tmp_path / 'm.pt.opt'} is a folder" in err, err
    assert not (tmp_path / "m.pt").exists()  # refused before any training


def test_a_save_to_a_relative_path_whose_working_folder_was_removed_is_one_line(tmp_path, monkeypatch):
    from accelbatch.build import create_world
    from accelbatch.checkpoint import CheckpointError

    agent = create_world(Opts(task="babi:1", model="bag", batchsize=2, progress=False)).get_model_agent()
    (tmp_path / "w").mkdir()
    monkeypatch.chdir(tmp_path / "w")
    (tmp_path / "w").rmdir()
    with pytest.raises(CheckpointError, match="the working folder it is relative to was removed; give "
                                              "-mf/--model-file as an absolute path") as info:
        agent.save("m.pt")
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_a_file_past_the_processs_size_limit_names_that_limit_not_another_path():
    import errno

    from accelbatch.checkpoint import write_error

    error = write_error("m.pt", OSError(errno.EFBIG, "File too large"))
    assert str(error) == ("m.pt: cannot be written (File too large): it passes the largest file this process may "
                          "write (`ulimit -f`); raise that limit")
