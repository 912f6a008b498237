"""Flatten nested tuples/lists/dicts of tensors and rebuild the same structure from new tensors."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from .custom_args import parser_for


def flatten(obj: Any) -> list[torch.Tensor]:
    """Every tensor in ``obj``, depth first, dicts in insertion order, custom types as their parser lists."""
    parser = parser_for(obj)
    if parser is not None:
        return list(parser.yieldTensors(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, (tuple, list)):
        return [t for item in obj for t in flatten(item)]
    if isinstance(obj, dict):
        return [t for item in obj.values() for t in flatten(item)]
    return []


def rebuild(obj: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``obj`` with its tensors replaced, in ``flatten`` order, by those ``tensors`` yields."""
    parser = parser_for(obj)
    if parser is not None:
        return parser.reconstruct(obj, tensors)
    if isinstance(obj, torch.Tensor):
        return next(tensors)
    if isinstance(obj, tuple):
        items = [rebuild(item, tensors) for item in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else tuple(items)
    if isinstance(obj, list):
        return [rebuild(item, tensors) for item in obj]
    if isinstance(obj, dict):
        return type(obj)((k, rebuild(v, tensors)) for k, v in obj.items())
    return obj


def map_tensors(obj: Any, fn) -> Any:
    """``obj`` with ``fn`` applied to each of its tensors."""
    return rebuild(obj, iter([fn(t) for t in flatten(obj)]))
