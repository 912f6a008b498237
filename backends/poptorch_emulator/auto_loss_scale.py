"""Automatic loss scaling (``opts.Training.setAutomaticLossScaling(True)``), as PopART's transform does it.

The device keeps a loss-scale *update factor*, 1.0 at first. Each weight update:

- the backward pass starts from ``loss * loss_scaling * factor`` (PopART's ``finalLossScale``) and the update
  divides the gradients by the same number, so the factor only changes how float16 gradients round, clip
  or overflow;
- the float16 gradients are sorted by absolute value into two bins at one edge, ``binEdgeLocation * 65504``
  (65504 is float16's largest value; ``binEdgeLocation`` defaults to 0.125): ``lower`` counts the elements
  below the edge, ``upper`` those at or above it (infinities included, NaN in neither). The tracked
  gradients are those of the float16 parameters and of the float16 outputs of the forward pass's
  operations other than views (PopART's default, ``AllNonViewChangingGradientTensors``); the counts are
  summed over them, the micro-batches of the step (gradient accumulation) and the replicas;
- then the factor halves when ``upper > t / (1 - t) * lower`` (t = ``thresholdUpperCountProportion``,
  default 1e-7: in effect, when any element reaches the edge) and doubles otherwise, for the next step.

With ``updatePeriod`` = M > 1 the counting and the update happen on steps 0, M, 2M, ... only. The three
settings are read from ``opts._Popart.set("automaticLossScalingSettings.<name>", value)``, checked as
PopART checks them. float32 gradients never count. A training model without any float16 gradient is
refused with PopART's error, which PopART raises when it compiles and the emulator after the first
micro-batch's backward pass (before any update) when the model has no float16 parameter. The factor is
``state_dict()["ipu_state"]["lossScaleUpdateFactor"]`` of a ``poptorch.optim`` optimizer and
``finalLossScale`` can be anchored (:mod:`.anchors`).
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch

from .poptorch_core import popart_error

FLOAT16_MAX = 65504.0
SETTINGS = "automaticLossScalingSettings."
FACTOR_KEY = "lossScaleUpdateFactor"
NO_FP16_ERR = "[AutomaticLossScale transform] No tracked gradient tensors of type fp16 were found."


def _in_unit_range(name: str, value: float) -> float:
    if not 0.0 <= value <= 1.0:
        where = "" if name == "thresholdUpperCountProportion" else "[AutomaticLossScale transform] "
        raise popart_error(f"{where}Out of range value for '{name}'. The current value is {value}, but it should "
                       "be in the range [0, 1].")
    return value


class AutoLossScale:
    """The update factor and the step's bin counts of one executor (inactive unless enabled and training)."""

    def __init__(self, popart_options: dict[str, Any], training: bool) -> None:
        self.enabled = training and bool(popart_options.get(SETTINGS + "enabled", False))
        self.bin_edge = FLOAT16_MAX * float(popart_options.get(SETTINGS + "binEdgeLocation", 0.125))
        self.threshold = float(popart_options.get(SETTINGS + "thresholdUpperCountProportion", 1e-7))
        self.update_period = int(popart_options.get(SETTINGS + "updatePeriod", 1))
        self.factor = 1.0
        self._step = 0
        self._lower = 0
        self._upper = 0
        self._must_find = False

    def check(self, params: list[torch.nn.Parameter]) -> None:
        """At compile time: the settings' ranges, and at least one float16 gradient to track."""
        if not self.enabled:
            return
        _in_unit_range("binEdgeLocation", self.bin_edge / FLOAT16_MAX)
        _in_unit_range("thresholdUpperCountProportion", self.threshold)
        if self.update_period < 1:
            raise popart_error("[AutomaticLossScale transform] automaticLossScalingSettings.updatePeriod must be "
                               f"at least 1, got {self.update_period}")
        # without float16 parameters the first backward pass must meet a float16 activation gradient
        self._must_find = not any(p.dtype == torch.float16 and p.requires_grad for p in params)

    def loss_scale(self, loss_scaling: float) -> float:
        """The loss scale of this step (PopART's ``finalLossScale``)."""
        return loss_scaling * self.factor if self.enabled else loss_scaling

    def _counting(self) -> bool:
        return self.enabled and self._step % self.update_period == 0

    def _count(self, grad: torch.Tensor) -> None:
        magnitude = grad.detach().abs()
        self._lower += int((magnitude < self.bin_edge).sum())
        self._upper += int((magnitude >= self.bin_edge).sum())

    @property
    def activation_hook(self) -> Callable[[torch.Tensor], None] | None:
        """Registered on the float16 outputs of the forward pass's operations (see :mod:`._mixed_precision`):
        counts their gradients as the backward pass computes them."""
        return self._count_activation if self.enabled else None

    def _count_activation(self, grad: torch.Tensor) -> None:
        if self._counting():
            self._count(grad)

    def observe(self, params: list[torch.nn.Parameter]) -> None:
        """After a micro-batch's backward pass: count the fresh float16 parameter gradients."""
        if not self._counting():
            return
        for p in params:
            if p.dtype == torch.float16 and p.grad is not None:
                self._count(p.grad)
        if self._must_find:
            if self._lower + self._upper == 0:
                raise popart_error(NO_FP16_ERR)
            self._must_find = False

    def end_step(self) -> None:
        """After the weight update: halve or double the factor (on counting steps), for the next step."""
        if not self.enabled:
            return
        if self._counting():
            ratio = math.inf if self.threshold >= 1.0 else self.threshold / (1.0 - self.threshold)
            scale_down = self._upper > ratio * self._lower  # False when the product is NaN, as on the IPU
            self.factor *= 0.5 if scale_down else 2.0
        self._lower = self._upper = 0
        self._step += 1

    def state(self) -> dict[str, torch.Tensor]:
        """The device's entry of ``ipu_state``."""
        return {FACTOR_KEY: torch.tensor(self.factor, dtype=torch.float32)} if self.enabled else {}

    def load_state(self, ipu_state: dict[str, Any]) -> None:
        """Take the factor from an ``ipu_state`` written back to the device."""
        if self.enabled and FACTOR_KEY in ipu_state:
            self.factor = float(ipu_state[FACTOR_KEY])


__all__ = ["AutoLossScale", "FACTOR_KEY", "NO_FP16_ERR"]
