"""--resume of a run stopped before its first model file: the checkpoint's model options (-m, -esz, -tr,
--label-truncate) are taken when not given and refused in one line when given otherwise; a save that finds
the disk full ends in one line and leaves no staging files; a bad value in PATH.opt names PATH.opt."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal

import pytest
import torch
from helpers import sigint_at_batch

from accelbatch.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from accelbatch.cli import main

ESZ, STEPS, CUT_AT = 16, 6, 3  # the stopped run's -esz (the default is 64), its steps, the batch of its Ctrl-C
QUIET = ["--no-progress", "--eval-splits", "", "-veps", "-1"]


def _opts(model_file):
    from accelbatch.opts import Opts

    return Opts(task="babi:1", model="bag", embedding_size=ESZ, batchsize=4, max_train_steps=STEPS,
                validation_every_n_epochs=-1, eval_splits="", progress=False, model_file=str(model_file))


def _signalling_bag() -> type:
    """BagAgent that sends this process a SIGINT, as a terminal's Ctrl-C would, at its CUT_AT-th batch."""
    from accelbatch.models.bag import BagAgent

    return sigint_at_batch(BagAgent, CUT_AT)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory):
    """A run of -m bag -esz 16 stopped by Ctrl-C before any validation: PATH.ckpt is saved, PATH is not."""
    from accelbatch.build import create_world
    from accelbatch.run import run

    model_file = tmp_path_factory.mktemp("stopped") / "m.pt"
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(_opts(model_file), agent=_signalling_bag()), _opts(model_file))
    assert not model_file.exists() and (model_file.parent / "m.pt.ckpt").is_dir()
    return model_file


def _copy(stopped, tmp_path):
    shutil.copytree(f"{stopped}.ckpt", tmp_path / "m.pt.ckpt")
    return tmp_path / "m.pt"


def _printed_resume_ends_with_the_uninterrupted_weights(model_file, tmp_path, capsys) -> None:
    """`train -mf PATH --resume` runs to the stopped run's -tstep and ends with the weights of that run never
    stopped (made here with the same options)."""
    from accelbatch.build import create_world
    from accelbatch.run import run

    report = tmp_path / "report.json"
    assert main(["train", "-mf", str(model_file), "--resume", "--report-json", str(report), *QUIET]) == 0, \
        capsys.readouterr().err
    assert json.loads(report.read_text())["train"]["steps"] == STEPS
    whole = _opts(tmp_path / "whole" / "m.pt")
    run(create_world(whole), whole)
    ref, got = (torch.load(p, weights_only=True)["model"] for p in (whole.model_file, model_file))
    assert ref.keys() == got.keys() and all(torch.equal(ref[k], got[k]) for k in ref)


@pytest.mark.timeout(180)
def test_the_printed_resume_command_continues_with_the_checkpoints_model(stopped, tmp_path, capsys):
    """`train -mf PATH --resume` (what the interrupt prints) takes -t, -m, -esz and the run's limit (-tstep)
    from the checkpoint and ends with the weights of the same run never stopped."""
    model_file = _copy(stopped, tmp_path)
    _printed_resume_ends_with_the_uninterrupted_weights(model_file, tmp_path, capsys)
    # with PATH written too, a different -esz is still named with the checkpoint's value
    capsys.readouterr()
    assert main(["train", "-mf", str(model_file), "--resume", "-esz", "32", *QUIET]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"-esz/--embedding-size 32 (checkpoint: {ESZ})" in err[0], err


@pytest.mark.parametrize("given, named", [
    (["-esz", "32"], f"-esz/--embedding-size 32 (checkpoint: {ESZ})"),
    (["-m", "memnn"], "-m/--model 'memnn' (checkpoint: 'bag')"),
    (["-tr", "5"], "-tr/--text-truncate 5 (checkpoint: 256)"),
    (["--label-truncate", "7"], "--label-truncate 7 (checkpoint: -1)"),
], ids=["esz", "model", "text-truncate", "label-truncate"])
def test_a_different_model_option_is_refused_in_one_line(stopped, tmp_path, capsys, given, named):
    model_file = _copy(stopped, tmp_path)
    assert main(["train", "-mf", str(model_file), "--resume", *given, *QUIET]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("accelbatch: error: --resume: ") and named in err[0], err


def test_every_option_given_otherwise_is_named_in_the_one_refusal(stopped, tmp_path, capsys):
    """A model option and a plan option both given otherwise: both in the one line, not one per try."""
    model_file = _copy(stopped, tmp_path)
    # (a -bs above the checkpoint's is judged once the world is built: the data may lower it as it did then)
    assert main(["train", "-mf", str(model_file), "--resume", "-esz", "32", "-bs", "2", *QUIET]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"-esz/--embedding-size 32 (checkpoint: {ESZ})" in err[0], err
    assert "-bs/--batchsize 2 (checkpoint: 4)" in err[0], err


def test_a_resume_with_the_same_command_takes_a_batch_size_lowered_to_the_data(tmp_path, capsys):
    """-bs 4 on one example is run as -bs 1 (and checkpointed so): the same command with --resume goes on."""
    data = tmp_path / "one.jsonl"
    data.write_text(json.dumps({"text": "q", "labels": ["a"], "label_candidates": ["a", "b"],
                                "episode_done": True}) + "\n")
    args = ["train", "-t", f"jsonl:{data}", "-m", "bag", "-bs", "4", "-ne", "2", "-mf", str(tmp_path / "m.pt"),
            *QUIET]
    assert main(args) == 0
    assert main([*args, "--resume"]) == 0, capsys.readouterr().err


def test_the_api_resume_refuses_another_model_before_loading_its_weights(stopped, tmp_path):
    """run(world, opts) with --resume and another -esz: a CheckpointError naming it, not torch's size mismatch."""
    from accelbatch.build import create_world
    from accelbatch.run import run

    opts = _opts(_copy(stopped, tmp_path)).replace(resume=True, embedding_size=32)
    with pytest.raises(CheckpointError, match=rf"-esz/--embedding-size 32 \(checkpoint: {ESZ}\)"):
        run(create_world(opts), opts)


def test_weights_of_another_shape_are_refused_in_one_line(stopped, tmp_path):
    """The same options but an agent that builds other weights (a class given to create_world): the -mf load's
    one-line check of names and shapes, not torch's many-line load_state_dict error."""
    from accelbatch.agents import ModelFileError
    from accelbatch.build import create_world
    from accelbatch.models.memnn import MemNNAgent
    from accelbatch.run import run

    class OtherWeights(MemNNAgent):
        pass

    opts = _opts(_copy(stopped, tmp_path)).replace(resume=True)
    with pytest.raises(ModelFileError, match=r"^--resume: .*m\.pt\.ckpt: cannot load: its weights are not a "
                                             r"MemoryNetwork's") as caught:
        run(create_world(opts, agent=OtherWeights), opts)
    assert "\n" not in str(caught.value)


class _FullDisk(io.RawIOBase):
    """A file whose writes fail with ENOSPC after its first 100 bytes, as on a disk that fills up."""

    def __init__(self, handle):
        self.handle, self.written = handle, 0

    def writable(self) -> bool:
        return True

    def write(self, data) -> int:
        if self.written > 100:
            raise OSError(errno.ENOSPC, "No space left on device")
        self.written += len(data)
        return self.handle.write(data)


def _full_disk(monkeypatch):
    """torch.save into an open file (a checkpoint's tensors.pt) meets a full disk: torch's own zip writer then
    raises its RuntimeError ("unexpected pos") while the OSError is handled; a save to a path (the model file)
    works."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        return real(obj, f if isinstance(f, (str, os.PathLike)) else _FullDisk(f), *args, **kwargs)

    monkeypatch.setattr(torch, "save", save)


def test_a_full_disk_during_a_save_is_one_error_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    model = torch.nn.Linear(2, 2)
    ckdir = save_checkpoint(tmp_path / "m.pt", model=model)
    _full_disk(monkeypatch)
    with pytest.raises(CheckpointError) as caught:
        save_checkpoint(tmp_path / "m.pt", model=model)
    message = str(caught.value)
    assert "\n" not in message and str(tmp_path / "m.pt") in message and "no space left" in message
    assert sorted(os.listdir(ckdir)) == ["MANIFEST.json", "gen-000001"]  # no .tmp-* staging left
    assert load_checkpoint(tmp_path / "m.pt").generation == 1


def test_a_full_disk_during_a_training_save_exits_2_in_one_line(tmp_path, monkeypatch, capsys):
    _full_disk(monkeypatch)
    model_file = tmp_path / "m.pt"
    assert main(["train", "-m", "bag", "-esz", "8", "-tstep", "2", "-mf", str(model_file), *QUIET]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and "no space left" in err[0] and str(model_file) in err[0], err
    assert not [n for n in os.listdir(f"{model_file}.ckpt") if n.startswith(".tmp-")]


def test_a_bad_value_in_the_opt_file_names_that_file(tmp_path, capsys):
    model_file = tmp_path / "m.pt"
    model_file.write_bytes(b"weights")  # never read: the options are refused first
    (tmp_path / "m.pt.opt").write_text(json.dumps({"embedding_size": "big"}))
    assert main(["eval", "-mf", str(model_file)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and f"{model_file}.opt: -esz/--embedding-size: expected an integer, got 'big'" in err[0]


def test_a_limit_given_to_the_resume_sets_the_end_alone(stopped, tmp_path):
    """The stopped run's limit was -tstep 6; a resume given -ne (another limit) ends at -ne alone: the
    checkpoint's -tstep is not taken with it (it would end the run before the -ne asked for)."""
    model_file = _copy(stopped, tmp_path)
    report = tmp_path / "report.json"
    assert main(["train", "-mf", str(model_file), "--resume", "-ne", "0.01", "--report-json", str(report),
                 *QUIET]) == 0
    assert json.loads(report.read_text())["train"]["steps"] > STEPS  # 0.01 epochs of babi:1 at -bs 4: 13 steps


def test_the_resume_keeps_the_runs_logging_interval(stopped, tmp_path):
    """A run logged with -ltim -1 (only at the end): its resume, given only -mf and --resume, logs so too, as
    ParlAI's resume keeps -ltim; one given -ltim takes that."""
    from accelbatch.model_opts import with_model_opts
    from accelbatch.opts import Opts

    stopped_at = load_checkpoint(stopped)
    model_file = tmp_path / "m.pt"
    save_checkpoint(model_file, model=stopped_at.model_state, optimizer=stopped_at.optimizer_state,
                    opts={**stopped_at.opts, "log_every_n_secs": -1.0}, plan=stopped_at.plan,
                    state=stopped_at.state, rng=stopped_at.rng)
    resumed, _ = with_model_opts(Opts(model_file=str(model_file), resume=True), given=set())
    assert resumed.log_every_n_secs == -1.0 and resumed.embedding_size == ESZ
    given, _ = with_model_opts(Opts(model_file=str(model_file), resume=True, log_every_n_secs=5.0),
                               given={"log_every_n_secs"})
    assert given.log_every_n_secs == 5.0


@pytest.mark.timeout(60)
def test_eval_of_a_run_that_has_not_saved_its_model_yet_says_so(stopped, tmp_path, capsys):
    """eval -mf PATH where only PATH.ckpt exists (a run not validated yet): the line names the checkpoint
    and --resume, not only "no such file"."""
    model_file = _copy(stopped, tmp_path)
    assert main(["eval", "-mf", str(model_file), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{model_file}: no such file" in err[0], err
    assert f"has a checkpoint at {model_file}.ckpt" in err[0] and f"-mf {model_file} --resume" in err[0], err


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_the_printed_resume_command_continues_a_run_fed_by_the_async_loader(tmp_path, capsys):
    """The checkpoint of a run with --dataloader-mode async holds the batched loader's position: the printed
    `train -mf PATH --resume` takes the feed's options with the others (it was refused: a per-row clones world
    was built, which cannot take that position) and ends with the weights of the same run never stopped."""
    from accelbatch.build import create_world
    from accelbatch.run import run

    model_file = tmp_path / "m.pt"
    opts = _opts(model_file).replace(dataloader_mode="async")
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(opts, agent=SignalsInTheMainProcess), opts)
    _printed_resume_ends_with_the_uninterrupted_weights(model_file, tmp_path, capsys)


class SignalsInTheMainProcess(_signalling_bag().__base__):  # type: ignore[misc]
    """A BagAgent (module level: the async loader's process imports it) sending a SIGINT at batch CUT_AT."""

    batches = 0

    def step(self, observations, batch):  # the batched front end calls it once per batch
        type(self).batches += 1
        if type(self).batches == CUT_AT:
            os.kill(os.getpid(), signal.SIGINT)
        return super().step(observations, batch)



@pytest.mark.timeout(120)
def test_a_checkpoint_holding_another_optimizers_state_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    """An older accelbatch's -m bag trained with SGD whatever -opt said (its checkpoints record -opt adam):
    resuming one with today's bag (Adam) was a KeyError: 'betas' traceback at the first step."""
    from accelbatch.build import create_world
    from accelbatch.models.bag import BagAgent
    from accelbatch.run import run

    model_file = tmp_path / "m.pt"
    monkeypatch.setattr(BagAgent, "build_optimizer",
                        lambda self, model: torch.optim.SGD(model.parameters(), lr=self.opts.learning_rate))
    batch_act, batches = BagAgent.batch_act, []

    def signalling_batch_act(self, observations):  # a Ctrl-C at batch CUT_AT
        batches.append(len(observations))
        if len(batches) == CUT_AT:
            os.kill(os.getpid(), signal.SIGINT)
        return batch_act(self, observations)

    monkeypatch.setattr(BagAgent, "batch_act", signalling_batch_act)
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(_opts(model_file)), _opts(model_file))
    monkeypatch.undo()
    capsys.readouterr()
    assert main(["train", "-mf", str(model_file), "--resume", *QUIET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"accelbatch: error: --resume: {model_file}.ckpt: its optimizer state is not Adam's "
                       "(-opt adam), so the run cannot continue as it was; start afresh without --resume"), err


@pytest.mark.parametrize("damage, said", [
    ("truncate", "MANIFEST.json: not valid JSON"),
    ("no-generation", "tensors.pt: missing, though"),
], ids=["truncated-manifest", "generation-deleted"])
def test_a_damaged_checkpoint_beside_a_written_model_file_is_named_not_called_another_model(tmp_path, capsys,
                                                                                           damage, said):
    """With PATH written (after a validation or the end), a resume read the damaged checkpoint's options as none,
    built the default memnn and said the bag weights were not a MemNNAgent's."""
    model_file = tmp_path / "m.pt"
    assert main(["train", "-t", "babi:1", "-m", "bag", "-bs", "8", "-tstep", "2", "-mf", str(model_file), *QUIET]) == 0
    ckdir = tmp_path / "m.pt.ckpt"
    if damage == "truncate":
        with open(ckdir / "MANIFEST.json", "r+b") as manifest:
            manifest.truncate(50)
    else:
        shutil.rmtree(next(ckdir.glob("gen-*")))
    capsys.readouterr()
    assert main(["train", "-mf", str(model_file), "--resume", *QUIET]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and said in err[0] and f"delete {ckdir} to start afresh" in err[0], err
    assert "MemNNAgent" not in err[0]


@pytest.mark.timeout(180)
def test_a_run_whose_model_file_was_removed_writes_its_model_there_and_says_so(tmp_path, capsys):
    """-mf's best model removed, then --resume: the next validation was no better than the checkpoint's best, so
    nothing was saved, and the run ended with exit 0, no model file and a report of weights in no file."""
    model = tmp_path / "m" / "model.pt"
    args = ["train", "-t", "babi:1", "-m", "bag", "-esz", str(ESZ), "-bs", "8", "--no-progress", "-mf", str(model)]
    assert main([*args, "-ne", "1", "--eval-splits", "valid"]) == 0  # validated after its epoch: saved
    model.unlink()
    capsys.readouterr()
    report = tmp_path / "report.json"
    # another epoch at a learning rate too small to change the weights: validates no better
    assert main(["train", "-mf", str(model), "--resume", "-ne", "2", "-lr", "1e-12", "--no-progress",
                 "--report-json", str(report)]) == 0
    assert f"-mf {model} is missing (removed after the validation that wrote it?)" in capsys.readouterr().err
    valid = json.loads(report.read_text())["valid"]
    evaluated = main(["eval", "-mf", str(model), "--no-progress", "--report-json", str(tmp_path / "eval.json")])
    assert evaluated == 0 and json.loads((tmp_path / "eval.json").read_text())["valid"]["accuracy"] == \
        valid["accuracy"]
