"""Rebatching: re-form full batches from a stream of small (or uneven) batches.

Data workers of an iterable dataset each end with a partial batch; a loader that drops partial batches then
loses up to ``batch_size - 1`` examples per worker (101 items over 7 workers in batches of 4: 80 used).
Letting the workers emit small batches and re-forming full ones on the consumer side loses at most one
partial batch in all (100 used), or nothing with ``drop_last=False``.

:func:`rebatch` works on any nesting of tuples (named tuples too), lists, dicts and dataclasses whose leaves
are tensors with a batch dimension (concatenated along dim 0, then cut) or :class:`Rows` lists (per-row
Python objects, e.g. the Messages of a batch, concatenated as lists). Every batch must have the same
structure, and the leaves of one batch the same number of rows.

:func:`tree_map` is the structure walk shared with the async accessor.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Iterator

import torch

__all__ = ["Rows", "rebatch", "tree_map", "flatten", "unflatten", "RebatchError"]


class Rows(list):
    """A list with one entry per batch row: :func:`rebatch` concatenates and cuts it like a tensor."""

    def __repr__(self) -> str:
        return f"Rows({list.__repr__(self)})"


class RebatchError(ValueError):
    """Batches cannot be combined (structure changed, rows disagree, a leaf has no batch dimension)."""


def _is_container(obj: Any) -> bool:
    if isinstance(obj, (torch.Tensor, Rows, str, bytes)):
        return False
    return isinstance(obj, (list, tuple, dict)) or (dataclasses.is_dataclass(obj) and not isinstance(obj, type))


def _rebuild(template_type: type, kind: str, keys: Any, values: list[Any]) -> Any:
    if kind == "list":
        if template_type is list:
            return values
        try:
            return template_type(values)
        except TypeError:
            return values
    if kind == "tuple":
        if template_type is tuple:
            return tuple(values)
        if hasattr(template_type, "_fields"):
            return template_type(*values)
        try:
            return template_type(values)
        except TypeError:
            return tuple(values)
    if kind == "dict":
        pairs = zip(keys, values)
        if template_type is dict:
            return dict(pairs)
        try:
            return template_type(pairs)
        except TypeError:
            return dict(zip(keys, values))
    # dataclass: set the fields without running __init__ / __post_init__ again
    obj = template_type.__new__(template_type)
    for name, value in zip(keys, values):
        object.__setattr__(obj, name, value)
    return obj


def flatten(obj: Any) -> tuple[list[Any], Any]:
    """(leaves, spec): the leaves in a fixed order and a hashable-ish description of the structure."""
    leaves: list[Any] = []

    def walk(x: Any) -> Any:
        if not _is_container(x):
            leaves.append(x)
            return None
        if isinstance(x, dict):
            keys = tuple(x.keys())
            return (type(x), "dict", keys, tuple(walk(x[k]) for k in keys))
        if isinstance(x, tuple):
            return (type(x), "tuple", None, tuple(walk(v) for v in x))
        if isinstance(x, list):
            return (type(x), "list", len(x), tuple(walk(v) for v in x))
        names = tuple(f.name for f in dataclasses.fields(x))
        return (type(x), "dataclass", names, tuple(walk(getattr(x, n)) for n in names))

    spec = walk(obj)
    return leaves, spec


def unflatten(spec: Any, leaves: Iterable[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    it = iter(leaves)

    def build(s: Any) -> Any:
        if s is None:
            return next(it)
        typ, kind, keys, children = s
        return _rebuild(typ, kind, keys, [build(c) for c in children])

    return build(spec)


def tree_map(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf (anything but a tuple, list, dict or dataclass), keeping the structure."""
    leaves, spec = flatten(obj)
    return unflatten(spec, [fn(leaf) for leaf in leaves])


def _rows_of(leaves: list[Any], where: int) -> int:
    rows = None
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, torch.Tensor):
            if leaf.dim() == 0:
                raise RebatchError(f"rebatch: leaf {i} of batch {where} is a 0-d tensor; every tensor needs "
                                   "a batch dimension (dim 0)")
            n = leaf.shape[0]
        elif isinstance(leaf, Rows):
            n = len(leaf)
        else:
            raise RebatchError(f"rebatch: leaf {i} of batch {where} is a {type(leaf).__name__}; only tensors "
                               "with a batch dimension and Rows lists can be rebatched (wrap per-row Python "
                               "objects in accelbatch.data.rebatch.Rows)")
        if rows is None:
            rows = n
        elif n != rows:
            raise RebatchError(f"rebatch: batch {where} has leaves with {rows} and {n} rows; every leaf of a "
                               "batch needs the same number of rows")
    if rows is None:
        raise RebatchError(f"rebatch: batch {where} has no tensor or Rows leaf to take rows from")
    return rows


def _concat(parts: list[list[Any]]) -> list[Any]:
    if len(parts) == 1:
        return parts[0]
    out = []
    for i, pieces in enumerate(zip(*parts)):
        if isinstance(pieces[0], torch.Tensor):
            try:
                out.append(torch.cat(pieces, dim=0))
            except RuntimeError as exc:
                shapes = sorted({tuple(p.shape[1:]) for p in pieces})
                raise RebatchError(f"rebatch: leaf {i} cannot be concatenated: its per-row shapes differ "
                                   f"between batches ({shapes}); pad to one shape first ({exc})") from None
        else:
            out.append(Rows(x for p in pieces for x in p))
    return out


def _cut(leaves: list[Any], start: int, stop: int) -> list[Any]:
    return [leaf[start:stop] if isinstance(leaf, torch.Tensor) else Rows(leaf[start:stop]) for leaf in leaves]


def rebatch(batches: Iterable[Any], batch_size: int, drop_last: bool = True) -> Iterator[Any]:
    """Yield batches of exactly ``batch_size`` rows re-formed from ``batches`` (concatenate, then cut).

    Rows keep their order. At the end the remaining rows (fewer than ``batch_size``) are dropped with
    ``drop_last=True`` (at most ``batch_size - 1`` rows in all, never one per worker) or yielded as a last,
    smaller batch. A batch that already has ``batch_size`` rows while nothing is pending passes through
    untouched. Output tensors may be views of a concatenated tensor.
    """
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"rebatch: batch_size must be a positive integer, got {batch_size!r}")
    spec0: Any = None
    pending: list[list[Any]] = []
    pending_rows = 0
    for where, batch in enumerate(batches):
        leaves, spec = flatten(batch)
        if where == 0:
            spec0 = spec
        elif spec != spec0:
            raise RebatchError(f"rebatch: batch {where} has a different structure from batch 0; every batch "
                               "must have the same nesting, keys and types")
        rows = _rows_of(leaves, where)
        if rows == 0:
            continue
        if rows == batch_size and not pending:
            yield batch
            continue
        pending.append(leaves)
        pending_rows += rows
        if pending_rows < batch_size:
            continue
        combined = _concat(pending)
        full = pending_rows // batch_size * batch_size
        for start in range(0, full, batch_size):
            yield unflatten(spec0, _cut(combined, start, start + batch_size))
        pending_rows -= full
        pending = [_cut(combined, full, full + pending_rows)] if pending_rows else []
    if pending and not drop_last:
        yield unflatten(spec0, _concat(pending))
