"""The optimizer state "on the device" and its copy in a ``poptorch.optim`` optimizer's ``ipu_state``.

On the device the state is torch's per-parameter state, keyed by parameter; in ``ipu_state`` it is keyed by
the parameter's name, with, under automatic loss scaling, the update factor (``lossScaleUpdateFactor``)
beside it (:mod:`.auto_loss_scale`). Tensors are copied both ways, so host and device never share one.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

import torch

from .auto_loss_scale import FACTOR_KEY, AutoLossScale
from .poptorch_core import py_error


def _copy(value: Any, device: torch.device | None = None) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    value = value.detach().clone()
    return value if device is None else value.to(device)


def to_host(device_state: dict[torch.Tensor, dict[str, Any]], model: torch.nn.Module,
            als: AutoLossScale) -> dict[str, Any]:
    """``ipu_state`` from the device's state."""
    names = {p: name for name, p in model.named_parameters()}
    ipu_state: dict[str, Any] = {names[p]: {k: _copy(v) for k, v in st.items()}
                                 for p, st in device_state.items() if st and p in names}
    ipu_state.update(als.state())
    return ipu_state


def to_device(ipu_state: dict[str, Any], model: torch.nn.Module,
              als: AutoLossScale) -> defaultdict[torch.Tensor, dict[str, Any]]:
    """The device's state from ``ipu_state`` (which must come from a model with these parameter names)."""
    params = dict(model.named_parameters())
    state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)
    als.load_state(ipu_state)
    for name, st in ipu_state.items():
        if name == FACTOR_KEY:
            continue
        if name not in params:
            raise py_error(f"Optimizer state for unknown parameter {name!r}: it was read from another model")
        state[params[name]] = {k: _copy(v, params[name].device) for k, v in st.items()}
    return state


__all__ = ["to_device", "to_host"]


def step_on_device(opt: torch.optim.Optimizer, hparams: list[dict[str, Any]],
                   device_state: dict[torch.Tensor, dict[str, Any]], params: list[torch.nn.Parameter]) -> None:
    """One update with the device's hyper-parameters and state, swapped in around torch's step: the host
    optimizer's own values and state are left as they were."""
    groups = opt.param_groups
    host_values = [{k: g[k] for k in snap if k in g} for g, snap in zip(groups, hparams)]
    host_state = opt.state
    for group, snap in zip(groups, hparams):
        group.update(snap)
    opt.state = device_state
    try:
        clip = getattr(opt, "max_grad_norm", math.inf)
        if math.isfinite(clip):
            torch.nn.utils.clip_grad_norm_(params, clip)
        opt.step()
    finally:
        opt.state = host_state
        for group, values in zip(groups, host_values):
            group.update(values)
