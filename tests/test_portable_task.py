"""PATH.opt and a checkpoint keep a file task so that it reads the same data from any folder: its path absolute,
-dp applied. An eval or a resume run from another folder works on the model's data; data since moved is said
naming PATH.opt (the user gave no -t); a task whose teacher is a class of __main__ is said not recordable."""

from __future__ import annotations

import json
import os
import shutil
import signal

import pytest

from accelbatch.cli import main

CANDIDATES = ["red", "green", "blue"]
EXAMPLES = 9  # one example per line, each its own episode
QUIET = ["--no-progress", "--eval-splits", "", "-veps", "-1"]


@pytest.fixture
def folders(tmp_path, monkeypatch):
    """``tmp/a/data/d.jsonl`` (EXAMPLES lines), the current folder ``tmp/a``; ``tmp/b`` another folder."""
    (tmp_path / "a" / "data").mkdir(parents=True)
    (tmp_path / "b").mkdir()
    lines = [json.dumps({"text": f"say {CANDIDATES[n % 3]}", "labels": [CANDIDATES[n % 3]],
                         "label_candidates": CANDIDATES, "episode_done": True}) for n in range(EXAMPLES)]
    (tmp_path / "a" / "data" / "d.jsonl").write_text("\n".join(lines) + "\n")
    monkeypatch.chdir(tmp_path / "a")
    return tmp_path


def test_an_eval_from_another_folder_reads_the_file_the_model_was_trained_on(folders, monkeypatch, capsys):
    model = str(folders / "m.pt")
    assert main(["train", "-t", "jsonl:d.jsonl", "-dp", "data", "-m", "bag", "-esz", "8", "-bs", "3", "-tstep",
                 "2", "-mf", model, *QUIET]) == 0
    data = str(folders / "a" / "data" / "d.jsonl")
    assert json.loads((folders / "m.pt.opt").read_text())["task"] == f"jsonl:{data}"
    monkeypatch.chdir(folders / "b")
    capsys.readouterr()
    assert main(["eval", "-mf", model, "--no-progress"]) == 0
    out = capsys.readouterr()
    assert f"-t jsonl:{data}" in out.err.splitlines()[0]
    assert out.out.splitlines()[2].split()[:2] == ["valid", str(EXAMPLES)]  # every line of the file, once
    os.rename(data, data + ".moved")
    assert main(["eval", "-mf", model, "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"accelbatch: error: {model}.opt: the model's task -t jsonl:{data} reads {data}, which does "
                       "not exist (moved or deleted?); give -t naming the data to use")


def _interrupting_bag() -> type:
    """BagAgent that sends this process a SIGINT (a terminal's Ctrl-C) at its second batch."""
    from accelbatch.models.bag import BagAgent

    class InterruptedAtTheSecondBatch(BagAgent):
        batches = 0

        def batch_act(self, observations):
            type(self).batches += 1
            if type(self).batches == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return super().batch_act(observations)

    return InterruptedAtTheSecondBatch


@pytest.mark.timeout(120)
def test_the_printed_resume_command_works_from_another_folder(folders, monkeypatch, capsys):
    from accelbatch.build import create_world
    from accelbatch.opts import Opts
    from accelbatch.run import run

    model = str(folders / "m.pt")
    opts = Opts(task="jsonl:d.jsonl", datapath="data", model="bag", embedding_size=8, batchsize=3,
                max_train_steps=5, validation_every_n_epochs=-1, eval_splits="", progress=False, model_file=model)
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(opts, agent=_interrupting_bag()), opts)
    shutil.copytree(f"{model}.ckpt", folders / "c" / "m.pt.ckpt")
    monkeypatch.chdir(folders / "b")
    report = folders / "report.json"
    assert main(["train", "-mf", model, "--resume", "--report-json", str(report), *QUIET]) == 0, \
        capsys.readouterr().err
    assert json.loads(report.read_text())["train"]["steps"] == 5
    monkeypatch.chdir(folders / "a")  # the task given again as first given: the same run, resumed
    again = str(folders / "c" / "m.pt")
    assert main(["train", "-mf", again, "--resume", "-t", "jsonl:d.jsonl", "-dp", "data", "--report-json",
                 str(report), *QUIET]) == 0, capsys.readouterr().err
    assert json.loads(report.read_text())["train"]["steps"] == 5


def test_a_task_of_main_is_said_not_recordable_and_left_out(tmp_path, capsys):
    from accelbatch.model_opts import write_model_opts
    from accelbatch.opts import Opts

    model = str(tmp_path / "m.pt")
    write_model_opts(model, Opts(task="__main__:MyTeacher", model="bag"), "bag")
    assert "task" not in json.loads((tmp_path / "m.pt.opt").read_text())
    assert capsys.readouterr().err == (f"accelbatch: -mf {model}: -t __main__:MyTeacher names a class in __main__, "
                                       f"which cannot be recorded in {model}.opt; evaluate the model with -t "
                                       "naming an importable copy of it\n")


def test_a_model_file_whose_opt_file_records_no_task_says_which_task_it_works_on(tmp_path, capsys):
    """A PATH.opt written before the task was kept (or none at all): the verb works on the default task and
    says so, rather than scoring babi:1 silently; a PATH.opt whose task is empty is named."""
    model = str(tmp_path / "m.pt")
    assert main(["train", "-t", "dialogues:50", "-m", "bag", "-esz", "8", "-tstep", "2", "-mf", model,
                 *QUIET]) == 0
    opt_file = tmp_path / "m.pt.opt"
    older = {k: v for k, v in json.loads(opt_file.read_text()).items() if k != "task"}
    opt_file.write_text(json.dumps(older))
    capsys.readouterr()
    assert main(["eval", "-mf", model, "--no-progress"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert f"accelbatch: -mf {model}: {model}.opt does not record the task the model was trained on (written by " \
           "an older accelbatch); working on -t babi:1, the default: give -t to name the task" in err
    assert main(["eval", "-mf", model, "-t", "dialogues:50", "--no-progress"]) == 0
    assert "does not record the task" not in capsys.readouterr().err  # -t given: nothing to say
    opt_file.write_text(json.dumps({**older, "task": ""}))
    assert main(["eval", "-mf", model, "--no-progress"]) == 2
    assert capsys.readouterr().err == (f"accelbatch: error: {model}.opt: cannot be read (its task is '', not a "
                                       "task's name); accelbatch writes this file beside the model file: restore "
                                       "it, or delete it to go on without what it keeps\n")


def test_eval_of_a_model_trained_with_another_optimizer_says_nothing_of_optimizers(tmp_path, capsys):
    model = str(tmp_path / "m.pt")
    assert main(["train", "-m", "bag", "-esz", "8", "-tstep", "2", "-opt", "sgd", "-mf", model, *QUIET]) == 0
    capsys.readouterr()
    assert main(["eval", "-mf", model, "--no-progress"]) == 0
    assert "optimizer" not in capsys.readouterr().err  # eval trains nothing: Adam starting fresh is no news
    assert main(["train", "-mf", model, "-opt", "adam", "-tstep", "1", *QUIET]) == 0
    assert f"--model-file {model}: saved with SGD optimizer state; Adam starts fresh" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_a_resume_whose_data_moved_says_to_put_it_back(folders, capsys):
    from accelbatch.build import create_world
    from accelbatch.opts import Opts
    from accelbatch.run import run

    model = str(folders / "m.pt")
    opts = Opts(task="jsonl:data/d.jsonl", model="bag", embedding_size=8, batchsize=3, max_train_steps=5,
                validation_every_n_epochs=-1, eval_splits="", progress=False, model_file=model)
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(opts, agent=_interrupting_bag()), opts)
    data = str(folders / "a" / "data" / "d.jsonl")
    os.rename(data, data + ".moved")
    capsys.readouterr()
    assert main(["train", "-mf", model, "--resume", *QUIET]) == 2
    assert capsys.readouterr().err.endswith(f"reads {data}, which does not exist (moved or deleted?); put the data "
                                            "back there to resume, or start afresh without --resume\n")
