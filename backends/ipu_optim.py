"""Optimizers on the IPU: torch's SGD / Adam / AdamW / RMSprop become their ``poptorch.optim`` counterparts.

An IPU keeps the optimizer state (momenta, Adam's moments and step counts) on the device. PopTorch reads it
back (``optimizer.state_dict()`` after a step, and on detaching) and writes it again (on attaching, or
after ``optimizer.load_state_dict``) only for its own ``poptorch.optim`` optimizers; with torch's, a
checkpoint holds the never-stepped host optimizer's empty state and every compiled graph keeps moments of
its own. :func:`to_poptorch_optimizer` therefore swaps an agent's torch optimizer (``--optimizer sgd|adam|
adamw``) for the poptorch class of the same name, with every parameter group and hyper-parameter carried
over. Any other optimizer is passed on as it is, so PopTorch accepts it or refuses it with its own error
(``torch.optim.Adagrad``: "Unsupported optimizer type ...").

One optimizer state for all graphs: the engine detaches a graph before attaching the next, PopTorch reads
the state back on detaching and writes it to the next graph on attaching, so the bucket graphs of one run
continue one Adam state, as the single model on the CPU does.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any

import torch

log = logging.getLogger("accelbatch.ipu")

# torch's class -> poptorch.optim's class of the same semantics (exact classes: a subclass may change the maths)
KINDS = {torch.optim.SGD: "SGD", torch.optim.Adam: "Adam", torch.optim.AdamW: "AdamW", torch.optim.RMSprop: "RMSprop"}


def is_poptorch_optimizer(poptorch: Any, optimizer: Any) -> bool:
    base = getattr(getattr(poptorch, "optim", None), "Optimizer", None)
    return base is not None and isinstance(optimizer, base)


def to_poptorch_optimizer(poptorch: Any, optimizer: torch.optim.Optimizer | None) -> torch.optim.Optimizer | None:
    """The ``poptorch.optim`` optimizer for ``optimizer`` (same parameters, groups and hyper-parameters), or
    ``optimizer`` itself when it already is one or has no poptorch counterpart."""
    if optimizer is None or is_poptorch_optimizer(poptorch, optimizer):
        return optimizer
    name = KINDS.get(type(optimizer))
    cls = getattr(getattr(poptorch, "optim", None), name or "", None)
    if cls is None:
        return optimizer
    accepted = set(inspect.signature(cls.__init__).parameters) - {"self", "params"}
    defaults = {k: v for k, v in optimizer.defaults.items() if k in accepted}
    if "loss_scaling" in accepted and hasattr(optimizer, "loss_scaling"):  # --ipu-loss-scaling (fp16)
        defaults["loss_scaling"] = optimizer.loss_scaling
    groups = [dict(group) for group in optimizer.param_groups]  # every group keeps its own values (lr, betas...)
    return cls(groups, **defaults)


def dropped_state_notice(optimizer: torch.optim.Optimizer | None) -> str | None:
    """What :func:`to_poptorch_optimizer` leaves behind of ``optimizer``: the state a host optimizer holds (an
    earlier run's Adam moments, say) in torch's format, which cannot be written to the IPU; None when none."""
    if optimizer is None or not any(optimizer.state.values()):
        return None
    return (f"ipu: the {type(optimizer).__name__} state the host optimizer holds (torch's format) cannot be "
            "written to the IPU; the device starts it afresh")


def load_optimizer_state(poptorch: Any, optimizer: torch.optim.Optimizer, state: dict[str, Any]) -> None:
    """Load a checkpoint's optimizer state; one written by another device (torch's format, no ``ipu_state``)
    cannot go to the IPU: its hyper-parameters are kept and the device's state starts afresh (said)."""
    if is_poptorch_optimizer(poptorch, optimizer) and "ipu_state" not in state:
        log.warning("ipu: the checkpoint's optimizer state was written by another device (torch's format); "
                    "the IPU's optimizer state starts afresh")
        torch.optim.Optimizer.load_state_dict(optimizer, state)
        optimizer.state.clear()  # the host copy never steps; the device's is what counts
        return
    optimizer.load_state_dict(state)


__all__ = ["KINDS", "dropped_state_notice", "is_poptorch_optimizer", "load_optimizer_state", "to_poptorch_optimizer"]
