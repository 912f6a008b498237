"""Custom argument types: ``poptorch.ICustomArgParser`` and ``poptorch.registerCustomArgParser``.

PopTorch lets a user type carry a batch's tensors: a parser registered for the type lists them
(``yieldTensors``) and builds a new object from replacement tensors (``reconstruct``). Models take such
objects as inputs and return them as outputs, and the DataLoader combines and splits them like tuples.
The registry is process-wide, as in PopTorch (registering again replaces, ``None`` removes).
"""

from __future__ import annotations

import abc
from collections.abc import Iterator
from typing import Any, Dict, Optional

import torch

from .poptorch_core import py_error


class ICustomArgParser(abc.ABC):
    """Lists the tensors of a custom type and rebuilds it from replacement tensors."""

    @abc.abstractmethod
    def yieldTensors(self, struct: Any) -> Iterator[torch.Tensor]:
        """Every tensor of ``struct``, in an order that never changes."""

    @abc.abstractmethod
    def reconstruct(self, original_structure: Any, tensor_iterator: Iterator[torch.Tensor]) -> Any:
        """A copy of ``original_structure`` taking its tensors from ``tensor_iterator``, in yield order."""


_PARSERS: Dict[type, ICustomArgParser] = {}


def registerCustomArgParser(arg_data_type: type, arg_parser: Optional[ICustomArgParser]) -> None:
    """Use ``arg_parser`` for objects of ``arg_data_type`` (and its subclasses); ``None`` removes it."""
    if arg_parser is None:
        _PARSERS.pop(arg_data_type, None)
        return
    if not isinstance(arg_parser, ICustomArgParser):
        raise py_error("arg_parser must inherit from ICustomArgParser")
    _PARSERS[arg_data_type] = arg_parser


def registered_parsers() -> Dict[type, ICustomArgParser]:
    """A copy of the registry (sent to loading processes, which have not run the registrations)."""
    return dict(_PARSERS)


def parser_for_type(data_type: type) -> Optional[ICustomArgParser]:
    """The parser registered for exactly ``data_type``, or None."""
    return _PARSERS.get(data_type)


def parser_for(obj: Any) -> Optional[ICustomArgParser]:
    """The parser registered for ``obj``'s type, else for one of its base classes, else None."""
    if not _PARSERS:
        return None
    parser = _PARSERS.get(type(obj))
    if parser is not None:
        return parser
    return next((p for t, p in _PARSERS.items() if isinstance(obj, t)), None)
