"""Agents with a count of their own (tests name them with -m counting_agent:NAME; spawned replicas import
them): ``rows_replied``, added with Metrics.add (a sum), counts the rows each replied to."""

from __future__ import annotations

import torch
from torch import nn

from accelbatch.agents import TorchAgent
from accelbatch.models.bag import BagAgent


class CountingBag(BagAgent):
    def replies(self, outputs, observations):
        self.metrics.add("rows_replied", len(observations))
        return super().replies(outputs, observations)


class Line(nn.Module):
    """Loss mean((w * x - 1)^2) over the rows; NaN in training when a row's x is 0 (a poisoned example)."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.zeros(()))

    def forward(self, batch):
        per_row = (self.w * batch["x"] - 1) ** 2
        if self.training:
            per_row = torch.where(batch["x"] == 0, torch.full_like(per_row, float("nan")), per_row)
        return {"loss": per_row.mean(), "pred": (self.w * batch["x"]).detach()}


class CountingLine(TorchAgent):
    """x = the text's length mod 7 (0 poisons a training update: train with --skip-nan); replies "big" when
    w * x > 1, else "small"; counts the rows it replied to."""

    def build_model(self):
        return Line()

    def vectorize(self, obs):
        obs["x"] = float(len(obs.get("text", "")) % 7)
        return obs

    def batchify(self, observations):
        return {"x": torch.tensor([o["x"] for o in observations])}

    def replies(self, outputs, observations):
        self.metrics.add("rows_replied", len(observations))
        return [{"text": "big" if p > 1 else "small"} for p in outputs["pred"].tolist()]
