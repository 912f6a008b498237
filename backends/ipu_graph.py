"""How a plan and a dict-in/dict-out model become a poptorch graph: ``poptorch.Options`` for an
:class:`~accelbatch.plan.ExecutionPlan`, and :class:`InputsAdapter`, the positional ``forward(*tensors)`` PopTorch
traces around the model (inputs named after the batch's keys, the loss marked for PopTorch to find)."""

from __future__ import annotations

import inspect
import keyword
from typing import Any, Callable

import torch

from accelbatch.plan import ExecutionPlan, OutputMode, PlanError, Reduction

from .engine import check_outputs, loss_of
from .ipu_settings import IPUSettings

# the graph input carrying each row's loss scale under --loss-normalization token (InputsAdapter strips it)
LOSS_SCALE = "_loss_scale"


# --- options -------------------------------------------------------------------------------------------

def plan_options(poptorch: Any, plan: ExecutionPlan, seed: int | None = None,
                 settings: IPUSettings | None = None) -> Any:
    """``poptorch.Options`` for ``plan`` (a new, unfrozen object; one per model wrapper).

    ``randomSeed`` seeds the device; the host's torch generator is left as it was (PopTorch's
    ``randomSeed`` also reseeds it, which would restart the host's random stream at every new graph).
    """
    opts = poptorch.Options()
    opts.deviceIterations(plan.device_iterations)
    opts.replicationFactor(plan.replication_factor)
    if plan.replication_factor > 1:  # PopTorch refuses in-place buffer updates (BatchNorm) unless replicas own theirs
        opts.broadcastBuffers(False)
    if plan.input_group_size > 1:
        opts.inputReplicaGrouping(plan.input_group_size, getattr(poptorch.CommGroupType,
                                                                 plan.input_group_type.capitalize()))
    if plan.training:
        opts.Training.gradientAccumulation(plan.gradient_accumulation)
        opts.Training.accumulationAndReplicationReductionType(
            poptorch.ReductionType.Sum if plan.reduction is Reduction.SUM else poptorch.ReductionType.Mean)
    mode = plan.output_mode
    names = {OutputMode.ALL: "All", OutputMode.FINAL: "Final", OutputMode.SUM: "Sum", OutputMode.EVERY_N: "EveryN"}
    if mode is OutputMode.EVERY_N:
        opts.outputMode(poptorch.OutputMode.EveryN, plan.output_return_period)
    else:
        opts.outputMode(getattr(poptorch.OutputMode, names[mode]))
    if seed is not None:
        state = torch.get_rng_state()
        try:
            opts.randomSeed(int(seed))
        finally:
            torch.set_rng_state(state)
    if settings is not None:
        settings.apply(opts)
        strategy = settings.pipeline.execution_strategy(poptorch)
        if strategy is not None:
            opts.setExecutionStrategy(strategy)
    return opts


def group_leaders_only(plan: ExecutionPlan, t: torch.Tensor, scalar: bool) -> torch.Tensor:
    """One device output with input replica grouping, cut to the outputs of each input group's first replica.

    The device returns every replica's outputs (a group's N replicas computed the same rows), R replicas
    innermost but one (``[..., R, k, ...]`` on dim0, as each device output mode joins them); the result has
    R / N of them, one per row the host fed. ``scalar``: the model's output was 0-dim, so a single value left
    is 0-dim again (the multiplier-1 rule).
    """
    if plan.input_group_size == 1:
        return t
    r, mode = plan.replication_factor, plan.output_mode
    outer = {OutputMode.ALL: plan.iterations, OutputMode.EVERY_N: plan.iterations // plan.output_return_period
             }.get(mode, 1)  # Final and Sum: one per replica
    leaders = torch.tensor(plan.group_leaders)
    v = t.reshape(outer, r, -1, *t.shape[1:]).index_select(1, leaders).reshape(-1, *t.shape[1:])
    return v.reshape(()) if scalar and v.numel() == 1 else v


# --- the dict <-> positional adapter --------------------------------------------------------------------

def input_names(keys: tuple[str, ...]) -> tuple[str, ...]:
    """Parameter names for the graph's inputs: the batch keys where they are identifiers."""
    names, seen = [], set()
    for i, key in enumerate(keys):
        name = key if key.isidentifier() and not keyword.iskeyword(key) and key != "self" else f"input_{i}"
        while name in seen:
            name = f"{name}_{i}"
        seen.add(name)
        names.append(name)
    return tuple(names)


class InputsAdapter(torch.nn.Module):
    """``forward(*tensors)`` -> ``(outputs..., loss)`` around a dict-in/dict-out model.

    The inputs are the batch's tensors in the order of ``keys``; ``forward`` has one named parameter per
    key (so PopTorch's input errors name them). The output keys, whether a loss is returned and the
    dtypes the model produced (and which outputs are 0-dim) are recorded on the first call in ``meta``, a dict
    shared with the (shallow) copies poptorch makes of this module.
    """

    def __init__(self, model: torch.nn.Module, keys: tuple[str, ...], training: bool,
                 mark_loss: Callable[..., torch.Tensor] | None = None):
        super().__init__()
        self.model = model
        self.keys = tuple(keys)
        self.graph_training = training
        self.mark_loss = mark_loss
        self.meta: dict[str, Any] = {"out_keys": None, "has_loss": None, "dtypes": None, "scalars": None}

    def forward(self, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        inputs = dict(zip(self.keys, tensors))
        scale = inputs.pop(LOSS_SCALE, None)
        out = check_outputs(self.model(inputs))
        keys = tuple(k for k in out if k != "loss")
        has_loss = "loss" in out
        if self.graph_training:
            loss_of(out)
        meta = self.meta
        if meta["out_keys"] is None:
            meta.update(out_keys=keys, has_loss=has_loss, dtypes={k: out[k].dtype for k in keys},
                        scalars={k for k in keys if out[k].dim() == 0})
        elif meta["out_keys"] != keys or meta["has_loss"] != has_loss:
            raise PlanError(f"the model returned outputs {list(keys) + (['loss'] if has_loss else [])} but "
                            f"{list(meta['out_keys']) + (['loss'] if meta['has_loss'] else [])} when its graph "
                            "was compiled: a compiled graph has fixed outputs")
        loss = out["loss"] if has_loss else None
        if loss is not None and self.graph_training and self.mark_loss is not None:
            # PopTorch trains on the loss it finds in the graph: marked here, any loss the model computes
            # (a hand-written one, a sum of two torch losses) is the one final loss
            if scale is not None:  # the reported loss stays the model's; the graph trains on the scaled one
                return tuple(out[k] for k in keys) + (loss, self.mark_loss(loss * scale[0], reduction="none"))
            loss = self.mark_loss(loss, reduction="none")
        return tuple(out[k] for k in keys) + ((loss,) if loss is not None else ())


def make_adapter(model: torch.nn.Module, keys: tuple[str, ...], training: bool,
                 mark_loss: Callable[..., torch.Tensor] | None = None) -> InputsAdapter:
    """An :class:`InputsAdapter` whose ``forward`` signature names the inputs after ``keys``; in training
    ``mark_loss`` (``poptorch.identity_loss``) marks the model's loss."""
    names = input_names(keys)

    def forward(self: InputsAdapter, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return InputsAdapter.forward(self, *tensors)

    params = [inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)]
    params += [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in names]
    forward.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    cls = type("IPUInputs", (InputsAdapter,), {"forward": forward})
    return cls(model, keys, training, mark_loss)


__all__ = ["LOSS_SCALE", "InputsAdapter", "group_leaders_only", "input_names", "make_adapter",
           "plan_options"]
