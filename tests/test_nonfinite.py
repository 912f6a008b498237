"""NaN losses: the run stops with a clear message, or --skip-nan skips exactly those updates."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends.base import NonFiniteLoss
from helpers import list_teacher
from torch import nn

from accelbatch.agents import TorchAgent
from accelbatch.build import attach_runtime
from accelbatch.opts import Opts
from accelbatch.worlds import BatchWorld, DialogPartnerWorld


class Poisoned(nn.Module):
    """Loss = mean((w * x - 1)^2), NaN whenever a row's x is 999 (a poisoned example)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, batch):
        x = batch["x"]
        per_row = (self.w * x - 1) ** 2
        per_row = torch.where(x == 999, torch.full_like(per_row, float("nan")), per_row)
        return {"loss": per_row.mean(), "pred": per_row.detach()}


class PoisonAgent(TorchAgent):
    def build_model(self):
        return Poisoned()

    def vectorize(self, obs):
        obs["x"] = 999.0 if "e1-" in obs["text"] else 1.0
        return obs

    def batchify(self, observations):
        return {"x": torch.tensor([o["x"] for o in observations])}

    def replies(self, outputs, observations):
        return [{"text": "?"} for _ in observations]


def _world(opts):
    teacher = list_teacher([1, 1, 1, 1])(opts)  # episodes e0..e3, e1 is poisoned
    return BatchWorld(opts, DialogPartnerWorld(opts, [teacher, PoisonAgent(opts)]), 2)


def test_a_nan_loss_stops_the_run_naming_the_option():
    opts = Opts(datatype="train:ordered", batchsize=2, optimizer="sgd", learning_rate=0.1)
    world = _world(opts)
    attach_runtime(world, opts)
    with pytest.raises(NonFiniteLoss, match="--skip-nan"):
        world.parley()
    assert world.get_model_agent().model.w.item() == 0.0  # the poisoned update was not applied


def test_skip_nan_skips_only_the_poisoned_updates():
    opts = Opts(datatype="train:ordered", batchsize=2, optimizer="sgd", learning_rate=0.1, skip_nan=True)
    world = _world(opts)
    attach_runtime(world, opts)
    world.parley()  # rows e0, e1: poisoned -> skipped
    agent = world.get_model_agent()
    assert agent.model.w.item() == 0.0
    world.parley()  # rows e2, e3: clean -> one SGD step: w -= 0.1 * d/dw mean((w-1)^2) = 0.1 * 2 * (0-1)
    assert abs(agent.model.w.item() - 0.2) < 1e-6
    assert agent.report()["skipped_updates"] == 1
