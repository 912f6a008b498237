"""Kill a training run (SIGKILL at a random point, or SIGTERM) and --resume: nothing lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import wait_for_first_checkpoint, write_qa_episodes
from shared_runs import shared_dir

from accelbatch.checkpoint import load_checkpoint


def _dataset(root):
    write_qa_episodes(root)


def _command(root, model_file, *extra):
    return [sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{root}/data", "-m", "memnn", "-bs", "3",
            "-ne", "2", "-veps", "-1", "--eval-splits", "", "--no-progress", "-ltim", "-1",
            "-mf", str(model_file), *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def _reference(factory, plan) -> tuple:
    """(the data's root, the uninterrupted run's folder: ref/model.pt, ref.json), once per session and plan
    (SIGKILL and SIGTERM cut the same run)."""
    root = shared_dir(factory, "test_resume qa-episodes", _dataset)

    def build(folder):
        subprocess.run(_command(root, folder / "ref" / "model.pt", *plan, "--report-json", str(folder / "ref.json")),
                       env=ENV, check=True, capture_output=True, timeout=240)
    return root, shared_dir(factory, f"test_resume reference {root} {plan}", build)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how, plan", [("SIGKILL", ()), ("SIGTERM", ()),
                                       ("SIGKILL", ("-bs", "1", "-ga", "3", "-di", "2"))],
                         ids=["SIGKILL", "SIGTERM", "SIGKILL-ga3-di2"])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_weights(tmp_path, tmp_path_factory, how, plan):
    """A checkpoint is taken between world steps; a step is the whole combined batch (b x D x R x G), so
    with gradient accumulation the cut never splits an accumulation window and the resume starts the next."""
    root, ref_dir = _reference(tmp_path_factory, plan)
    reference = ref_dir / "ref" / "model.pt"

    model, log = tmp_path / "cut" / "model.pt", tmp_path / "cut" / "log.jsonl"
    proc = subprocess.Popen(_command(root, model, "--save-every-n-secs", "0.01", "--metrics-log", str(log), *plan),
                            env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_first_checkpoint(proc, model, max_delay_s=0.4)
    proc.send_signal(getattr(signal, how))
    _, err = proc.communicate(timeout=60)
    if how == "SIGTERM":
        assert proc.returncode == 130 and "continue with --resume" in err
    steps_at_cut = load_checkpoint(str(model)).state["train"]["steps"]
    assert steps_at_cut > 0

    resumed = subprocess.run(_command(root, model, "--resume", *plan, "--report-json",
                                      str(tmp_path / "cut.json")), env=ENV, capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = _weights(reference), _weights(model)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    # the train row covers the examples trained before the cut (kept in the checkpoint) and after it
    ref_train, cut_train = (json.loads((d / f"{n}.json").read_text())["train"]
                            for d, n in ((ref_dir, "ref"), (tmp_path, "cut")))
    assert cut_train["exs"] == ref_train["exs"]
    for key in ("loss", "accuracy"):
        assert cut_train[key] == pytest.approx(ref_train[key], abs=1e-6), key
    # and so does the --metrics-log (the resume takes it from the checkpoint): a record for each window of
    # steps, none written twice (a kill after a record, before the checkpoint that holds its steps) and none
    # left out (a kill after a checkpoint, before the record of its steps)
    records = [json.loads(line) for line in log.read_text().splitlines()]
    steps = [r["step"] for r in records if r["split"] == "train"]
    assert steps == sorted(set(steps)) and steps[-1] == cut_train["steps"], steps
    assert sum(r["exs"] for r in records if r["split"] == "train") == cut_train["exs"]


def test_a_tampered_checkpoint_is_refused_with_a_clear_message(tmp_path, capsys):
    from accelbatch.cli import main

    _dataset(tmp_path)
    model = tmp_path / "m" / "model.pt"
    assert main(["train", "-t", f"jsonl:{tmp_path}/data", "-bs", "3", "-tstep", "4", "--save-every-n-secs",
                 "0.001", "-mf", str(model), "--no-progress", "--eval-splits", "", "-veps", "-1"]) == 0
    state = next((tmp_path / "m" / "model.pt.ckpt").glob("gen-*")) / "state.json"
    state.write_text(state.read_text().replace('"steps": 4', '"steps": 5'))
    assert main(["train", "-t", f"jsonl:{tmp_path}/data", "-bs", "3", "-tstep", "8", "--resume",
                 "-mf", str(model), "--no-progress", "--eval-splits", "", "-veps", "-1"]) == 2
    err = capsys.readouterr().err
    assert "state.json" in err and "--resume" in err


def _signalling_memnn(validation: int) -> type:
    """MemNNAgent that sends this process a SIGINT, as a terminal's Ctrl-C would, at the 5th batch of its
    ``validation``-th validation (batches without training labels after training ones begin one)."""
    from accelbatch.models.memnn import MemNNAgent

    seen = {"validations": 0, "batches": 0, "training": True}

    class SignalsInAValidation(MemNNAgent):
        def batch_act(self, observations):
            training = any("labels" in obs for obs in observations)
            if seen["training"] and not training:
                seen["validations"], seen["batches"] = seen["validations"] + 1, 0
            seen["training"] = training
            seen["batches"] += not training
            if seen["validations"] == validation and seen["batches"] == 5:
                os.kill(os.getpid(), signal.SIGINT)
            return super().batch_act(observations)

    return SignalsInAValidation


@pytest.mark.timeout(180)
@pytest.mark.parametrize("validation", [1, 2], ids=["mid-training", "at-the-end-of-training"])
@pytest.mark.slow
def test_a_stop_during_a_validation_saves_and_the_resume_validates_again(tmp_path, validation):
    """Ctrl-C while training validates (at 0.5 epochs, or at 1.0, the last step's): the validation stops at
    its next step, the run saves its checkpoint and ends; --resume runs that validation again (and then
    trains on, or ends) with the weights and report of a run never stopped."""
    from accelbatch.build import create_world
    from accelbatch.opts import Opts
    from accelbatch.run import run

    opts = Opts(task="babi:1", model="memnn", batchsize=32, num_epochs=1, validation_every_n_epochs=0.5,
                model_file=str(tmp_path / "cut" / "m.pt"), eval_splits="valid", progress=False,
                embedding_size=16, metrics_log=str(tmp_path / "cut.jsonl"))
    whole = opts.replace(model_file=str(tmp_path / "whole" / "m.pt"), metrics_log=str(tmp_path / "whole.jsonl"))
    reference = run(create_world(whole), whole)
    world = create_world(opts, agent=_signalling_memnn(validation))
    with pytest.raises(KeyboardInterrupt, match="SIGINT: the validation was cut short .* checkpoint saved"):
        run(world, opts)
    resumed = run(create_world(opts.replace(resume=True)), opts.replace(resume=True))
    assert resumed["valid"] == {**reference["valid"], "time_s": resumed["valid"]["time_s"]}
    saved = [torch.load(tmp_path / d / "m.pt", weights_only=True)["model"] for d in ("whole", "cut")]
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])
    records = [json.loads(line) for line in (tmp_path / "cut.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["split"] == "valid"] == [79, 157, 157]  # 0.5, 1.0, final


@pytest.mark.timeout(120)
def test_a_finished_run_leaves_a_checkpoint_whose_resume_only_evaluates(tmp_path):
    """Training's end is always checkpointed (-stim -1: only at the end): a stop during the final evaluation,
    or a later --resume, goes on from the end of training instead of retraining from an older position."""
    from accelbatch.build import create_world
    from accelbatch.opts import Opts
    from accelbatch.run import run

    opts = Opts(task="babi:1", model="memnn", batchsize=32, max_train_steps=20, model_file=str(tmp_path / "m.pt"),
                eval_splits="valid", progress=False, embedding_size=16, validation_every_n_epochs=-1)
    first = run(create_world(opts), opts)
    weights = (tmp_path / "m.pt").read_bytes()
    again = run(create_world(opts.replace(resume=True)), opts.replace(resume=True))
    assert again["train"]["steps"] == first["train"]["steps"] == 20
    assert again["valid"] == {**first["valid"], "time_s": again["valid"]["time_s"]}
    assert (tmp_path / "m.pt").read_bytes() == weights


@pytest.mark.timeout(120)
def test_a_stop_in_the_final_evaluation_says_the_resume_evaluates(tmp_path):
    """Ctrl-C in the final evaluation of a training saved to -mf: the line says the training is saved and
    names the --resume that runs the evaluations; that resume reports what the run never stopped reports."""
    from accelbatch.build import create_world
    from accelbatch.opts import Opts
    from accelbatch.run import run

    write_qa_episodes(tmp_path)
    data = tmp_path / "data" / "train.jsonl"
    opts = Opts(task=f"jsonl:{data}", model="memnn", batchsize=4, max_train_steps=8, eval_splits="valid",
                model_file=str(tmp_path / "m.pt"), progress=False, embedding_size=16, validation_every_n_epochs=-1)
    whole = run(create_world(opts.replace(model_file=None)), opts.replace(model_file=None))
    with pytest.raises(KeyboardInterrupt) as stopped:  # the first evaluation is the final one: no -veps
        run(create_world(opts, agent=_signalling_memnn(1)), opts)
    served = len(data.read_text().splitlines())
    assert str(stopped.value).startswith(f"SIGINT: the valid evaluation stopped after 20 of {served} examples; no "
                                         f"report; the training is saved: --resume -mf {tmp_path / 'm.pt'} runs "
                                         "the final evaluations"), stopped.value  # 5 batches of 4 rows
    resumed = run(create_world(opts.replace(resume=True)), opts.replace(resume=True))
    assert resumed["valid"] == {**whole["valid"], "time_s": resumed["valid"]["time_s"]}


def test_a_resume_says_a_changed_option_once(tmp_path, capsys):
    """With a checkpoint to resume, what loading -mf changed is not said: the resume says it (a new -lr, once)
    or refuses it (-opt) in one line, where two lines said it twice, or accepted then refused it."""
    from accelbatch.cli import main

    base = ["train", "-mf", str(tmp_path / "m.pt"), "-esz", "16", "--no-progress", "--eval-splits", "", "-veps", "-1"]
    assert main([*base, "-tstep", "3"]) == 0
    capsys.readouterr()
    assert main([*base, "-tstep", "5", "--resume", "-lr", "0.02"]) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "0.02" in line]
    assert said == ["accelbatch: --resume: continuing with -lr 0.02 (the checkpoint's optimizer had 0.01)"]
    assert main([*base, "-tstep", "7", "--resume", "-opt", "sgd"]) == 2
    assert capsys.readouterr().err.startswith("accelbatch: error: --resume: ")
