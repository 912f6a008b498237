"""Pieces every engine shares: slicing micro-batches, the loss check, output gathering, replica steps.

An engine executes an :class:`~accelbatch.plan.CallLayout`; these helpers keep the CPU, CUDA and IPU
engines from each writing their own copy of that bookkeeping.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from accelbatch.plan import CallLayout, ExecutionPlan, PlanError

from .base import TensorBatch


def slice_rows(batch: Mapping[str, torch.Tensor], start: int, stop: int, rows: int) -> TensorBatch:
    if start == 0 and stop == rows:
        return batch  # type: ignore[return-value]
    return {k: (v[start:stop] if v.dim() else v) for k, v in batch.items()}


def loss_of(out: Mapping[str, torch.Tensor]) -> torch.Tensor:
    try:
        loss = out["loss"]
    except (KeyError, TypeError):
        raise PlanError("the model's forward(batch) must return a dict with 'loss' (the mean loss over the "
                        "micro-batch's rows) when training") from None
    if loss.dim() != 0:
        raise PlanError(f"the model's 'loss' has shape {tuple(loss.shape)}; it must be a scalar: the mean "
                        "loss over the micro-batch's rows")
    return loss


def detached_outputs(out: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in out.items() if k != "loss"}


def keep_flags(lay: CallLayout) -> list[bool]:
    flags = [False] * lay.num_micro_batches
    for j in lay.kept:
        flags[j] = True
    return flags


@dataclasses.dataclass(frozen=True)
class ReplicaSteps:
    """One replica's part of a call: per update, (local start, local stop, weight, j) of its micro-batches."""

    updates: tuple[tuple[tuple[int, int, float, int], ...], ...]
    shard_rows: int
    local_start: dict[int, int]


def replica_steps(lay: CallLayout, replica: int) -> ReplicaSteps:
    local_start, pos = {}, 0
    for j in lay.replica_micro_batches(replica):
        local_start[j] = pos
        pos += lay.micro_rows(j)
    updates = tuple(tuple((local_start[j], local_start[j] + lay.micro_rows(j), lay.weight[j], j)
                          for j in js if lay.replica[j] == replica) for js in lay.updates)
    return ReplicaSteps(updates=updates, shard_rows=pos, local_start=local_start)


def cat_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not parts:
        return {}
    out = {}
    for k in parts[0]:
        ts = [p[k] for p in parts]
        out[k] = ts[0] if len(ts) == 1 else (torch.stack(ts) if ts[0].dim() == 0 else torch.cat(ts))
    return out


def sum_parts(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if not parts:
        return {}
    return {k: (parts[0][k] if len(parts) == 1 else torch.stack([p[k] for p in parts]).sum(0))
            for k in parts[0]}


def check_trainable(optimizer: object, plan: "ExecutionPlan") -> None:
    """Refuse train_step without an optimizer or on an engine compiled for inference."""
    if optimizer is None:
        raise PlanError("train_step needs an optimizer: compile the model with one")
    if not plan.training:
        raise PlanError("this engine was compiled with an inference plan; compile with "
                        "ExecutionPlan.from_opts(opts, training=True) to train")
