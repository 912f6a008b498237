"""How one call runs under an execution plan: its micro-batches, their replicas, updates and loss weights, and
which outputs the output mode keeps (:class:`CallLayout`); the plan's enums and errors; combining outputs.

The semantics are the plan's (:mod:`accelbatch.plan` describes them); this module computes them for a call of
``n`` rows, so that every engine only executes a layout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch


class PlanError(ValueError):
    """An execution plan, or a batch given to it, cannot work; the text names the option to change."""


class OutputMode(enum.Enum):
    ALL = "all"
    FINAL = "final"
    SUM = "sum"
    EVERY_N = "everyn"

    @classmethod
    def parse(cls, value: "OutputMode | str | None", training: bool) -> "OutputMode":
        """An OutputMode from itself, its name or value; ``"default"``/None: FINAL training, ALL inference."""
        if isinstance(value, cls):
            return value
        if value is None or str(value).lower() == "default":
            return cls.FINAL if training else cls.ALL
        text = str(value).lower().replace("_", "")
        for mode in cls:
            if text in (mode.value, mode.name.lower().replace("_", "")):
                return mode
        raise PlanError(f"--output-mode: {value!r} is not one of default, all, final, sum, everyn")


LOSS_TOKENS = "loss_tokens"  # optional per-row batch tensor: the tokens a row's loss averages over


class LossNormalization(enum.Enum):
    """How an update weighs its micro-batches' mean losses: ``MICRO`` by rows (each micro-batch's mean, as
    PopTorch's Mean reduction), ``TOKEN`` by the tokens each holds (the per-token mean of one big batch)."""

    MICRO = "micro"
    TOKEN = "token"

    @classmethod
    def parse(cls, value: "LossNormalization | str") -> "LossNormalization":
        if isinstance(value, cls):
            return value
        for norm in cls:
            if str(value).lower() in (norm.value, norm.name.lower()):
                return norm
        raise PlanError(f"--loss-normalization: {value!r} is not one of micro, token")


class Reduction(enum.Enum):
    MEAN = "mean"
    SUM = "sum"

    @classmethod
    def parse(cls, value: "Reduction | str") -> "Reduction":
        if isinstance(value, cls):
            return value
        for red in cls:
            if str(value).lower() in (red.value, red.name.lower()):
                return red
        raise PlanError(f"--reduction: {value!r} is not one of mean, sum")


@dataclass(frozen=True)
class CallLayout:
    """How one call with ``rows`` rows runs under a plan (see the module docstring).

    Micro-batch ``j`` covers rows ``starts[j]:stops[j]``, runs on replica ``replica[j]`` (the input group,
    with input replica grouping) in weight update
    ``update[j]`` with its loss scaled by ``weight[j]``. ``updates[u]`` lists the micro-batches of update
    ``u``. ``kept`` lists the micro-batches whose outputs the output mode returns (in output order),
    ``sum_groups`` (SUM only) the micro-batches summed for each replica; ``out_rows`` the row indices of
    the returned outputs (None for SUM). ``partial`` marks an epoch tail.
    """

    rows: int
    micro_batch: int
    partial: bool
    mode: OutputMode
    starts: tuple[int, ...]
    stops: tuple[int, ...]
    replica: tuple[int, ...]
    update: tuple[int, ...]
    weight: tuple[float, ...]
    updates: tuple[tuple[int, ...], ...]
    kept: tuple[int, ...]
    sum_groups: tuple[tuple[int, ...], ...] | None
    out_rows: torch.Tensor | None

    @property
    def num_micro_batches(self) -> int:
        return len(self.starts)

    @property
    def num_updates(self) -> int:
        return len(self.updates)

    def replica_micro_batches(self, replica: int) -> tuple[int, ...]:
        """The micro-batches ``j`` of one replica, in order (its shard is their rows, concatenated)."""
        return tuple(j for j, r in enumerate(self.replica) if r == replica)

    def replica_index(self, replica: int) -> torch.Tensor:
        """Row indices (into the call's rows) of one replica's shard, in shard order."""
        js = self.replica_micro_batches(replica)
        if not js:
            return torch.empty(0, dtype=torch.long)
        return torch.cat([torch.arange(self.starts[j], self.stops[j]) for j in js])

    def micro_rows(self, j: int) -> int:
        return self.stops[j] - self.starts[j]

    def token_weights(self, tokens: Mapping[int, float], totals: Sequence[float]) -> dict[int, float]:
        """Loss weights under ``--loss-normalization token``: micro-batch ``j`` (a key of ``tokens``, its
        token count) weighs ``tokens[j] / totals[update[j]]``, its update's tokens over all its G x R
        micro-batches, so the update's gradient is that of the per-token mean over the whole update (the
        model's loss being the mean over its micro-batch's tokens). An update without tokens weighs 0."""
        return {j: (t / totals[self.update[j]] if totals[self.update[j]] > 0 else 0.0) for j, t in tokens.items()}


def compute_layout(plan: Any, n: int) -> CallLayout:
    """The layout of a call with ``n`` rows under ``plan`` (an ExecutionPlan), already validated."""
    d, r, g = plan.device_iterations, plan.input_groups, plan.gradient_accumulation  # r: replicas the host feeds
    if not plan.training:
        b = plan.micro_batch if n <= plan.combined_batch else n // (d * r)
        partial = False
    elif plan.is_tail(n):  # b rows a micro-batch, more when the tail exceeds the combined batch (M <= D x R x G)
        b, partial = max(plan.micro_batch, _ceil_div(n, plan.factor)), True
    else:
        b, partial = n // plan.factor, False
    m = _ceil_div(n, b)
    starts = tuple(range(0, n, b))
    stops = tuple(min(s + b, n) for s in starts)
    per_update = g * r
    replica = tuple(j % r for j in range(m))
    update = tuple(j // per_update for j in range(m))
    updates = tuple(tuple(range(u * per_update, min((u + 1) * per_update, m)))
                    for u in range(_ceil_div(m, per_update)))
    weight = []
    for j in range(m):
        nj = stops[j] - starts[j]
        if plan.reduction is Reduction.MEAN:
            nu = sum(stops[k] - starts[k] for k in updates[update[j]])
            weight.append(nj / nu)
        else:
            weight.append(nj / b)
    mode = plan.output_mode if (plan.training and not partial) else OutputMode.ALL
    sum_groups = None
    if mode is OutputMode.ALL:
        kept = tuple(range(m))
    elif mode is OutputMode.FINAL:
        kept = tuple(range(m - r, m))
    elif mode is OutputMode.EVERY_N:  # every micro-batch (G of them, each for every R) of iterations N-1, 2N-1..
        period, per_iteration = plan.output_return_period, g * r
        kept = tuple(j for it in range(period - 1, m // per_iteration, period)
                     for j in range(it * per_iteration, (it + 1) * per_iteration))
    else:
        kept = tuple(range(m))
        sum_groups = tuple(tuple(range(rep, m, r)) for rep in range(r))
    out_rows = None
    if mode is OutputMode.ALL:
        out_rows = torch.arange(n)
    elif mode is not OutputMode.SUM:
        out_rows = torch.cat([torch.arange(starts[j], stops[j]) for j in kept])
    return CallLayout(rows=n, micro_batch=b, partial=partial, mode=mode, starts=starts, stops=stops,
                      replica=replica, update=update, weight=tuple(weight), updates=updates, kept=kept,
                      sum_groups=sum_groups, out_rows=out_rows)


def combine_outputs(layout: CallLayout, kept_outputs: Sequence[Mapping[str, torch.Tensor]]
                    ) -> dict[str, torch.Tensor]:
    """Concatenate the kept micro-batches' outputs (given in ``layout.kept`` order) per the layout's mode.

    Per-row outputs are concatenated on dim0; 0-dim outputs are stacked, except when only one remains
    (multiplier 1). For SUM each replica's micro-batches are summed elementwise, then replicas are
    concatenated in order.
    """
    if not kept_outputs:
        return {}
    keys = [k for k in kept_outputs[0] if k != "loss"]
    if layout.sum_groups is not None:
        pos = {j: i for i, j in enumerate(layout.kept)}
        summed = []
        for group in layout.sum_groups:
            if not group:
                continue
            acc = {}
            for k in keys:
                acc[k] = torch.stack([kept_outputs[pos[j]][k] for j in group]).sum(0) if len(group) > 1 \
                    else kept_outputs[pos[group[0]]][k]
            summed.append(acc)
        kept_outputs = summed
    out = {}
    for k in keys:
        parts = [o[k] for o in kept_outputs]
        if len(parts) == 1:
            out[k] = parts[0]
        elif parts[0].dim() == 0:
            out[k] = torch.stack(parts)
        else:
            out[k] = torch.cat(parts)
    return out


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def rows_of(batch: Mapping[str, torch.Tensor]) -> int:
    for t in batch.values():
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise PlanError("a batch needs at least one tensor with a row dimension (dim0 = rows)")


def batch_rows(batch: Mapping[str, torch.Tensor], name: str = "batch") -> int:
    """The row count of a batch; PlanError when its tensors disagree on dim0."""
    rows = None
    for key, t in batch.items():
        if not isinstance(t, torch.Tensor) or t.dim() == 0:
            continue
        if rows is None:
            rows = int(t.shape[0])
        elif t.shape[0] != rows:
            raise PlanError(f"{name}: '{key}' has {t.shape[0]} rows but the other tensors have {rows}; "
                            "every tensor of a batch needs dim0 = rows")
    if rows is None:
        raise PlanError(f"{name}: no tensor with a row dimension (dim0 = rows)")
    return rows


def token_prefix(loss_tokens: torch.Tensor) -> list[float]:
    """Cumulative tokens of a batch's rows from its per-row ``loss_tokens``: rows ``s:e`` hold
    ``prefix[e] - prefix[s]`` tokens (a row's tensor may have more dims; they are summed)."""
    rows = loss_tokens.detach().reshape(loss_tokens.shape[0], -1).sum(1).double().cpu()
    return torch.cat([rows.new_zeros(1), rows.cumsum(0)]).tolist()


def update_totals(layout: CallLayout, tokens: Mapping[int, float]) -> list[float]:
    """Tokens of each update of ``layout`` (summed over the micro-batches in ``tokens``)."""
    totals = [0.0] * layout.num_updates
    for j, t in tokens.items():
        totals[layout.update[j]] += t
    return totals


__all__ = ["CallLayout", "LOSS_TOKENS", "LossNormalization", "OutputMode", "PlanError", "Reduction",
           "batch_rows", "combine_outputs", "compute_layout",
           "token_prefix", "rows_of", "update_totals"]
