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


@pytest.mark.multiprocess   # async starts the accessor's process server
@pytest.mark.timeout(120)
@pytest.mark.parametrize("loader_options,remedy", [(dict(num_workers=2), "--num-workers 0 builds"),
                                                   (dict(dataloader_mode="async"), "--dataloader-mode sync builds")],
                         ids=["workers", "async"])
def test_data_processes_that_can_only_take_the_models_cores_are_named(loader_options, remedy, capsys,
                                                                       monkeypatch):
    """On the CPU, torch's threads covering every usable core leave a data process only the model's cores:
    one line says so (the world is built, nothing refused); with a core to spare nothing is said."""
    import accelbatch.build as build

    opts = Opts(task="babi:1", datatype="train", batchsize=4, **loader_options)
    for cores, warned in ((torch.get_num_threads(), True), (torch.get_num_threads() + 1, False)):
        monkeypatch.setattr(build, "usable_cores", lambda cores=cores: cores)
        world = create_world(opts, agent=TextsAgent)
        assert isinstance(world, LoaderWorld)
        world.shutdown()
        err = capsys.readouterr().err
        assert (f"torch runs {torch.get_num_threads()} threads on the {cores} cores" in err) is warned
        assert (remedy in err) is warned


def test_a_gpu_run_or_a_run_without_data_processes_is_told_nothing():
    import accelbatch.build as build

    assert build.data_processes_compete(Opts(device="cuda", num_workers=2)) is None
    assert build.data_processes_compete(Opts(device="cpu", num_workers=0)) is None


def test_one_core_is_told_only_to_build_batches_in_the_main_process(monkeypatch):
    import accelbatch.build as build

    monkeypatch.setattr(build, "usable_cores", lambda: 1)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    line = build.data_processes_compete(Opts(device="cpu", num_workers=1))
    assert "--num-workers 0 builds the same batches" in line and "OMP_NUM_THREADS" not in line
