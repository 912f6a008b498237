"""Output modes: which micro-batches' outputs a host call returns, and in what shape.

Reproduces PopTorch/PopART's anchors (popart_compiler/source/Compiler.cpp ``popartBatchDimForAnchor`` and
poptorch/source/PoplarExecutable.cpp): an output is returned for m micro-batches, m = R*D*G for All,
R*D*G/N for EveryN(N), R for Final and Sum. If m > 1 the results are joined along dim 0 in [D, G, R] order
(a scalar becomes a [m] tensor); if m == 1 the shape is unchanged. ``int64`` outputs come back as
``int32`` and ``float64`` as ``float32``, as they do from an IPU.
"""

from __future__ import annotations

from typing import List

import torch

from .enums import OutputMode
from .poptorch_core import py_error

# outputs[d][g][r] = the flat list of one micro-batch's output tensors
MicroOutputs = List[List[List[List[torch.Tensor]]]]


def check_period(mode: OutputMode, period: int, device_iterations: int) -> None:
    if mode == OutputMode.EveryN and device_iterations % period != 0:
        raise py_error(
            f"Options.outputMode(EveryN, output_return_period={period}): the return period must be a "
            f"factor of Options.deviceIterations({device_iterations})")


def to_host_dtype(t: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.int64:
        return t.int()
    if t.dtype == torch.float64:
        return t.float()
    return t


def _backward_error() -> None:
    raise py_error("backward() cannot be called explicitly on outputs of a PopTorch model. If you're using a "
                   "trainingModel, the backwards pass is performed automatically when invoking the model. If "
                   "you're using an inferenceModel, you should use a trainingModel instead.")


def forbid_backward(outputs: list[torch.Tensor]) -> None:
    """As PopTorch: ``backward()`` on an output raises (the backward pass runs on the device)."""
    for t in outputs:
        if isinstance(t, torch.Tensor):
            t.backward = _backward_error  # type: ignore[method-assign]


def _join(parts: list[torch.Tensor]) -> torch.Tensor:
    if len(parts) == 1:
        return parts[0]
    if parts[0].dim() == 0:
        return torch.stack(parts)
    return torch.cat(parts, dim=0)


def select(outputs: MicroOutputs, mode: OutputMode, period: int) -> list[torch.Tensor]:
    """One host tensor per flat output, as the output mode returns it."""
    D, G, R = len(outputs), len(outputs[0]), len(outputs[0][0])
    n_out = len(outputs[0][0][0])
    if mode == OutputMode.All:
        keys = [(d, g, r) for d in range(D) for g in range(G) for r in range(R)]
    elif mode == OutputMode.EveryN:
        keys = [(d, g, r) for d in range(period - 1, D, period) for g in range(G) for r in range(R)]
    elif mode == OutputMode.Final:
        keys = [(D - 1, G - 1, r) for r in range(R)]
    elif mode == OutputMode.Sum:
        result = []
        for k in range(n_out):
            per_replica = [sum(outputs[d][g][r][k] for d in range(D) for g in range(G)) for r in range(R)]
            result.append(_join(per_replica))
        return result
    else:
        raise AssertionError(f"Unexpected output mode {mode!r}")
    return [_join([outputs[d][g][r][k] for d, g, r in keys]) for k in range(n_out)]
