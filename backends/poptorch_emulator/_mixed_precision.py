"""Mixed float16 / float32 operands, as PopTorch runs them.

PopTorch's user guide (16-bit float support): when an operation meets both ``float16`` and ``float32``
inputs it casts them all to ``float32``, as PyTorch usually does, except that ``float32`` parameters
(weights) meeting a ``float16`` input are used as ``float16`` (its tests/half_test.py: a float32 linear layer
given a ``.half()`` input returns float16). PyTorch refuses such mixes on the CPU for all but element-wise
arithmetic ("mat1 and mat2 must have the same dtype"). While a model that holds float16 parameters or buffers,
or is given float16 inputs, runs its forward pass, the emulator casts the operands of an out-of-place
operation that mixes the two types: to float16 where every float32 operand is a parameter, else to float32.
The casts are differentiable, so each parameter gets a gradient of its own type. In-place operations are left
as they are (their result must keep the destination's type). A float16 tensor made inside a model given
none (``x.half()`` of a float32 input) is not watched: PyTorch's rules apply to it.

Under automatic loss scaling the same mode also registers a gradient hook, which counts the gradients
(:mod:`.auto_loss_scale`), on each float16 non-leaf tensor the forward pass feeds to an operation other
than a view: the gradients PopART's backward operations produce for their inputs. Parameters (leaves) are
counted after the backward pass, the loss (an input of no operation) not at all.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map


def _to_float(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.dtype == torch.float16:
        return value.float()
    return value


def _parameter_to_half(value: Any) -> Any:
    if isinstance(value, torch.nn.Parameter) and value.dtype == torch.float32:
        return value.half()
    return value


_IN_PLACE_DUNDERS = frozenset(f"__i{op}__" for op in (
    "add", "sub", "mul", "matmul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift", "rshift",
)) | {"__setitem__", "__set__"}


# Operations whose input gradient is a view of the output's (or the same values): PopART tracks none there.
_VIEWS = frozenset((
    "view", "view_as", "reshape", "reshape_as", "flatten", "unflatten", "squeeze", "unsqueeze", "transpose",
    "permute", "t", "T", "mT", "expand", "expand_as", "contiguous", "narrow", "select", "split", "chunk", "unbind",
    "movedim", "swapaxes", "__getitem__", "__get__", "detach", "clone", "to", "float", "half", "type",
))


class _PromoteMixedFloats(TorchFunctionMode):
    def __init__(self, promote: bool, grad_hook: Callable[[torch.Tensor], None] | None) -> None:
        super().__init__()
        self._promote = promote
        self._grad_hook = grad_hook
        self._hooked: dict[int, torch.Tensor] = {}  # kept alive for the forward pass, so ids stay unique

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        in_place = name in _IN_PLACE_DUNDERS or (name.endswith("_") and not name.startswith("__"))
        if self._grad_hook is not None and not in_place and name not in _VIEWS:
            for t in tree_flatten((args, kwargs))[0]:
                if (isinstance(t, torch.Tensor) and t.dtype == torch.float16 and t.grad_fn is not None
                        and id(t) not in self._hooked):
                    self._hooked[id(t)] = t
                    t.register_hook(self._grad_hook)
        if self._promote and not in_place and "out" not in kwargs:
            leaves, _ = tree_flatten((args, kwargs))
            tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
            dtypes = {t.dtype for t in tensors}
            if torch.float16 in dtypes and torch.float32 in dtypes:
                to_half = all(isinstance(t, torch.nn.Parameter) for t in tensors if t.dtype == torch.float32)
                args, kwargs = tree_map(_parameter_to_half if to_half else _to_float, (args, kwargs))
        return func(*args, **kwargs)


def has_half_state(model: torch.nn.Module, inputs: Iterable[torch.Tensor] = ()) -> bool:
    """Whether the model holds float16 parameters or buffers, or is given float16 inputs."""
    return any(t.dtype == torch.float16 for t in (*model.parameters(), *model.buffers(), *inputs))


@contextlib.contextmanager
def promoting(enabled: bool, grad_hook: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
    """Within: mixed float16 / float32 operations computed in float32 (when ``enabled``) and ``grad_hook``
    registered on the float16 non-leaf inputs of operations other than views."""
    if not enabled and grad_hook is None:
        yield
        return
    with _PromoteMixedFloats(enabled, grad_hook):
        yield


__all__ = ["has_half_state", "promoting"]
