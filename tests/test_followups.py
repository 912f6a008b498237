"""Hogwild on a batch plan trains -ne N passes exactly; --resume continues with the interrupted run's -lr;
display-model -dt train evaluates (no learning-rate note)."""

from __future__ import annotations

import json
import os

import pytest

from accelbatch.build import create_world
from accelbatch.checkpoint import load_checkpoint
from accelbatch.cli import main
from accelbatch.opts import Opts
from accelbatch.run import run


@pytest.fixture
def two_lengths_file(write_jsonl):
    """43 examples of 3 tokens, then 22 of 10. With -nt 2 process r serves examples r, r + 2, ...: process 0
    22 short and 11 long, process 1 21 and 11. Each process plans buckets (2 buckets, 30-token budget: at most
    10 rows of 3 tokens, 3 of 10) on its own share. Process 0: 22 short in 3 batches of 7 (21), the one left
    over spilled to the long bucket, 12 long in 4 batches of 3: 33 examples in 7 steps, none left out.
    Process 1: 21 short in 3 batches of 7, 11 long in 3 batches of 3 and a partial one of 2, left out: 30 of
    32 in 6 steps."""
    return write_jsonl([{"text": " ".join(["w"] * n), "labels": ["a"], "label_candidates": ["a", "b"]}
                        for n in [3] * 43 + [10] * 22])


HOGWILD = dict(model="bag", batchsize=6, num_buckets=2, max_batch_tokens=30, progress=False, eval_splits="",
               validation_every_n_epochs=-1, embedding_size=8, seed=3, dynamic_batching="buckets", numthreads=2)


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_hogwild_on_buckets_trains_one_pass_with_ne_1(two_lengths_file):
    """-ne 1 counted trained examples (83: 1.28 passes, no dropped_exs reported): it is one pass over the data,
    each process's shard once, its dropped examples with it (33 + 30 trained, 2 left out, 7 + 6 steps)."""
    opts = Opts(task=f"jsonl:{two_lengths_file}", num_epochs=1, **HOGWILD)
    train = run(create_world(opts), opts)["train"]
    assert (train["exs"], train["dropped_exs"], train["steps"], train["epochs"]) == (63, 2, 13, 1.0)
    assert train["exs"] + train["dropped_exs"] == 65


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.slow
def test_hogwild_passes_continue_after_a_restore(two_lengths_file):
    """passes() of a HogwildWorld on a batch plan is its processes' passes, and a restored one's is where the
    saved one was: 9 steps, k of process 0 (33 examples, 7 steps a pass) and 9 - k of process 1 (32, 6 steps),
    neither past its pass while the other is in it."""
    opts = Opts(task=f"jsonl:{two_lengths_file}", **HOGWILD)
    world = create_world(opts)
    try:
        for _ in range(9):
            world.parley()
        state = world.state_dict()  # every parley done
        assert sum(world.exs_per_process()) == world.get_total_exs()
        at = world.passes()
    finally:
        world.shutdown()
    assert at in [pytest.approx((33 * k / 7 + 32 * (9 - k) / 6) / 65) for k in range(3, 8)]
    again = create_world(opts)
    try:
        assert again.passes() == 0.0
        again.load_state_dict(state)
        assert again.passes() == at
    finally:
        again.shutdown()


@pytest.fixture
def data(write_jsonl):
    return write_jsonl([{"text": f"say {w} {n}", "labels": [w], "label_candidates": ["hi", "bye", "fine"]}
                        for n, w in enumerate(["hi", "bye", "fine"] * 4)])


def _train(data, model, *args: str) -> list[str]:
    return ["train", "-t", f"jsonl:{data}", "-m", "bag", "-esz", "8", "-bs", "2", "--no-progress", "-veps", "-1",
            "--eval-splits", "", "-mf", str(model), *args]


def _checkpoint_lr(model) -> float:
    return load_checkpoint(str(model)).optimizer_state["param_groups"][0]["lr"]


@pytest.mark.timeout(120)
def test_a_resume_continues_with_the_runs_learning_rate(data, tmp_path, capsys):
    """--resume without -lr went on with the default 0.01 (and said so) after a run with -lr 0.002: it continues
    with the checkpoint's, as ParlAI's resume does, unsaid; a -lr given still wins and is said once."""
    model = tmp_path / "m.pt"
    assert main(_train(data, model, "-tstep", "2", "-lr", "0.002")) == 0
    os.remove(model)  # as a run stopped before its first save of the model file: only the checkpoint is left
    os.remove(f"{model}.opt")
    assert _checkpoint_lr(model) == 0.002
    capsys.readouterr()
    assert main(_train(data, model, "-tstep", "4", "--resume")) == 0
    assert "-lr" not in capsys.readouterr().err
    assert load_checkpoint(str(model)).state["train"]["steps"] == 4 and _checkpoint_lr(model) == 0.002
    assert json.loads((tmp_path / "m.pt.opt").read_text())["learning_rate"] == 0.002
    assert main(_train(data, model, "-tstep", "6", "--resume", "-lr", "0.005")) == 0
    said = [line for line in capsys.readouterr().err.splitlines() if "-lr" in line]
    assert said == ["accelbatch: --resume: continuing with -lr 0.005 (the checkpoint's optimizer had 0.002)"]
    assert _checkpoint_lr(model) == 0.005


@pytest.mark.timeout(120)
@pytest.mark.parametrize("datatype", ["train", "valid"])
def test_display_model_on_the_train_split_takes_no_learning_rate(data, tmp_path, capsys, datatype):
    """display-model -dt train said the model 'was trained with -lr 0.002 ... using them': it evaluates, so
    only the model's shaping options are taken (here none differ from the command line's)."""
    model = tmp_path / "m.pt"
    assert main(_train(data, model, "-tstep", "2", "-lr", "0.002")) == 0
    capsys.readouterr()
    assert main(["display-model", "-t", f"jsonl:{data}", "-m", "bag", "-esz", "8", "-mf", str(model),
                 "-dt", datatype, "-n", "1", "--no-progress"]) == 0
    out = capsys.readouterr()
    assert "was trained with" not in out.err and "-lr" not in out.err
    assert out.out.strip()


def test_a_generator_trained_with_its_own_truncation_reopens_from_mf_alone(tmp_path, capsys):
    """-tr and --label-truncate size the generator's position table: PATH.opt keeps them, so eval -mf alone
    rebuilds the same shapes (it was refused: positions [64, 8] in the file, [256, 8] built)."""
    model = str(tmp_path / "g.pt")
    assert main(["train", "-m", "transformer/generator", "-t", "reverse:200", "-esz", "8", "-tr", "64",
                 "--label-truncate", "12", "-tstep", "2", "--eval-splits", "", "-veps", "-1", "--no-progress",
                 "-mf", model]) == 0
    capsys.readouterr()
    assert main(["eval", "-t", "reverse:200", "--skip-generation", "--no-progress", "-mf", model]) == 0
    assert f"-mf {model} was trained with -m transformer/generator -esz 8 -tr 64 --label-truncate 12" in \
        capsys.readouterr().err
