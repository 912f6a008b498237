"""A world trains from the state torch's generator had when the world was built: another world built before it
runs (which seeds torch with its own --seed) leaves its training alone, as a sweep or a notebook builds
worlds first and runs them after (it trained on the other world's seed: max weight diff 0.22)."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import accelbatch as ab


class DropoutAgent(ab.TorchAgent):
    """Each text's length and a dropout layer: training draws from torch's generator."""

    def build_model(self):
        return DropoutModel()

    def vectorize(self, obs):
        return {"x": [float(len(obs.get("text", ""))), 1.0], "y": float(len((obs.get("labels") or [""])[0]))}

    def batchify(self, observations):
        return {"x": torch.tensor([o["x"] for o in observations]), "y": torch.tensor([o["y"] for o in observations])}

    def replies(self, outputs, observations):
        return [{"text": "x"} for _ in observations]


class DropoutModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(2, 32), nn.Tanh(), nn.Dropout(0.5), nn.Linear(32, 1))

    def forward(self, batch):
        return {"loss": ((self.net(batch["x"]).squeeze(-1) - batch["y"]) ** 2).mean() * 1e-3}


@pytest.fixture
def data(tmp_path):
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": "w " * (i % 7), "labels": ["a" * (i % 5)], "episode_done": True}) + "\n"
            for i in range(24)))
    return tmp_path


def _weights(world, opts):
    ab.run(world, opts)
    return {k: v.clone() for k, v in world.get_model_agent().model.state_dict().items()}


@pytest.mark.parametrize("plan", [{}, {"device_iterations": 2}], ids=["one-micro-batch", "di2"])
def test_a_world_built_in_between_leaves_a_built_worlds_training_alone(data, plan):
    opts = ab.Opts(task=f"jsonl:{data}", batchsize=4, num_epochs=2, progress=False, seed=0, eval_splits="",
                   validation_every_n_epochs=-1, **plan)
    alone = _weights(ab.create_world(opts, agent=DropoutAgent), opts)
    first = ab.create_world(opts, agent=DropoutAgent)
    other = ab.create_world(opts.replace(seed=7), agent=DropoutAgent)  # built, not run
    interleaved = _weights(first, opts)
    other.shutdown()
    for key, value in alone.items():
        assert torch.equal(value, interleaved[key]), key
