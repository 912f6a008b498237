"""PopTorch's operations for a model's ``forward`` (python/ops.py), run as their host equivalents.

On an IPU these are graph annotations or on-device control flow; on the CPU each computes what the IPU
computes: ``ipu_print_tensor`` prints the tensor to stderr in Poplar's layout (and, in the backward pass, its
gradient) and returns it; ``set_available_memory``, ``nop``, ``recomputationCheckpoint`` and
``set_overlap_for_input/output`` return their tensors' values unchanged (their compile-time rules:
:mod:`._overlap`); ``serializedMatMul`` is one matmul
(splitting it changes memory, not values); ``for_loop``, ``cond`` (inference only, as on an IPU),
``dynamic_slice`` and ``dynamic_update`` run their loop, branch or slice eagerly.
The argument checks and their error texts are PopTorch's.
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Callable

import torch
from torch.utils import _pytree

from . import _overlap
from .enums import MatMulSerializationMode, OverlapMode
from .ops import isRunningOnIpu
from .poptorch_core import py_error

_FLOAT_FORMATS = ("auto", "fixed", "scientific", "none")


def _need_tensor(value: Any, message: str) -> None:
    if not isinstance(value, torch.Tensor):
        raise py_error(f"{message} {type(value)} is not supported.")


def _number(value: float | int, digits: int, float_format: str) -> str:
    """One element as Poplar prints it: ``digits`` significant digits."""
    if isinstance(value, int):
        return str(value)
    if float_format == "scientific":
        return f"{value:.{max(digits - 1, 0)}e}"
    if float_format == "fixed":
        whole = len(str(int(abs(value)))) if abs(value) >= 1 else 1
        return f"{value:.{max(digits - whole, 0)}f}"
    return f"{value:.{digits}g}" if digits else repr(value)


@dataclasses.dataclass(frozen=True)
class _Layout:
    """PopTorch's print options (ipu_print_tensor's arguments)."""

    summarise_threshold: int
    edge_items: int
    max_line_width: int
    digits: int
    float_format: str
    separator: str
    open_bracket: str
    close_bracket: str

    def items(self, values: list[Any], summarise: bool) -> list[Any]:
        """``values``, or its edge items around an ellipsis when the tensor is summarised."""
        if summarise and len(values) > 2 * self.edge_items:
            return [*values[:self.edge_items], "...", *values[-self.edge_items:]]
        return values

    def row(self, values: list[Any], indent: int, summarise: bool) -> str:
        """One innermost dimension, wrapped after a separator past ``max_line_width``."""
        words = [v if v == "..." else _number(v, self.digits, self.float_format)
                 for v in self.items(values, summarise)]
        lines, line = [], " " * indent + self.open_bracket
        for k, word in enumerate(words):
            piece = word if k == 0 else self.separator + word
            if k and self.max_line_width and len(line) + len(piece) > self.max_line_width:
                lines.append((line + self.separator).rstrip())
                line = " " * (indent + 2) + word
            else:
                line += piece
        return "\n".join([*lines, line + self.close_bracket])

    def text(self, values: Any, indent: int, summarise: bool) -> str:
        """A nested list of values: rows on lines of their own, one space deeper a dimension."""
        if not isinstance(values, list):
            return " " * indent + _number(values, self.digits, self.float_format)
        if not values or not isinstance(values[0], list):
            return self.row(values, indent, summarise)
        inner = [" " * (indent + 1) + "..." if v == "..." else self.text(v, indent + 1, summarise)
                 for v in self.items(values, summarise)]
        pad = " " * indent
        return "\n".join([pad + self.open_bracket, *inner, pad + self.close_bracket])

    def show(self, title: str, tensor: torch.Tensor) -> None:
        values = tensor.detach().cpu()
        values = (values.double() if values.is_floating_point() else values).tolist()
        summarise = bool(self.summarise_threshold) and tensor.numel() > self.summarise_threshold
        print(f"{title}: {self.text(values, 0, summarise).lstrip()}", file=sys.stderr, flush=True)


def ipu_print_tensor(tensor: torch.Tensor, title: str = "", print_gradient: bool = True,
                     summarise_threshold: int = 1000, edge_items: int = 3, max_line_width: int = 80,
                     digits: int = 4, float_format: str = "auto", separator: str = ", ", open_bracket: str = "(",
                     close_bracket: str = ")") -> torch.Tensor:
    """Print ``tensor`` when the graph runs (its gradient too, titled ``<title>_gradient``, when the
    backward pass reaches it); returns the tensor, which the rest of the model must use."""
    _need_tensor(tensor, "ipu print tensor must take a torch.tensor argument.")
    if float_format not in _FLOAT_FORMATS:
        raise KeyError(float_format)
    layout = _Layout(summarise_threshold, edge_items, max_line_width, digits, float_format, separator, open_bracket,
                     close_bracket)
    layout.show(title, tensor)
    out = tensor.view_as(tensor)
    if print_gradient and out.requires_grad:
        out.register_hook(lambda grad: layout.show(f"{title}_gradient", grad))
    return out


def set_available_memory(tensor: torch.Tensor, available_memory_proportion: float) -> torch.Tensor:
    """The share of tile memory the operation producing ``tensor`` may use for temporaries: a planning
    hint, the same numbers."""
    _need_tensor(tensor, "You may only set available memory for torch.tensor values.")
    return tensor


def nop(tensor: torch.Tensor) -> torch.Tensor:
    """An identity no graph pass removes."""
    _need_tensor(tensor, "nop must take a torch.tensor argument.")
    return tensor


def recomputationCheckpoint(*tensors: Any) -> Any:
    """Keep these tensors between the forward and backward passes instead of recomputing them; one tensor
    in, one out; several (or one tuple or list of them) in, a tuple (or the same kind of sequence) out."""
    if len(tensors) == 1 and isinstance(tensors[0], (tuple, list)):
        return type(tensors[0])(recomputationCheckpoint(*tensors[0]))
    if not all(isinstance(t, torch.Tensor) for t in tensors):
        raise ValueError("All inputs must be tensors")
    return tensors[0] if len(tensors) == 1 else tuple(tensors)


def serializedMatMul(lhs: torch.Tensor, rhs: torch.Tensor, mode: MatMulSerializationMode, factor: int = 0,
                     keep_precision: bool = False) -> torch.Tensor:
    """``lhs @ rhs``, which an IPU computes in ``factor`` pieces along ``mode``'s dimension."""
    assert isinstance(keep_precision, bool)
    assert isinstance(factor, int)
    assert isinstance(mode, MatMulSerializationMode)
    return torch.matmul(lhs, rhs)


def _with_overlap(tensors: Any, mode: OverlapMode, direction: str) -> Any:
    marks = _overlap.ACTIVE.get()

    def mark(value: Any) -> Any:
        _need_tensor(value, f"You may only set overlap for torch.tensor {direction}.")
        if marks is None:
            return value
        return marks.mark_input(value, mode) if direction == "inputs" else marks.mark_output(value, mode)
    assert isinstance(mode, OverlapMode)
    return _pytree.tree_map(mark, tensors)


def set_overlap_for_input(input_tensors: Any, mode: OverlapMode) -> Any:
    """Let the host's copy of these inputs of the model overlap computation (IO tiles); returns them. The
    compilation refuses it on a tensor that is not an input or that other ops read too (:mod:`._overlap`)."""
    return _with_overlap(input_tensors, mode, "inputs")


def set_overlap_for_output(output_tensors: Any, mode: OverlapMode) -> Any:
    """Let the copy of these outputs to the host overlap computation (IO tiles); returns them. The
    compilation refuses it on a tensor the model does not return once (:mod:`._overlap`)."""
    return _with_overlap(output_tensors, mode, "outputs")


def _as_list(outputs: Any) -> list[torch.Tensor]:
    return list(outputs) if isinstance(outputs, (list, tuple)) else [outputs]


def _inference_only(op: str) -> None:
    """On-device control flow compiles into inference graphs only (a training model's forward runs with
    gradients; on the host, outside a model, PopTorch runs the op as Python)."""
    if isRunningOnIpu() and torch.is_grad_enabled():
        raise py_error(f"poptorch.{op}() is only supported in inference.")


def for_loop(count: int, body: Callable[..., Any], inputs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Run ``body`` ``count`` times, each time on the previous outputs (``inputs`` the first time); the
    body takes as many tensors as it returns, and its inputs are passed by value."""
    if not isinstance(inputs, list):
        raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
                         "(Object is not list)")
    for index, tensor in enumerate(inputs):
        if not isinstance(tensor, torch.Tensor):
            raise ValueError("poptorch.for_loop expects input tensors (inputs) to be a list of tensors. "
                             f"(Object contained in list at index {index} is not torch.tensor)")
    _inference_only("for_loop")
    values = [t.clone() for t in inputs]
    for _ in range(count):
        values = _as_list(body(*values))
        if len(values) != len(inputs):
            raise py_error(f"poptorch.for_loop: the body returned {len(values)} tensors for "
                           f"{len(inputs)} inputs: it must return as many as it takes")
    return values


def cond(condition: torch.Tensor, then_body: Callable[..., Any], then_inps: list[torch.Tensor],
         else_body: Callable[..., Any], else_inps: list[torch.Tensor]) -> list[torch.Tensor]:
    """``then_body(*then_inps)`` where ``condition`` holds, else ``else_body(*else_inps)``, as a list."""
    if not isinstance(then_inps, list) or not isinstance(else_inps, list):
        raise ValueError("poptorch.cond expects then_inps and else_inps tensors to be a list of tensors. "
                         "(Object is not list)")
    _inference_only("cond")
    return _as_list(then_body(*then_inps) if bool(condition) else else_body(*else_inps))


def _check_slice(dim: Any, start: Any, size: Any, op: str) -> None:
    if not isinstance(dim, int):
        raise py_error("Dimension must be an integer.")
    if not isinstance(start, torch.Tensor):
        raise py_error(f"Slice start argument to {op} must be a torch.tensor. {type(start)} is not supported.")
    if not isinstance(size, int):
        raise py_error("Size must be an integer.")
    if size == 0:
        raise py_error("The start and end of a slice must be different.")
    if size < 0:
        raise py_error("Taking a slice of a tensor with the end less than the start is not supported.")


def _first(start: torch.Tensor, tensor: torch.Tensor, dim: int, size: int) -> int:
    """Where a slice of ``size`` starts: the graph's start is a value of the run, brought into the tensor as
    the device's dynamic slice does (the start a compilation traces with may lie anywhere)."""
    return min(max(int(start.reshape(-1)[0]), 0), max(tensor.shape[dim] - size, 0))


def _device_dtype(dtype: torch.dtype) -> torch.dtype:
    """The type a host tensor has on the device: PopTorch runs 64-bit inputs as 32-bit ones."""
    return {torch.int64: torch.int32, torch.float64: torch.float32}.get(dtype, dtype)


def dynamic_slice(tensor: torch.Tensor, dim: int, start: torch.Tensor, size: int, step: int) -> torch.Tensor:
    """``tensor[start:start + size:step]`` along ``dim``, where ``start`` is a tensor (known when the graph
    runs) and ``size`` and ``step`` are constants."""
    _need_tensor(tensor, "dynamic_slice must take a torch.tensor input.")
    _check_slice(dim, start, size, "dynamic_slice")
    if not isinstance(step, int):
        raise py_error("Step must be an integer.")
    if tensor.shape[dim] % size:
        raise py_error(f"The size of the slice ({size}) must be a factor of the slicing dimension "
                       f"({tensor.shape[dim]}).")
    first = _first(start, tensor, dim, size)
    return tensor.narrow(dim, first, size).index_select(dim, torch.arange(0, size, step))


def dynamic_update(input: torch.Tensor, src: torch.Tensor, dim: int, start: torch.Tensor,  # noqa: A002
                   size: int) -> torch.Tensor:
    """``input`` with its ``size`` entries from ``start`` along ``dim`` replaced by ``src``."""
    _need_tensor(input, "dynamic_update must take a torch.tensor input.")
    _check_slice(dim, start, size, "dynamic_update")
    _need_tensor(src, "Src argument to dynamic_update must be a torch.tensor.")
    if input.dim() != src.dim():
        raise py_error(f"input and src tensors must have same dimensionality. ({input.dim()}) vs ({src.dim()})")
    if input.dtype != src.dtype:
        raise py_error(f"input and src tensor must have same dtype. ({_device_dtype(input.dtype)} vs "
                       f"{_device_dtype(src.dtype)})")
    first = _first(start, input, dim, size)
    out = input.clone()
    out.narrow(dim, first, size).copy_(src)
    return out


# PopTorch's names that the emulator does not provide: asked for, they name themselves in one line
NOT_EMULATED = ("CPU", "MultiConv", "MultiConvPlanType", "NameScope",
                "VariableRetrievalMode", "ctc_beam_search_decoder", "custom_op", "fps", "nearest", "load",
                "ipuHardwareVersion", "poptorchAtExit")


# PoplarExecutor's methods that need PopTorch's compiled executable: asked for, they name themselves, rather than
# reach the user's module (the executor forwards other names to it), whose own save() would run unnoticed
EXECUTOR_NOT_EMULATED = frozenset({"getTensorNames", "copyNamedBuffersToDevice", "loadExecutable", "save",
                                   "rng_state", "compileAndExport", "cycleCount"})


def not_emulated(name: str) -> AttributeError:
    """The error for a PopTorch name the emulator leaves out."""
    return AttributeError(f"poptorch.{name} is not emulated: it needs IPU hardware or PopTorch's compiler. Run "
                          f"this script on an IPU with the Poplar SDK, or leave poptorch.{name} out where "
                          "poptorch.IS_EMULATOR is True")


__all__ = ["EXECUTOR_NOT_EMULATED", "MatMulSerializationMode", "NOT_EMULATED",
           "OverlapMode", "cond", "dynamic_slice", "dynamic_update",
           "for_loop", "ipu_print_tensor", "nop", "not_emulated", "recomputationCheckpoint", "serializedMatMul",
           "set_available_memory", "set_overlap_for_input", "set_overlap_for_output"]
