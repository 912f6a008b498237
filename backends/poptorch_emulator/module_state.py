"""What compiling a model fixes of its module's state besides the weights, as PopTorch's dispatcher does
(python/_poplar_executor.py, python/_impl.py; the user guide's "PyTorch buffers"):

- Parameters and buffers keep their storage: a forward that reassigns one (``self.y = x`` instead of
  ``self.y.copy_(x)``) or removes one is refused when the model compiles, with PopTorch's texts. Batch-norm
  modules, whose buffers PopTorch lets change, are not checked.
- A tensor attribute that is neither a parameter nor a buffer is a constant of the graph: the value it had when
  the graph was traced. The trace runs the forward once on the host (an in-place update there stays, once);
  every later call starts from the traced value again, so ``self.i += 1`` returns the same on every call.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from .poptorch_core import py_error

BUFFERS_CAN_CHANGE = (torch.nn.modules.batchnorm._BatchNorm,)


def addresses(model: torch.nn.Module) -> tuple[dict[str, int], dict[str, int]]:
    """(buffer name -> storage address, parameter name -> storage address) of ``model``."""
    buffers = {name: buf.data_ptr() for module_name, module in model.named_modules()
               if not isinstance(module, BUFFERS_CAN_CHANGE)
               for name, buf in module.named_buffers(prefix=module_name, recurse=False)}
    return buffers, {name: p.data_ptr() for name, p in model.named_parameters()}


def check_addresses(before: tuple[dict[str, int], dict[str, int]], model: torch.nn.Module) -> None:
    """PopTorch's error for a buffer or parameter the traced forward removed or replaced."""
    for kind, old, new in zip(("Buffer", "Parameter"), before, addresses(model)):
        for name, address in old.items():
            if name not in new:
                raise py_error(f"{kind} {name} is removed from the model when calling the forward method.")
            if new[name] != address:
                raise py_error(f"{kind} {name} is reassigned within the model when calling the forward method. "
                               f"This is not supported. Consider using self.{name}.copy_(src) to copy data from "
                               "a source tensor, where src is the name of the source tensor.")


def tensor_constants(model: torch.nn.Module) -> dict[tuple[torch.nn.Module, str], torch.Tensor]:
    """Each plain tensor attribute of ``model``'s modules (neither parameter nor buffer), copied: the
    constants a trace now would put in the graph."""
    return {(module, name): value.detach().clone() for module in model.modules()
            for name, value in vars(module).items() if isinstance(value, torch.Tensor)}


@contextlib.contextmanager
def from_constants(constants: dict[tuple[torch.nn.Module, str], torch.Tensor]) -> Iterator[None]:
    """A compiled graph's run: each plain tensor attribute reads as (a copy of) its traced value, and the
    host's own attribute is put back afterwards, whatever the forward did to the copy."""
    if not constants:  # most models: nothing to swap around each micro-batch's forward
        yield
        return
    held = {key: vars(key[0]).get(key[1]) for key in constants}
    for (module, name), value in constants.items():
        setattr(module, name, value.clone())
    try:
        yield
    finally:
        for (module, name), value in held.items():
            setattr(module, name, value)
