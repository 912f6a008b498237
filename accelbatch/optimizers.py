"""The optimizers of -opt (torch's SGD, Adam, AdamW) and their learning rates, read and set per group."""

from __future__ import annotations

import inspect
from typing import Any

import torch


def optimizer_kwargs(opts: Any, kind: type[torch.optim.Optimizer], model: torch.nn.Module | None = None
                     ) -> dict[str, Any]:
    """Extra keywords for torch's SGD/Adam/AdamW ``kind``: ``fused=True`` on --device cuda where this torch
    has it (one kernel per step for every parameter, and the engine skips a bad update inside it without
    copying the weights; torch 2.0's SGD has no fused kernel), unless ``model`` makes sparse gradients
    (``nn.Embedding(sparse=True)``), which the fused kernels refuse and plain SGD takes, as on the cpu."""
    fused = getattr(opts, "device", "cpu") == "cuda" and "fused" in inspect.signature(kind.__init__).parameters
    sparse = model is not None and any(getattr(module, "sparse", False) is True for module in model.modules())
    return {"fused": True} if fused and not sparse else {}


def learning_rates(optimizer: torch.optim.Optimizer) -> list[float]:
    return [group["lr"] for group in optimizer.param_groups]


def set_learning_rates(optimizer: torch.optim.Optimizer, rates: list[float]) -> str | None:
    """Give the parameter groups of ``optimizer`` (loaded from a file) the rates a fresh one built for this
    run has (``rates``, from :func:`learning_rates`); the rates it had, as text, when that changed them."""
    old = learning_rates(optimizer)
    if len(old) != len(rates) or old == rates:
        return None
    for group, lr in zip(optimizer.param_groups, rates):
        group["lr"] = lr
    return rates_text(old)


def rates_text(rates: list[float]) -> str:
    """Distinct rates, sorted, as text: "0.01, 0.1"."""
    return ", ".join(f"{v:g}" for v in sorted(set(rates)))


def state_fits(saved: Any, optimizer: torch.optim.Optimizer, saved_kind: str | None = None) -> bool:
    """Whether ``saved`` is an optimizer ``state_dict`` of ``optimizer``'s kind: by the class name recorded
    with it when there is one, else by its hyperparameter names (Adam's betas, SGD's momentum)."""
    if saved_kind:
        return saved_kind == type(optimizer).__name__
    groups = saved.get("param_groups") if isinstance(saved, dict) else None
    return bool(groups) and isinstance(groups[0], dict) and set(groups[0]) == set(optimizer.param_groups[0])


# the per-parameter states torch's optimizers keep elementwise, each of its parameter's shape (others, such as
# Adafactor's row and column variances, broadcast to it; step counts are 0-d)
ELEMENTWISE_STATES = frozenset({"momentum_buffer", "exp_avg", "exp_avg_sq", "max_exp_avg_sq", "exp_inf", "sum",
                                "square_avg", "acc_delta", "prev", "step_size", "ax"})


def state_misfit(saved: Any, optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> str | None:
    """Where a saved optimizer ``state_dict``'s per-parameter state does not fit ``optimizer``'s parameters
    (None where it fits): torch's ``load_state_dict`` pairs them by position and checks only their number, so
    a state of another shape failed at the first step. Checked for torch's own optimizers, whose states are
    known (:data:`ELEMENTWISE_STATES`); another optimizer's layout is its own."""
    if not type(optimizer).__module__.startswith("torch.optim"):
        return None
    names = {id(p): name for name, p in model.named_parameters()}
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved.get("param_groups", []) for i in group.get("params", [])]
    state = saved.get("state", {})
    for index, param in zip(ids, params):
        for key, value in (state.get(index) or {}).items():
            if not isinstance(value, torch.Tensor) or not value.dim():
                continue
            if value.shape != param.shape if key in ELEMENTWISE_STATES else not _broadcasts(value.shape, param.shape):
                return (f"its {key} of {names.get(id(param), f'parameter {index}')} is {list(value.shape)}, the "
                        f"parameter {list(param.shape)}")
    return None


def _broadcasts(shape: torch.Size, to: torch.Size) -> bool:
    try:
        return torch.broadcast_shapes(shape, to) == to
    except RuntimeError:
        return False
