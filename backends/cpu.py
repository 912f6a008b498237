"""CPU backend (minimal placeholder: one process, one micro batch per call).

The full plan-aware engine (device iterations, accumulation, replication, hogwild) replaces this.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Backend, Engine, StepResult, TensorBatch


class LocalEngine(Engine):
    """Runs forward/backward/step in the calling process."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: Any = None):
        self.model = model
        self.optimizer = optimizer
        self.plan = plan

    def train_step(self, batch: TensorBatch) -> StepResult:
        self.model.train()
        out = self.model(batch)
        loss = out["loss"]
        assert self.optimizer is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        self.optimizer.step()
        outputs = {k: v.detach() for k, v in out.items() if k != "loss"}
        return StepResult(outputs=outputs, rows=None, loss=float(loss.detach()), updates=1)

    @torch.no_grad()
    def eval_step(self, batch: TensorBatch) -> StepResult:
        self.model.eval()
        out = self.model(batch)
        loss = out.get("loss")
        outputs = {k: v for k, v in out.items() if k != "loss"}
        return StepResult(outputs=outputs, rows=None, loss=None if loss is None else float(loss))


class CPUBackend(Backend):
    name = "cpu"

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    def compile(self, model, optimizer, plan=None) -> Engine:
        return LocalEngine(model, optimizer, plan)
