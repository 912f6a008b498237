"""Mixed float16 / float32 operands, as PopTorch runs them.

PopTorch's user guide (16-bit float support): when an operation meets both ``float16`` and ``float32``
inputs it casts them all to ``float32``, as PyTorch usually does. PyTorch does so for element-wise
arithmetic but refuses others on the CPU (a ``float32`` input to a ``.half()`` linear layer: "mat1 and mat2
must have the same dtype"). While a model that holds float16 parameters or buffers runs its forward pass,
the emulator casts the float16 tensor operands of an out-of-place operation that mixes the two types to
float32 first; the casts are differentiable, so a float16 parameter still gets a float16 gradient.
In-place operations are left as they are (their result must keep the destination's type).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map


def _to_float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float16:
        return value.float()
    return value


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
)) | {"__setitem__", "__set__"}


class _PromoteMixedFloats(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
        if not in_place and "out" not in kwargs:
            leaves, _ = tree_flatten((args, kwargs))
            dtypes = {t.dtype for t in leaves if isinstance(t, torch.Tensor)}
            if torch.float16 in dtypes and torch.float32 in dtypes:
                args, kwargs = tree_map(_to_float, (args, kwargs))
        return func(*args, **kwargs)


def has_half_state(model: torch.nn.Module) -> bool:
    return any(t.dtype == torch.float16 for t in (*model.parameters(), *model.buffers()))


@contextlib.contextmanager
def promoting(enabled: bool) -> Iterator[None]:
    """Within: mixed float16 / float32 operations computed in float32 (when ``enabled``)."""
    if not enabled:
        yield
        return
    with _PromoteMixedFloats():
        yield


__all__ = ["has_half_state", "promoting"]
