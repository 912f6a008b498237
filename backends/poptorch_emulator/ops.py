"""PopTorch operations the emulator provides: ``identity_loss`` and ``isRunningOnIpu``; and how a training
model's loss is found, as PopTorch finds it.

PopTorch finds the loss in the traced graph, not by the position of an output: every torch loss function and
every ``poptorch.identity_loss`` is a loss; a loss that feeds another loss is not final; exactly one final
loss must remain ("Couldn't find a loss in graph!" when there is none, "Multiple independent losses found in
graph..." when there are more). The emulator marks each loss with an identity autograd node as it is
computed (a torch function mode sees the torch loss functions, however they were imported) and applies the
same rule to the marks.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .poptorch_core import py_error

NO_LOSS_ERR = "Couldn't find a loss in graph!"
MULTIPLE_LOSSES_ERR = ("Multiple independent losses found in graph. Graph must have one final loss. Wrap final "
                       "graph loss in poptorch.identity_loss.")
_TORCH_LOSS_NAMES = ("cross_entropy", "nll_loss", "mse_loss", "l1_loss", "smooth_l1_loss", "huber_loss",
                     "binary_cross_entropy", "binary_cross_entropy_with_logits", "kl_div", "poisson_nll_loss",
                     "gaussian_nll_loss", "hinge_embedding_loss", "soft_margin_loss", "cosine_embedding_loss",
                     "margin_ranking_loss", "triplet_margin_loss", "triplet_margin_with_distance_loss",
                     "ctc_loss", "multilabel_soft_margin_loss", "multilabel_margin_loss", "multi_margin_loss")
_TORCH_LOSSES = frozenset(getattr(F, name) for name in _TORCH_LOSS_NAMES if hasattr(F, name))
# the losses marked in the training run under way (None outside one)
_MARKED: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar("poptorch_emulator_losses",
                                                                                    default=None)


class _LossMark(torch.autograd.Function):
    """The identity, as its own autograd node: where the graph has a loss."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _Losses(list):
    """The losses marked, and the tensors each was computed from: a loss needing no gradient (a model whose
    parameters are all frozen) has no autograd graph to say which loss feeds which."""

    def __init__(self) -> None:
        super().__init__()
        self.sources: list[Any] = []


def _mark(x: torch.Tensor, sources: Any = ()) -> torch.Tensor:
    marked = _MARKED.get()
    if marked is None or not isinstance(x, torch.Tensor):
        return x
    if x.requires_grad:
        x = _LossMark.apply(x)
    marked.append(x)  # one that needs no gradient too: a frozen model has a loss
    marked.sources.extend(sources)
    return x


class _MarkTorchLosses(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        return _mark(out, (*args, *(kwargs or {}).values())) if func in _TORCH_LOSSES else out


@contextlib.contextmanager
def finding_losses() -> Iterator[list[torch.Tensor]]:
    """Within: every torch loss and identity_loss computed is marked and listed (see :func:`final_loss`)."""
    marked = _Losses()
    token = _MARKED.set(marked)
    try:
        with _MarkTorchLosses():
            yield marked
    finally:
        _MARKED.reset(token)


def final_loss(marked: list[torch.Tensor]) -> torch.Tensor:
    """The one loss no other loss uses, by PopTorch's rule; its errors otherwise. Losses that need no gradient
    count only where none does (a frozen model), a loss feeding another when it is one of its arguments."""
    if not marked:
        raise py_error(NO_LOSS_ERR)
    if all(t.grad_fn is None for t in marked):
        fed = {id(s) for s in getattr(marked, "sources", ())}
        final = [t for t in marked if id(t) not in fed]
        if len(final) != 1:
            raise py_error(MULTIPLE_LOSSES_ERR)
        return final[0]
    marked = [t for t in marked if t.grad_fn is not None]
    nodes = {t.grad_fn for t in marked}
    used: set[Any] = set()
    for tensor in marked:
        todo, seen = [f for f, _ in tensor.grad_fn.next_functions if f is not None], set()
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            if node in nodes:
                used.add(node)
            todo.extend(f for f, _ in node.next_functions if f is not None)
    final = [t for t in marked if t.grad_fn not in used]
    if len(final) != 1:
        raise py_error(MULTIPLE_LOSSES_ERR)
    return final[0]

# True while an emulated executor runs the user's model (PopTorch: while the model is traced for the IPU).
_ON_DEVICE: contextvars.ContextVar[bool] = contextvars.ContextVar("poptorch_emulator_on_device",
                                                                  default=False)


def identity_loss(x: torch.Tensor, reduction: str) -> torch.Tensor:
    """Mark ``x`` as the model's loss, reduced as a PyTorch loss would be.

    ``reduction`` is ``"sum"``, ``"mean"`` or ``"none"``; anything else is an ``AssertionError`` with
    PopTorch's text. A loss it wraps (a torch loss, or another identity_loss) is then not a final loss.
    """
    given = x
    if reduction == "sum":
        x = x.sum()
    elif reduction == "mean":
        x = x.mean()
    elif reduction != "none":
        raise AssertionError("Unsupported reduction type!")
    else:
        x = x.clone() if x.requires_grad else x  # PopTorch returns a new tensor even when nothing is reduced
    return _mark(x, (given,))


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
