"""What the emulated device does beyond batching: half-precision updates, executable caching, synthetic data.

Semantics taken from PopTorch (python/optim.py, python/_optimizer_attributes.py, python/options.py):

- Loss scaling is the optimizer's ``loss_scaling`` attribute (1.0 when absent, for any optimizer): the
  loss is multiplied by it before the backward pass and the update divides the gradients by it.
- A ``model.half()`` model trains its float16 weights directly (no float32 master copy), while gradient
  accumulators and optimizer states are float32 (``accum_type`` and the momentum types default to
  ``torch.float32``). :class:`HalfUpdates` does the same on the CPU: each micro-batch's float16 gradients
  are added into float32 accumulators, and the optimizer steps on float32 views of the weights with
  float32 state; the new weights are rounded to float16 (round to nearest: no stochastic rounding).
- ``enableExecutableCaching(path)``: the first compilation writes an executable to ``path``; a later
  wrapper compiling the same model, inputs and options loads it. :func:`cache_lookup` writes a small
  ``<hash>.popef`` record and says whether it was there already.
- ``enableSyntheticData(True)``: no host I/O. :func:`synthetic` makes inputs of the compiled shapes
  (normal floats, zeros otherwise).
- A graph is compiled with each module's train/eval mode of that moment (dropout, batch-norm statistics are
  in the graph); a later ``model.train()`` / ``model.eval()`` on the host does not reach a compiled model
  (PopTorch's wrapper is a copy whose flags are not synced). :func:`compiled_modes` records the modes and
  :func:`in_compiled_modes` runs a call in them.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

from .options import Options

# Set on a user's module while a trainingModel wraps it (PopTorch swaps the module's class instead).
_WRAPPED_MARK = "_poptorch_emulator_wrapped"


def is_wrapped(model: torch.nn.Module) -> bool:
    return bool(model.__dict__.get(_WRAPPED_MARK, False))


def set_wrapped(model: torch.nn.Module, wrapped: bool) -> None:
    if wrapped:
        model.__dict__[_WRAPPED_MARK] = True
    else:
        model.__dict__.pop(_WRAPPED_MARK, None)


def loss_scaling(optimizer: torch.optim.Optimizer | None) -> float:
    """The optimizer's ``loss_scaling`` (PopTorch reads it from any optimizer; 1.0 when absent)."""
    return float(getattr(optimizer, "loss_scaling", 1.0) or 1.0)


class HalfUpdates:
    """float32 gradient accumulation and optimizer steps for float16 parameters (see the module docstring)."""

    def __init__(self) -> None:
        self._acc: dict[torch.nn.Parameter, torch.Tensor] = {}

    def accumulate(self, params: list[torch.nn.Parameter]) -> None:
        """Move the float16 parameters' fresh gradients into float32 accumulators."""
        for p in params:
            if p.dtype == torch.float16 and p.grad is not None:
                grad = p.grad.float()
                prev = self._acc.get(p)
                self._acc[p] = grad if prev is None else prev.add_(grad)
                p.grad = None

    def scale_(self, factor: float) -> None:
        for acc in self._acc.values():
            acc.mul_(factor)

    def step(self, params: list[torch.nn.Parameter], optimizer: torch.optim.Optimizer, step: Any) -> None:
        """Run ``step()`` with float16 parameters seen as float32 (state too), then round them to float16."""
        halves = [p for p in params if p.dtype == torch.float16]
        for p in halves:
            p.data = p.data.float()
            p.grad = self._acc.pop(p, None)
            state = optimizer.state.get(p, {})
            for k, v in list(state.items()):
                if k != "step" and isinstance(v, torch.Tensor) and v.dtype == torch.float16:
                    state[k] = v.float()
        try:
            step()
        finally:
            for p in halves:
                p.data = p.data.half()
            self._acc.clear()

    def clear(self) -> None:
        self._acc.clear()


def compiled_modes(model: torch.nn.Module) -> list[tuple[torch.nn.Module, bool]]:
    """Each module of ``model`` with the mode (training or not) a graph compiled now holds."""
    return [(module, module.training) for module in model.modules()]


@contextlib.contextmanager
def in_compiled_modes(modes: list[tuple[torch.nn.Module, bool]]) -> Iterator[None]:
    """Run a call with every module in its compiled mode, then give the host its own modes back."""
    host = [(module, module.training) for module, _ in modes]
    for module, training in modes:
        module.training = training
    try:
        yield
    finally:
        for module, training in host:
            module.training = training


def _optimizer_key(optimizer: torch.optim.Optimizer | None) -> Any:
    """What of an optimizer a graph holds: its type, its structural flags (nesterov, amsgrad, ...) and the
    values of the attributes marked constant; variable attributes (learning rate, ...) are graph inputs."""
    if optimizer is None:
        return None
    attrs = getattr(optimizer, "variable_attrs", None)

    def held(name: str, value: Any) -> bool:
        return isinstance(value, (bool, str, type(None))) or (attrs is not None and attrs.isConstant(name))
    groups = [{k: repr(v) if held(k, v) else "variable" for k, v in sorted(g.items()) if k != "params"}
              for g in optimizer.param_groups]
    return {"type": type(optimizer).__qualname__, "groups": groups}


def cache_key(model: torch.nn.Module, training: bool, shapes: dict[str, Any], options: Options,
              optimizer: torch.optim.Optimizer | None = None) -> str:
    """A hash of what an executable depends on: the model's structure and weight types, the inputs, the
    options (the cache path itself left out) and, for training, the optimizer's graph."""
    opts = {k: v for k, v in options.toDict().items() if k not in ("cachePath", "enableEngineCaching")}
    desc = {"model": type(model).__qualname__, "training": training,
            "params": [(n, list(p.shape), str(p.dtype)) for n, p in model.named_parameters()],
            "inputs": {k: [list(s), str(d)] for k, (s, d) in shapes.items()},
            "options": repr(sorted(opts.items(), key=lambda kv: kv[0])), "optimizer": _optimizer_key(optimizer)}
    return hashlib.sha256(json.dumps(desc, sort_keys=True, default=str).encode()).hexdigest()[:32]


def cache_lookup(options: Options, key: str) -> bool | None:
    """None without caching; True when ``key``'s executable is in the cache, else writes it and False."""
    popart = options._Popart.options
    path = popart.get("cachePath")
    if not popart.get("enableEngineCaching") or not path:
        return None
    file = os.path.join(path, f"{key}.popef")
    if os.path.exists(file):
        return True
    os.makedirs(path, exist_ok=True)
    tmp = f"{file}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump({"emulated_executable": key}, f)
    os.replace(tmp, file)
    return False


def synthetic_mode(options: Options) -> int:
    return int(options._Popart.options.get("syntheticDataMode", 0))


def synthetic_generator(options: Any) -> torch.Generator:
    """The generator of a run's synthetic inputs: seeded with ``Options.randomSeed`` (0 when not set)."""
    return torch.Generator().manual_seed(options.random_seed if options.exists("random_seed") else 0)


def synthetic(t: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """A device-made input of ``t``'s shape and dtype: normal floats, zeros otherwise."""
    if t.is_floating_point():
        return torch.randn(t.shape, generator=generator, dtype=torch.float32).to(t.dtype)
    return torch.zeros_like(t)


__all__ = ["HalfUpdates", "cache_key", "cache_lookup", "compiled_modes", "in_compiled_modes", "loss_scaling",
           "synthetic", "synthetic_generator", "synthetic_mode"]
