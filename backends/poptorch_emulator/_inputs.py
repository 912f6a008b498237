"""A model call's inputs: binding to ``forward``'s parameters, checks against the compiled inputs,
the batch-dimension check, and the split of the combined batch into micro-batches.

Texts reproduced from PopTorch: python/_args_parser.py (binding, "... mismatch for {name}: expected ...
but got ...") and python/_poplar_executor.py ``_narrow_tensor`` ("Invalid batch dimension: ...").
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any

import torch

from . import _structure
from .custom_args import parser_for
from .enums import CommGroupType
from .poptorch_core import py_error

RECOMPILE_HINT = (
    "\nThis error occurred because the inputs passed at runtime"
    " don't match the inputs used to compile the model.\n"
    "To recompile the model for the new inputs create a new "
    "inferenceModel / trainingModel wrapper or call destroy() on "
    "the curent one and try again.")


@dataclass
class BoundInputs:
    """Positional inputs in ``forward``'s order (with their names) and the named ones left over."""

    args: list[Any] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    kwargs: dict[str, Any] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return _structure.flatten((self.args, self.kwargs))

    def map(self, fn) -> "BoundInputs":
        args, kwargs = _structure.map_tensors((self.args, self.kwargs), fn)
        return BoundInputs(list(args), list(self.names), dict(kwargs))


class ArgBinder:
    """Binds ``model(*args, **kwargs)`` to the parameters of ``model.forward`` as PopTorch does."""

    def __init__(self, model: Any) -> None:
        fn = model.forward if isinstance(model, torch.nn.Module) else model
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            sig = None
        if sig is None:
            self._names = ["args", "kwargs"]
            self._kinds = [inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD]
            self._defaults: dict[str, Any] = {}
        else:
            self._names = list(sig.parameters)
            self._kinds = [p.kind for p in sig.parameters.values()]
            self._defaults = {n: p.default for n, p in sig.parameters.items()
                              if p.default is not inspect.Parameter.empty}
        self._variadic = any(k in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
                             for k in self._kinds)

    def __call__(self, args: tuple, kwargs: dict[str, Any]) -> BoundInputs:
        if not self._variadic and len(args) + len(kwargs) > len(self._names):
            raise AssertionError("Too many arguments provided: expected %s (%d) but got %d"
                                 % (self._names, len(self._names), len(args) + len(kwargs)))
        if not self._variadic:
            for k in kwargs:
                if k not in self._names:
                    raise AssertionError(f"{k} is not a valid parameter.Allowed values are {self._names}")
        out = BoundInputs()
        args = list(args)
        after_var_positional = False
        for i, (name, kind) in enumerate(zip(self._names, self._kinds)):
            if kind == inspect.Parameter.VAR_KEYWORD:
                used = set(self._names[:i])
                for k, v in kwargs.items():
                    if k not in used:
                        out.kwargs[k] = v
            elif kind == inspect.Parameter.VAR_POSITIONAL:
                after_var_positional = True
                for idx, value in enumerate(args[i:]):
                    out.args.append(value)
                    out.names.append(f"*{name}[{idx}]")
                args = args[:i]
            elif i < len(args):
                if name in kwargs:
                    raise AssertionError("Parameter %s was passed more than once" % name)
                out.args.append(args[i])
                out.names.append(name)
            elif name in kwargs or name in self._defaults:
                value = kwargs[name] if name in kwargs else self._defaults[name]
                if after_var_positional:
                    out.kwargs[name] = value
                else:
                    out.args.append(value)
                    out.names.append(name)
            else:
                raise py_error(f"Mandatory parameter {name} missing")
        return out


def _spec(value: Any) -> Any:
    """What is kept of a compiled input: tensors become shape/dtype-only (meta) tensors."""
    return _structure.map_tensors(
        value, lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))


class CompiledInputs:
    """The inputs an executable was compiled for; checks later calls against them."""

    def __init__(self, inputs: BoundInputs) -> None:
        self.names = list(inputs.names)
        self.args = [_spec(a) for a in inputs.args]
        self.kwargs = {k: _spec(v) for k, v in inputs.kwargs.items()}

    def shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Input name -> (shape, dtype) of each top-level tensor input."""
        out = {}
        for name, a in [*zip(self.names, self.args), *self.kwargs.items()]:
            if isinstance(a, torch.Tensor):
                out[name] = (tuple(a.shape), a.dtype)
        return out

    def validate(self, inputs: BoundInputs) -> None:
        if len(inputs.args) != len(self.args):
            raise py_error("Number of positional arguments mismatch: expected "
                           f"{len(self.args)} arguments but got {len(inputs.args)}.{RECOMPILE_HINT}")
        for name, compiled, given in zip(self.names, self.args, inputs.args):
            _validate(name, compiled, given)
        _validate("named arguments", self.kwargs, inputs.kwargs, top_level_named=True)


def _validate(name: str, compiled: Any, given: Any, top_level_named: bool = False) -> None:
    if type(compiled) is not type(given):
        raise py_error(f"Type mismatch for {name}: expected {type(compiled)} but got {type(given)}."
                       f"{RECOMPILE_HINT}")
    if isinstance(compiled, (tuple, list)):
        if len(compiled) != len(given):
            raise py_error(f"Length mismatch for {name}: expected {len(compiled)} elements but got "
                           f"{len(given)}.{RECOMPILE_HINT}")
        for i, (c, g) in enumerate(zip(compiled, given)):
            _validate(f"{name}[{i}]", c, g)
    elif isinstance(compiled, dict):
        expected, provided = set(compiled), set(given)
        if expected != provided:
            details = []
            if provided - expected:
                details.append("Unexpected arguments: " + ", ".join(sorted(provided - expected)))
            if expected - provided:
                details.append("Missing arguments: " + ", ".join(sorted(expected - provided)))
            raise py_error(f"Keys mismatch for {name}: {'. '.join(details)}.{RECOMPILE_HINT}")
        for k, c in compiled.items():
            _validate(k if top_level_named else f"{name}[{k}]", c, given[k])
    elif isinstance(compiled, torch.Tensor):
        if compiled.dtype != given.dtype:
            raise py_error(f"Data type mismatch for {name}: expected {compiled.dtype} but got "
                           f"{given.dtype}.{RECOMPILE_HINT}")
        if compiled.shape != given.shape:
            raise py_error(f"Shape mismatch for {name}: expected {compiled.shape} but got "
                           f"{given.shape}.{RECOMPILE_HINT}")
    elif parser_for(compiled) is not None:  # a custom type: its parser lists the tensors to check
        flat, flat_given = _structure.flatten(compiled), _structure.flatten(given)
        if len(flat) != len(flat_given):
            raise py_error(f"Length mismatch for {name}: expected {len(flat)} tensors but got "
                           f"{len(flat_given)}.{RECOMPILE_HINT}")
        for i, (c, g) in enumerate(zip(flat, flat_given)):
            _validate(f"{name}[{i}]", c, g)
    elif compiled != given:
        raise py_error(f"Value mismatch for {name}: expected {compiled} but got {given}.{RECOMPILE_HINT}")


@dataclass(frozen=True)
class Batching:
    """How one host call's combined batch maps onto device iterations, accumulation and replicas."""

    device_iterations: int
    gradient_accumulation: int
    replication_factor: int
    input_group_size: int = 1
    orthogonal_groups: bool = False

    @classmethod
    def of(cls, options: Any) -> "Batching":
        """The batching of a model's ``poptorch.Options``."""
        return cls(device_iterations=options.device_iterations,
                   gradient_accumulation=options.Training.gradient_accumulation,
                   replication_factor=options.replication_factor, input_group_size=options.input_group_size,
                   orthogonal_groups=options.input_cgt == CommGroupType.Orthogonal)

    @property
    def input_groups(self) -> int:
        return self.replication_factor // self.input_group_size

    @property
    def split(self) -> int:
        """Micro-batches in the input: D x (R / input_group_size) x G."""
        return self.device_iterations * self.input_groups * self.gradient_accumulation

    def input_group_of(self, replica: int) -> int:
        if self.orthogonal_groups:
            return replica % self.input_groups
        return replica // self.input_group_size

    def micro_index(self, d: int, g: int, replica: int) -> int:
        """Where the rows of ``replica``'s micro-batch (d, g) are among the input's ``split`` micro-batches."""
        return (d * self.gradient_accumulation + g) * self.input_groups + self.input_group_of(replica)

    def check_batch_dim(self, tensor: torch.Tensor) -> None:
        """PopTorch's compile-time check that the batch dimension can be split (an AssertionError)."""
        b_size = 1 if tensor.dim() == 0 else tensor.shape[0]
        if b_size % self.split != 0:
            raise AssertionError(
                "Invalid batch dimension: In the input %s, the batch dimension (%d) must be a multiple "
                "of Options.deviceIterations(%d) * (Options.replicationFactor(%d) / "
                "Options.inputReplicaGrouping.input_group_size(%d)) * "
                "Options.Training.gradientAccumulation(%d) = %d because it is used to calculate the "
                "batch size which will be executed on the device in any given iteration. For a full "
                "explanation see the batching semantics page of the documentation."
                % (tensor.shape, b_size, self.device_iterations, self.replication_factor,
                   self.input_group_size, self.gradient_accumulation, self.split))

    def micro_batch(self, tensor: torch.Tensor, d: int, g: int, replica: int) -> torch.Tensor:
        """Rows of micro-batch (d, g) for ``replica``; the host layout is [D, G, R/group, b, ...]."""
        if tensor.dim() == 0:
            return tensor
        shaped = tensor.reshape(self.device_iterations, self.gradient_accumulation, self.input_groups,
                                tensor.shape[0] // self.split, *tensor.shape[1:])
        return shaped[d, g, self.input_group_of(replica)]
