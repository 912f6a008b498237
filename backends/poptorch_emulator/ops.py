"""PopTorch operations the emulator provides: ``identity_loss`` and ``isRunningOnIpu``."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

# True while an emulated executor runs the user's model (PopTorch: while the model is traced for the IPU).
_ON_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("poptorch_emulator_on_device",
                                                                  default=False)


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the model's loss, reduced as a PyTorch loss would be.

    ``reduction`` is ``"sum"``, ``"mean"`` or ``"none"``; anything else is an ``AssertionError`` with
    PopTorch's text. On the emulator the loss is the last output of the model's forward, as it is when a
    PopTorch model returns ``(output, loss)``.
    """
    if reduction == "sum":
        return x.sum()
    if reduction == "mean":
        return x.mean()
    if reduction != "none":
        raise AssertionError("Unsupported reduction type!")
    # PopTorch returns a new tensor even when nothing is reduced.
    return x.clone() if x.requires_grad else x


def isRunningOnIpu() -> bool:
    """True inside a model run by an emulated ``trainingModel``/``inferenceModel``, False outside."""
    return _ON_DEVICE.get()


@contextlib.contextmanager
def _running_on_device() -> Iterator[None]:
    token = _ON_DEVICE.set(True)
    try:
        yield
    finally:
        _ON_DEVICE.reset(token)


__all__ = ["identity_loss", "isRunningOnIpu"]
