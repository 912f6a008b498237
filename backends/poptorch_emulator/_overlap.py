"""Overlapped host IO (``set_overlap_for_input`` / ``set_overlap_for_output``) as PopTorch's compiler checks it.

The emulator copies nothing to IO tiles, so overlap changes no result; what it keeps are the compile-time
rules, checked on the traced forward of a compilation (the first micro-batch), in PopTorch's order:

1. an input marked for overlap is read by no other op ("must be the only op applied to an input");
2. an output marked for overlap is returned once, counting the unmarked tensor and nested tuples/lists;
3. a mark on a tensor that is not an input (or not returned) is refused;
4. when any mark asks for overlap (a mode other than ``NoOverlap``): no ``PipelinedExecution``, IO tiles
   allocated (``opts.TensorLocations.numIOTiles``), output mode ``All`` or ``Sum``.

While tracing, a mark returns a view of its tensor, so that later ops read the view and not the input (as
they read the set_overlap node's output in PopTorch's graph); outside a trace it returns the tensor itself.
:func:`~.execution_strategy.tracing` collects the marks; ``check`` runs when the traced forward returns.
"""

from __future__ import annotations

import contextvars
from typing import Any

import torch

from . import _structure
from .enums import OutputMode, OverlapMode
from .poptorch_core import compiler_error

_PIPELINED = "Overlapped IO is not supported with poptorch.PipelinedExecution. If you are using only one IPU, " \
             "please switch to poptorch.ShardedExecution."


class OverlapMarks:
    """One traced forward's overlap marks: the model's input tensors (by identity, with their names), which
    of them ops other than a mark read, and the marks set on inputs and outputs."""

    def __init__(self, inputs: Any) -> None:
        self._names: dict[int, str] = {}
        for name, value in [*zip(inputs.names, inputs.args), *inputs.kwargs.items()]:
            for tensor in _structure.flatten(value):
                self._names.setdefault(id(tensor), name)
        self._inputs = inputs  # held, so that the ids above stay theirs
        self._read: set[int] = set()
        self._input_marks: list[tuple[int, OverlapMode]] = []  # (id of the tensor marked, mode)
        self._output_marks: list[tuple[torch.Tensor, torch.Tensor, OverlapMode]] = []  # (tensor, its view, mode)
        self.marking = False  # a mark's own view is being made: not an op of the model

    def saw_op(self, args: tuple, kwargs: dict | None) -> None:
        """An op of the model ran on ``args``/``kwargs`` (metadata reads excluded by the caller)."""
        for value in _structure.flatten((args, kwargs or {})):
            if id(value) in self._names:
                self._read.add(id(value))

    def _view(self, tensor: torch.Tensor) -> torch.Tensor:
        self.marking = True
        try:
            return tensor.view(tensor.shape)
        finally:
            self.marking = False

    def mark_input(self, tensor: torch.Tensor, mode: OverlapMode) -> torch.Tensor:
        self._input_marks.append((id(tensor), mode))
        return self._view(tensor)

    def mark_output(self, tensor: torch.Tensor, mode: OverlapMode) -> torch.Tensor:
        view = self._view(tensor)
        self._output_marks.append((tensor, view, mode))
        return view

    def check(self, outputs: Any, options: Any) -> None:
        """PopTorch's errors for the marks of this forward, which returned ``outputs``, under ``options``."""
        marked = [key for key, _ in self._input_marks]
        for key in dict.fromkeys(marked):
            if key in self._names and (key in self._read or marked.count(key) > 1):
                raise compiler_error("poptorch.set_overlap_for_input must be the only op applied to an input. "
                                     f"This is not the case for input {self._names[key]} to the model.")
        returned = [id(t) for t in _structure.flatten(outputs)]
        for tensor, view, _ in self._output_marks:
            same = {id(tensor)} | {id(v) for t, v, _ in self._output_marks if t is tensor}  # one tensor, its views
            if id(view) in returned and sum(returned.count(key) for key in same) > 1:
                raise compiler_error("poptorch.set_overlap_for_output cannot be used with a tensor that is returned "
                                     "twice. Please check all returned tensors including those nested in "
                                     "tuples/lists.")
        if any(key not in self._names for key in marked):
            raise compiler_error("poptorch.set_overlap_for_input applied on a node which is not a tensor input to "
                                 "the model.")
        if any(id(view) not in returned for _, view, _ in self._output_marks):
            raise compiler_error("poptorch.set_overlap_for_output applied on a node which is not a tensor output to "
                                 "the model.")
        if all(mode == OverlapMode.NoOverlap for _, mode in self._input_marks) \
                and all(mode == OverlapMode.NoOverlap for _, _, mode in self._output_marks):
            return
        if getattr(options._execution_strategy, "mode", "") == "pipelined":
            raise compiler_error(_PIPELINED)
        if not options.TensorLocations.toDict().get("numIOTiles"):
            raise compiler_error("No IO tiles allocated. You must allocate at least 32 IO tiles using "
                                 "poptorch.Options().TensorLocations.numIOTiles.")
        if OutputMode(options.output_mode) not in (OutputMode.All, OutputMode.Sum):  # Default: resolved by now
            raise compiler_error("Unsupported output mode for overlapped IO. Please switch output mode to "
                                 "poptorch.OutputMode.All or poptorch.OutputMode.Sum.")


# the marks of the forward a compilation traces now (None: no trace, a mark returns its tensor)
ACTIVE: contextvars.ContextVar[OverlapMarks | None] = contextvars.ContextVar("poptorch_emulator_overlap",
                                                                            default=None)

__all__ = ["ACTIVE", "OverlapMarks"]
