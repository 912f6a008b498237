"""An agent builds its optimizer only for training, as ParlAI's agents do: eval, display-model and interactive
run without one, so they start without torch's first-optimizer import of torch._dynamo (1.7 s of CPU)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from accelbatch.build import create_world
from accelbatch.models.bag import BagAgent
from accelbatch.models.memnn import MemNNAgent
from accelbatch.opts import Opts
from accelbatch.run import run


@pytest.mark.parametrize("agent", [MemNNAgent, BagAgent])
def test_only_a_training_agent_has_an_optimizer(agent):
    assert isinstance(agent(Opts(task="babi:1", datatype="train")).optimizer, torch.optim.Optimizer)
    assert isinstance(agent(Opts(task="babi:1", datatype="train:stream")).optimizer, torch.optim.Optimizer)
    for datatype in ("valid", "test", "train:evalmode"):
        assert agent(Opts(task="babi:1", datatype=datatype)).optimizer is None, datatype


def test_an_evaluation_of_a_trained_model_file_scores_what_training_saved(tmp_path):
    """The model file holds optimizer state; an evaluation agent (no optimizer) loads the weights alone and
    scores what the training run's final evaluation scored."""
    model_file = str(tmp_path / "m.pt")
    opts = Opts(task="babi:1", model="memnn", batchsize=8, max_train_steps=20, model_file=model_file,
                eval_splits="valid", validation_every_n_epochs=-1, progress=False)
    trained = run(create_world(opts), opts)
    evaluation = Opts(task="babi:1", model="memnn", batchsize=8, model_file=model_file, datatype="valid",
                      progress=False)
    world = create_world(evaluation)
    assert world.get_model_agent().optimizer is None
    scored = run(world, evaluation)["valid"]
    assert {k: v for k, v in scored.items() if k != "time_s"} == {k: v for k, v in trained["valid"].items()
                                                                  if k != "time_s"}


SCRIPT = """
import sys
from accelbatch.cli import main
code = main(sys.argv[1:])
print("dynamo" if "torch._dynamo" in sys.modules else "no dynamo", code)
"""


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_eval_and_display_model_start_without_importing_torch_dynamo(tmp_path):
    """In a fresh interpreter: eval and display-model never import torch._dynamo; a training step does (its
    optimizer), which shows the check can tell."""
    def imported(*argv: str) -> str:
        done = subprocess.run([sys.executable, "-c", SCRIPT, *argv], cwd=tmp_path, capture_output=True, text=True,
                              timeout=100)
        return done.stdout.strip().splitlines()[-1] if done.stdout.strip() else done.stderr[-2000:]
    small = ["-t", "babi:1", "-m", "bag", "--no-progress"]
    assert imported("eval", *small, "-bs", "64") == "no dynamo 0"
    assert imported("display-model", *small, "-n", "1") == "no dynamo 0"
    assert imported("train", *small, "-tstep", "1", "--eval-splits", "", "-veps", "-1") == "dynamo 0"
