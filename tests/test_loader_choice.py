"""Loader options (--num-workers, --dataloader-mode, --dynamic-batching) never change what a ParlAI-style
agent or teacher does: the loader is used only where it reproduces their messages, else refused or left."""

from __future__ import annotations

import pytest
import torch
from helpers import RecordingAgent

from accelbatch.agents import TorchAgent
from accelbatch.build import create_world
from accelbatch.loader_world import LoaderWorld
from accelbatch.opts import OptionError, Opts

TEACHER = "helpers:ActOverridingTeacher"


def _texts_seen(**loader_options) -> list[str]:
    opts = Opts(task=TEACHER, datatype="train:ordered", batchsize=2, **loader_options)
    world = create_world(opts, agent=RecordingAgent)
    assert not isinstance(world, LoaderWorld)
    for _ in range(6):
        world.parley()
    seen = list(world.get_model_agent().seen)
    world.shutdown()
    return seen


@pytest.mark.parametrize("loader_options", [dict(num_workers=2), dict(dataloader_mode="async")],
                         ids=["workers", "async"])
def test_an_observe_act_agent_sees_what_it_sees_without_loader_options(loader_options, capsys):
    plain = _texts_seen()
    assert plain and all(t.startswith("acted:") for t in plain)  # the teacher's own act() ran
    assert _texts_seen(**loader_options) == plain
    assert "built in the main process (same results)" in capsys.readouterr().err


class TextsAgent(TorchAgent):
    """A TorchAgent with the base observe (the loader could build its batches): records what it vectorizes."""

    def __init__(self, opts, shared=None):
        super().__init__(opts, shared)
        self.texts = shared["texts"] if shared else []

    def share(self):
        return {**super().share(), "texts": self.texts}

    def build_model(self):
        return _Scale()

    def vectorize(self, obs):
        self.texts.append(obs.get("text"))
        return obs

    def batchify(self, observations):
        return {"x": torch.ones(len(observations), 1)}

    def replies(self, outputs, observations):
        return [{"text": ""} for _ in observations]


class _Scale(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.ones(1))

    def forward(self, batch):
        return {"loss": (self.w * batch["x"]).mean(), "y": batch["x"] * self.w}


def test_a_teacher_that_overrides_act_keeps_the_clones_under_worker_options(capsys):
    """A TorchAgent with the base observe would take the loader: the teacher's act() must still run."""
    opts = Opts(task=TEACHER, datatype="train:ordered", batchsize=2, num_workers=2)
    world = create_world(opts, agent=TextsAgent)
    assert not isinstance(world, LoaderWorld)
    for _ in range(3):
        world.parley()
    texts = world.get_model_agent().texts
    assert len(texts) == 6 and all(t.startswith("acted:") for t in texts)
    assert "the task's teacher overrides act() or observe()" in capsys.readouterr().err
    world.shutdown()


def test_dynamic_batching_refuses_a_teacher_that_overrides_act():
    opts = Opts(task=TEACHER, datatype="train", batchsize=4, dynamic_batching="full")
    with pytest.raises(OptionError, match="ActOverridingTeacher, which overrides act"):
        create_world(opts, agent=TextsAgent)
