"""``poptorch.optim``: the optimizers an IPU runs, with PopTorch's constructors and their state bookkeeping.

What is reproduced from PopTorch (python/optim.py, python/_optimizer_attributes.py, SDK 3.3):

- ``SGD``, ``Adam``, ``AdamW`` and ``RMSprop`` subclass torch's classes and take torch's arguments (each
  defaulting to torch's value when left at None) followed by PopTorch's own: ``loss_scaling``,
  ``velocity_scaling`` / ``use_combined_accum`` (SGD), ``bias_correction`` (AdamW), the accumulator types
  ``accum_type``, ``velocity_accum_type``, ``first_order_momentum_accum_type`` and
  ``second_order_momentum_accum_type`` (float16 or float32 only), ``max_grad_norm`` and ``use_tf_variant``
  (RMSprop). ``LAMB`` is PopTorch's own (``bias_correction``, ``max_weight_norm``).
- The state of a poptorch optimizer lives on the device. ``state_dict()`` returns torch's dict plus
  ``"ipu_state"`` and ``"ipu_param"`` (the device's state and hyper-parameters, None before any read back);
  a training executor re-binds ``state_dict`` so that it first reads the state back when the device has
  stepped since. ``load_state_dict`` accepts only such a dict ("Only IPU optimizer states can be loaded
  onto the IPU.") and marks the state for upload to the device before the next run.
- :func:`optimizer_type` is PopTorch's check of what a ``trainingModel`` can run: torch's or PopTorch's
  SGD / Adam / AdamW / RMSprop and PopTorch's LAMB; anything else (``torch.optim.Adagrad``, a custom
  ``torch.optim.Optimizer``) fails with PopTorch's AssertionError text; amsgrad fails with its ValueError.

The emulator keeps ``ipu_state`` as ``{parameter name: torch's per-parameter state}``; on an IPU it holds
PopART's tensors under PopART's names. ``AdamW(bias_correction=False)`` and ``LAMB`` step as PopTorch
describes them; ``RMSprop(use_tf_variant=True)`` is recorded and computed as torch's RMSprop (a difference
from an IPU). ``loss_scaling`` changes nothing in float32 arithmetic (the loss is
scaled up and the gradients down again), so the emulator records it and computes without it; the
accumulator types are recorded, the arithmetic stays in the parameters' dtype.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

import torch

logger = logging.getLogger("poptorch_emulator")

ACCUM_TYPES = (torch.float16, torch.float32)
ACCUM_TYPE_ERR = "Accumulation types must be either torch.float32 or torch.float16"
# PopTorch's enum of the optimizers it implements, as its error text lists them (SDK Python prints the names)
OPTIMIZER_TYPES = ("SGD1", "SGD2", "ADAM", "ADAMW", "ADAMW_NO_BIAS", "RMSPROP", "RMSPROP_CENTERED", "LAMB",
                   "LAMB_NO_BIAS")
UNSUPPORTED_ERR = "Unsupported optimizer type. Types supported " + ", ".join(
    f"_OptimizerType.{name}" for name in OPTIMIZER_TYPES)
AMSGRAD_ERR = "Only non-amsgrad Adam/AdamW optimizers are supported."


class VariableAttributes:
    """Which hyper-parameters may change after compilation (those the user set); ``optimizer.variable_attrs``."""

    def __init__(self, variables: list[str], allowed: list[str]) -> None:
        self._variables = list(variables)
        self._allowed = list(allowed)

    def isConstant(self, attr: str) -> bool:
        return attr not in self._variables

    def markAsConstant(self, attr: str) -> None:
        assert attr in self._allowed, f"Unknown attribute {attr}, allowed values: {self._allowed}"
        self._variables = [a for a in self._variables if a != attr]

    def markAsVariable(self, attr: str) -> None:
        assert attr in self._allowed, f"Unknown attribute {attr}, allowed values: {self._allowed}"
        self._variables.append(attr)


class Optimizer:
    """What every poptorch optimizer adds to torch's: a device-side state and the flags saying which copy
    (host or device) is current. Mixed in before the torch class."""

    def _init_ipu_state(self) -> None:
        self._state_dict: dict[str, Any] = {"ipu_state": None, "ipu_param": None}
        self.ipu_state_is_dirty = False   # the host holds a state the device has not received yet
        self.host_state_is_dirty = False  # the device has stepped since the host's copy was read

    def state_dict(self) -> dict[str, Any]:
        return self.get_state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        torch.optim.Optimizer.load_state_dict(self, _torch_part(state))  # groups (lr...) as torch loads them
        self.set_state_dict(state)

    def get_state_dict(self) -> dict[str, Any]:
        """The cached device state and torch's own dict (whose ``state`` stays empty: the host never steps)."""
        return {**self._state_dict, **torch.optim.Optimizer.state_dict(self)}

    def set_state_dict(self, state: dict[str, Any]) -> None:
        if not state:
            raise RuntimeError("Cannot load optimizer state dictionary because it is empty.")
        if not ("ipu_state" in state and "ipu_param" in state):
            raise RuntimeError("Only IPU optimizer states can be loaded onto the IPU.")
        self._state_dict = state
        self.ipu_state_is_dirty = True
        self.host_state_is_dirty = False

    def has_state(self) -> bool:
        return self._state_dict.get("ipu_state") is not None and self._state_dict.get("ipu_param") is not None


def _torch_part(state: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in state.items() if k not in ("ipu_state", "ipu_param")}


def _given(**kwargs: Any) -> dict[str, Any]:
    """The arguments the caller gave (not None): the torch class fills in its own defaults for the rest."""
    return {k: v for k, v in kwargs.items() if v is not None}


def _accum_type(value: torch.dtype | None) -> torch.dtype:
    value = torch.float32 if value is None else value
    assert value in ACCUM_TYPES, ACCUM_TYPE_ERR
    return value


def _finish(opt: Any, given: dict[str, Any], child_vars: list[str]) -> None:
    """Hyper-parameters the user set are variable (may change after compilation), the others constant."""
    opt.variable_attrs = VariableAttributes([k for k in given if k != "params"], list(opt.defaults) + child_vars)


class SGD(Optimizer, torch.optim.SGD):
    """torch's SGD on the device; ``velocity_scaling`` applies to the combined-accumulator variant only."""

    def __init__(self, params: Iterable, lr: float, momentum: float | None = None, dampening: float | None = None,
                 weight_decay: float | None = None, nesterov: bool | None = None, maximize: bool | None = None,
                 foreach: bool | None = None, differentiable: bool | None = None,
                 loss_scaling: float | None = None, velocity_scaling: float | None = None,
                 use_combined_accum: bool | None = None, accum_type: torch.dtype | None = None,
                 velocity_accum_type: torch.dtype | None = None, max_grad_norm: float | None = None) -> None:
        given = _given(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                       nesterov=nesterov, maximize=maximize, foreach=foreach, differentiable=differentiable)
        self._init_ipu_state()
        torch.optim.SGD.__init__(self, params, **given)
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.use_combined_accum = bool(use_combined_accum)
        if velocity_scaling is not None and not self.use_combined_accum:
            logger.warning("velocity_scaling value ignored when using the separate variant "
                           "(use_combined_accum=False). In future, this will lead to an error. Please update "
                           "your code.")
        if self.use_combined_accum:
            scaling = 1.0 if velocity_scaling is None else velocity_scaling
            self.defaults["velocity_scaling"] = scaling
            for group in self.param_groups:
                group.setdefault("velocity_scaling", scaling)
        self.accum_type = _accum_type(accum_type)
        self.velocity_accum_type = _accum_type(velocity_accum_type)
        self.max_grad_norm = math.inf if max_grad_norm is None else max_grad_norm
        _finish(self, given, ["loss_scaling"])


class _AdamBase(Optimizer):
    """The accumulator types and gradient clipping Adam, AdamW and RMSprop share."""

    def _set_common(self, loss_scaling: float | None, accum_type: torch.dtype | None,
                    first: torch.dtype | None, second: torch.dtype | None) -> None:
        self.loss_scaling = 1.0 if loss_scaling is None else loss_scaling
        self.accum_type = _accum_type(accum_type)
        self.first_order_momentum_accum_type = _accum_type(first)
        self.second_order_momentum_accum_type = _accum_type(second)


class Adam(_AdamBase, torch.optim.Adam):
    """torch's Adam on the device (amsgrad is refused when a trainingModel takes it)."""

    def __init__(self, params: Iterable, lr: float | None = None, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None, amsgrad: bool | None = None,
                 foreach: bool | None = None, maximize: bool | None = None, capturable: bool | None = None,
                 differentiable: bool | None = None, fused: bool | None = None,
                 loss_scaling: float | None = None, accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None) -> None:
        given = _given(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, foreach=foreach,
                       maximize=maximize, capturable=capturable, differentiable=differentiable, fused=fused)
        self._init_ipu_state()
        torch.optim.Adam.__init__(self, params, **given)
        self._set_common(loss_scaling, accum_type, first_order_momentum_accum_type,
                         second_order_momentum_accum_type)
        self.max_grad_norm = math.inf if max_grad_norm is None else max_grad_norm
        _finish(self, given, ["loss_scaling"])


class AdamW(_AdamBase, torch.optim.AdamW):
    """torch's AdamW on the device; ``bias_correction=False`` runs it without bias correction."""

    def __init__(self, params: Iterable, lr: float | None = None, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None, amsgrad: bool | None = None,
                 maximize: bool | None = None, foreach: bool | None = None, capturable: bool | None = None,
                 differentiable: bool | None = None, fused: bool | None = None,
                 loss_scaling: float | None = None, bias_correction: bool | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 max_grad_norm: float | None = None) -> None:
        given = _given(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad, maximize=maximize,
                       foreach=foreach, capturable=capturable, differentiable=differentiable, fused=fused)
        self._init_ipu_state()
        torch.optim.AdamW.__init__(self, params, **given)
        self._set_common(loss_scaling, accum_type, first_order_momentum_accum_type,
                         second_order_momentum_accum_type)
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        self.max_grad_norm = math.inf if max_grad_norm is None else max_grad_norm
        _finish(self, given, ["loss_scaling"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """torch's AdamW; without bias correction: decay, then the moments' ratio unscaled."""
        if self.bias_correction:
            return torch.optim.AdamW.step(self, closure)
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=torch.tensor(0.0), exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                p.mul_(1 - group["lr"] * group["weight_decay"])
                state["exp_avg"].lerp_(p.grad, 1 - beta1)
                state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                p.addcdiv_(state["exp_avg"], state["exp_avg_sq"].sqrt().add_(group["eps"]), value=-group["lr"])
        return loss


class RMSprop(_AdamBase, torch.optim.RMSprop):
    """torch's RMSprop on the device (``use_tf_variant`` is recorded; the emulator computes torch's variant)."""

    def __init__(self, params: Iterable, lr: float | None = None, alpha: float | None = None,
                 eps: float | None = None, weight_decay: float | None = None, momentum: float | None = None,
                 centered: bool | None = None, foreach: bool | None = None, maximize: bool | None = None,
                 differentiable: bool | None = None, loss_scaling: float | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None,
                 use_tf_variant: bool | None = None) -> None:
        given = _given(lr=lr, alpha=alpha, eps=eps, weight_decay=weight_decay, momentum=momentum,
                       centered=centered, foreach=foreach, maximize=maximize, differentiable=differentiable)
        self._init_ipu_state()
        torch.optim.RMSprop.__init__(self, params, **given)
        self._set_common(loss_scaling, accum_type, first_order_momentum_accum_type,
                         second_order_momentum_accum_type)
        self.use_tf_variant = bool(use_tf_variant)
        self.max_grad_norm = math.inf
        _finish(self, given, ["loss_scaling"])


class LAMB(_AdamBase, torch.optim.Optimizer):
    """Layer-wise adaptive moments (You et al. 2019): Adam's update scaled per tensor by the trust ratio
    min(|w|, max_weight_norm) / |update| (1 when either norm is 0)."""

    def __init__(self, params: Iterable, lr: float | None = None, betas: tuple[float, float] | None = None,
                 eps: float | None = None, weight_decay: float | None = None, bias_correction: bool | None = None,
                 loss_scaling: float | None = None, max_weight_norm: float | None = None,
                 accum_type: torch.dtype | None = None,
                 first_order_momentum_accum_type: torch.dtype | None = None,
                 second_order_momentum_accum_type: torch.dtype | None = None) -> None:
        given = _given(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, max_weight_norm=max_weight_norm)
        defaults = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 1e-2,
                    "max_weight_norm": 65500.0, **given}  # 65500: the largest float16
        self._init_ipu_state()
        torch.optim.Optimizer.__init__(self, params, defaults)
        self._set_common(loss_scaling, accum_type, first_order_momentum_accum_type,
                         second_order_momentum_accum_type)
        self.bias_correction = True if bias_correction is None else bool(bias_correction)
        self.max_weight_norm = defaults["max_weight_norm"]
        self.max_grad_norm = math.inf
        _finish(self, given, ["loss_scaling"])

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state.update(step=0, exp_avg=torch.zeros_like(p), exp_avg_sq=torch.zeros_like(p))
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.lerp_(p.grad, 1 - beta1)
                v.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                c1 = 1 - beta1 ** state["step"] if self.bias_correction else 1.0
                c2 = 1 - beta2 ** state["step"] if self.bias_correction else 1.0
                update = (m / c1) / ((v / c2).sqrt() + group["eps"]) + group["weight_decay"] * p
                w_norm = p.norm().clamp(max=group["max_weight_norm"])
                u_norm = update.norm()
                trust = 1.0 if float(w_norm) == 0 or float(u_norm) == 0 else float(w_norm / u_norm)
                p.add_(update, alpha=-group["lr"] * trust)
        return loss


def optimizer_type(optimizer: torch.optim.Optimizer) -> str:
    """PopTorch's name for the optimizer a trainingModel runs; PopTorch's errors for one it cannot run."""
    cls = type(optimizer)
    own = cls in (SGD, Adam, AdamW, RMSprop, LAMB) or cls.__module__.startswith("torch.optim.")
    if not own and torch.optim.Optimizer not in cls.__bases__ and Optimizer not in cls.__bases__:
        logger.warning("Optimizer `%s` subclassed from classes in poptorch.optim or torch.optim are unlikely to "
                       "behave as intended. Poptorch does not run Python optimizer code directly; but instead "
                       "uses IPU native optimisers implemented in PopART.", cls.__name__)
    if isinstance(optimizer, torch.optim.SGD):
        return "SGD1" if getattr(optimizer, "use_combined_accum", False) else "SGD2"
    if isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW)):
        if any(group.get("amsgrad") for group in optimizer.param_groups):
            raise ValueError(AMSGRAD_ERR)
        if isinstance(optimizer, torch.optim.AdamW):  # (before Adam: torch >= 2.6 derives AdamW from it)
            return "ADAMW" if getattr(optimizer, "bias_correction", True) else "ADAMW_NO_BIAS"
        return "ADAM"
    if isinstance(optimizer, torch.optim.RMSprop):
        return "RMSPROP_CENTERED" if optimizer.param_groups[0]["centered"] else "RMSPROP"
    if isinstance(optimizer, LAMB):
        return "LAMB" if optimizer.bias_correction else "LAMB_NO_BIAS"
    raise AssertionError(UNSUPPORTED_ERR)


__all__ = ["LAMB", "SGD", "Adam", "AdamW", "Optimizer", "RMSprop", "VariableAttributes", "optimizer_type"]
