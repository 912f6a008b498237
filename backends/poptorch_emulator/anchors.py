"""Anchored tensors: ``opts.anchorTensor(short_name, long_name, ...)`` and ``model.getAnchoredTensor(short_name)``.

On an IPU any tensor of the PopART graph can be anchored by its PopART name; the emulator has no such
graph and anchors the tensors it models, in a training model:

- ``finalLossScale``: the loss scale the step's backward pass used (``loss_scaling`` times the automatic
  loss scaling factor; only with ``Training.setAutomaticLossScaling(True)``, as in PopART), float32 scalar;
- ``UpdatedVar___<parameter name>``: the parameter after the step's weight update.

Each is one value per weight update (per device iteration), returned by its output mode as model outputs
are: ``All`` stacks (scalars) or concatenates the device iterations, ``EveryN`` those of iterations N-1,
2N-1, ..., ``Final`` the last, ``Sum`` their sum. An anchor given no output mode takes the model's. Any
other name is refused when the model compiles with PopART's error ("Anchor tensor `name' not in Ir
Tensors."), followed by the list above. ``getAnchoredTensor`` before a run, or of an unknown short name,
fails with PopTorch's ``AssertionError`` ("No tensor with name ... found.").
"""

from __future__ import annotations

from typing import Any

import torch

from . import _outputs
from .enums import OutputMode
from .poptorch_core import popart_error

FINAL_LOSS_SCALE = "finalLossScale"
UPDATED_VAR = "UpdatedVar___"
MODELLED = (f"The emulator can anchor {FINAL_LOSS_SCALE} (training with automatic loss scaling) and "
            f"{UPDATED_VAR}<parameter name> (training).")


class AnchorMemory:
    """The anchors of one executor: their modes, the current call's values and the last call's results."""

    def __init__(self, options: Any) -> None:
        # PopTorch fills in the model's output mode for anchors given none when the executor is made.
        self._anchors: dict[str, tuple[str, OutputMode, int]] = {}
        for short, (long_name, follows, mode, period) in options.anchored_tensors.items():
            if follows:
                mode, period = OutputMode(options.output_mode), options.output_return_period
            self._anchors[short] = (long_name, OutputMode(mode), period if mode == OutputMode.EveryN else 1)
        self._steps: list[dict[str, torch.Tensor]] = []
        self._memory: dict[str, torch.Tensor] = {}

    def check(self, training: bool, auto_loss_scaling: bool, param_names: list[str],
              device_iterations: int) -> None:
        """At compile time: every long name is a tensor the emulator models, every period divides D."""
        known = {UPDATED_VAR + name for name in param_names} if training else set()
        if training and auto_loss_scaling:
            known.add(FINAL_LOSS_SCALE)
        for long_name, mode, period in self._anchors.values():
            if long_name not in known:
                raise popart_error(f"Anchor tensor `{long_name}' not in Ir Tensors. {MODELLED}")
            _outputs.check_period(mode, period, device_iterations)

    def wanted(self) -> set[str]:
        return {long_name for long_name, _, _ in self._anchors.values()}

    def record_step(self, loss_scale: float, params: dict[str, torch.Tensor]) -> None:
        """After a weight update: the anchored tensors' values (``params`` by name, updated)."""
        if not self._anchors:
            return
        values = {}
        for name in self.wanted():
            if name == FINAL_LOSS_SCALE:
                values[name] = torch.tensor(loss_scale, dtype=torch.float32)
            else:
                values[name] = params[name[len(UPDATED_VAR):]].detach().clone()
        self._steps.append(values)

    def end_call(self) -> None:
        """After a call: each anchor's result by its output mode, kept until the next call."""
        if not self._steps:
            return
        for short, (long_name, mode, period) in self._anchors.items():
            per_step = [[[[step[long_name]]]] for step in self._steps]
            self._memory[short] = _outputs.select(per_step, mode, period)[0]
        self._steps = []

    def get(self, short_name: str) -> torch.Tensor:
        assert short_name in self._memory, "No tensor with name " + short_name + " found."
        return self._memory[short_name]


__all__ = ["AnchorMemory", "FINAL_LOSS_SCALE", "UPDATED_VAR"]
