"""What PopTorch's ``AsynchronousDataAccessor`` can load: a tensor, a dict of tensors, a custom type with a
registered parser, or a flat 1D container (tuple, list) of tensors.

PopTorch's worker checks the first batch it reads while it starts (python/_dataloader.py,
``_AsynchronousWorkerProcess._mainLoopNoInterrupt``: "We support either a single tensor or a flat 1D iterable
of tensors"), before any rebatching; any other element fails an assertion there, so the accessor fails to
start. :class:`FirstBatchCheck` runs the same check in accelbatch's loading process, on the batches the source
yields, before the rebatching it may wrap.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch

NOT_FLAT = ("Tensor at index {index} is not a torch tensor ({kind}). AsynchronousDataAccessor expects data to "
            "be organised as a flat 1D container of tensors.")


def type_name(data_type: type) -> str:
    """``module.qualname``: names a registered custom type in a loading process that never imported it."""
    return f"{data_type.__module__}.{data_type.__qualname__}"


def check_flat(data: Any, custom_types: frozenset[str]) -> None:
    """Raise PopTorch's ``AssertionError`` unless ``data`` is one of the forms in the module docstring."""
    if isinstance(data, torch.Tensor):
        return
    if isinstance(data, dict):
        data = tuple(data.values())  # PopTorch sends the values in key order, the keys once
    elif any(type_name(t) in custom_types for t in type(data).__mro__):
        return  # the parser yields the tensors
    len(data)  # PopTorch sends the element count first: a batch without one fails there, with a TypeError
    for index, tensor in enumerate(data):
        if not isinstance(tensor, torch.Tensor):
            raise AssertionError(NOT_FLAT.format(index=index, kind=type(tensor)))


class FirstBatchCheck:
    """``iterator -> iterator`` for the loading process: checks the first batch the source yields (once per
    process, as PopTorch's worker does while it starts), then hands the batches to ``then`` (rebatching), if
    given. Picklable when ``then`` is."""

    def __init__(self, custom_types: Iterable[type] = (),
                 then: Callable[[Iterator[Any]], Iterator[Any]] | None = None) -> None:
        self._custom_types = frozenset(type_name(t) for t in custom_types)
        self._then = then
        self._checked = False

    def __call__(self, batches: Iterator[Any]) -> Iterator[Any]:
        checked = self._checked_batches(batches)
        return self._then(checked) if self._then is not None else checked

    def _checked_batches(self, batches: Iterator[Any]) -> Iterator[Any]:
        for batch in batches:
            if not self._checked:
                check_flat(batch, self._custom_types)
                self._checked = True
            yield batch


__all__ = ["NOT_FLAT", "FirstBatchCheck", "check_flat"]
