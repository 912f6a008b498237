"""``poptorch.Block``, ``BeginBlock``, ``BlockFunction`` and ``removeBlocks``: where a model's parts run.

As in PopTorch (python/ops.py), the annotations do nothing unless an executor is tracing the model for the
device: on the CPU (or in the emulator after the first micro-batch of a compilation) a ``Block`` is an
empty context and a ``BeginBlock`` hook returns at once, so an annotated model gives the same numbers as
the plain one. While an executor traces, each annotation tells the trace (:mod:`.execution_strategy`)
which block, stage and IPU the ops that follow belong to:

- ``BeginBlock(module, user_id, ipu_id)`` adds a forward pre-hook: the module and everything after it run
  in that block until another block begins. A module can be assigned once ("module has already been
  assigned to a block."); ``removeBlocks`` takes the hooks off again. A callable that is not a module is
  wrapped (PopTorch's legacy use).
- ``with Block(user_id, ipu_id):`` runs its body in the block; after it, until another block begins, no
  block is active and an op there is an error ("No active Block, ...").
- ``@BlockFunction(user_id, ipu_id)`` runs the decorated function inside ``Block(user_id, ipu_id)``.
- ``module_repr(module)`` shows the ``BeginBlock`` hooks that ``repr`` leaves out (an executor's repr too).
- ``Block.useAutoId()`` restarts the automatic ids ("0", "1", ...) given to blocks without a ``user_id``.
"""

from __future__ import annotations

import contextvars
import functools
from collections import OrderedDict
from typing import Any, Callable, Protocol

import torch

from .poptorch_core import py_error


class Trace(Protocol):
    """What the annotations tell the executor's trace (see :mod:`.execution_strategy`)."""

    def begin(self, user_id: Any, ipu_id: int | None) -> None: ...

    def end(self) -> None: ...

    def next_auto_id(self) -> str: ...

    def reset_auto_id(self) -> None: ...


# the trace of the executor compiling the model now (None: a CPU run, annotations are no-ops)
_TRACE: contextvars.ContextVar[Trace | None] = contextvars.ContextVar("poptorch_emulator_trace", default=None)


def active_trace() -> Trace | None:
    return _TRACE.get()


def set_trace(trace: Trace | None) -> contextvars.Token:
    return _TRACE.set(trace)


def reset_trace(token: contextvars.Token) -> None:
    _TRACE.reset(token)


class Block(torch.nn.Module):
    """``with poptorch.Block("Encoder", ipu_id=0): ...``: the ops inside belong to this block."""

    @staticmethod
    def useAutoId() -> None:
        """Blocks without a ``user_id`` get "0", "1", ... again from here (call at the start of forward)."""
        trace = _TRACE.get()
        if trace is not None:
            trace.reset_auto_id()

    @staticmethod
    def start(user_id: str | None = None, ipu_id: int | None = None) -> None:
        trace = _TRACE.get()
        if trace is not None:
            trace.begin(user_id, ipu_id)

    def __init__(self, user_id: str | None = None, ipu_id: int | None = None) -> None:
        super().__init__()
        self._user_id = user_id
        self._ipu_id = ipu_id

    def __enter__(self) -> None:
        Block.start(self._user_id, self._ipu_id)

    def __exit__(self, *exc: Any) -> None:
        trace = _TRACE.get()
        if trace is not None:
            trace.end()


class _BlockHook:
    """The forward pre-hook ``BeginBlock`` registers; an automatic id, once given, stays with it."""

    def __init__(self, user_id: Any, ipu_id: int | None) -> None:
        self._user_id = user_id
        self._ipu_id = ipu_id

    def __call__(self, module: torch.nn.Module, inputs: Any) -> None:
        trace = _TRACE.get()
        if trace is not None:
            if self._user_id is None:
                self._user_id = trace.next_auto_id()
            trace.begin(self._user_id, self._ipu_id)

    def __repr__(self) -> str:
        return f"BeginBlock(user_id={self._user_id}, ipu_id={self._ipu_id})"


class LegacyBeginBlockFn(torch.nn.Module):
    """``BeginBlock`` around a plain callable: the block begins, then the callable runs."""

    def __init__(self, layer_to_call: Callable[..., Any], user_id: Any = None, ipu_id: int | None = None) -> None:
        super().__init__()
        self._user_id = user_id
        self._layer_to_call = layer_to_call
        self._ipu_id = ipu_id

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        trace = _TRACE.get()
        if trace is not None:
            if self._user_id is None:
                self._user_id = trace.next_auto_id()
            trace.begin(self._user_id, self._ipu_id)
        return self._layer_to_call(*args, **kwargs)


def BeginBlock(layer_to_call: Any, user_id: Any = None, ipu_id: int | None = None) -> Any:
    """Start a block at ``layer_to_call`` (a module, changed in place and returned; or a callable, wrapped)."""
    if not isinstance(layer_to_call, torch.nn.Module):
        if callable(layer_to_call):
            return LegacyBeginBlockFn(layer_to_call, user_id, ipu_id)
        raise py_error("module is not an instance of torch.nn.Module or function.")
    if any(isinstance(hook, _BlockHook) for hook in layer_to_call._forward_pre_hooks.values()):
        raise py_error("module has already been assigned to a block.")
    layer_to_call.register_forward_pre_hook(_BlockHook(user_id, ipu_id))
    return layer_to_call


def BlockFunction(user_id: str | None = None, ipu_id: int | None = None) -> Callable[[Callable], Callable]:
    """Decorator: the function's body runs inside ``Block(user_id, ipu_id)``."""

    def decorator(func: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with Block(user_id, ipu_id):
                return func(*args, **kwargs)

        return wrapper

    return decorator


def removeBlocks(module: torch.nn.Module) -> None:
    """Take every ``BeginBlock`` annotation off ``module`` and its submodules."""
    assert isinstance(module, torch.nn.Module)
    for m in module.modules():
        m._forward_pre_hooks = OrderedDict((k, h) for k, h in m._forward_pre_hooks.items()
                                           if not isinstance(h, _BlockHook))


def module_repr(m: torch.nn.Module) -> str:
    """``repr(m)`` with each module's forward pre-hooks (so its ``BeginBlock``) before its name."""
    extra = m.extra_repr().split("\n") if m.extra_repr() else []
    children = []
    for key, child in m._modules.items():
        text = module_repr(child) if child is not None else "None"
        children.append(f"({key}): " + text.replace("\n", "\n  "))
    hooks = "".join(f"{h!r} " for h in m._forward_pre_hooks.values())
    body = ""
    if len(extra) == 1 and not children:
        body = extra[0]
    elif extra or children:
        body = "\n  " + "\n  ".join(extra + children) + "\n"
    return f"{hooks}{m._get_name()}({body})"


def block_annotations(module: torch.nn.Module) -> dict[str, tuple[Any, int | None]]:
    """Emulator extra: submodule name -> (user_id, ipu_id) of each ``BeginBlock`` on ``module``."""
    return {name: (h._user_id, h._ipu_id) for name, m in module.named_modules()
            for h in m._forward_pre_hooks.values() if isinstance(h, _BlockHook)}


__all__ = ["BeginBlock", "Block", "BlockFunction", "LegacyBeginBlockFn", "block_annotations", "module_repr",
           "removeBlocks"]
