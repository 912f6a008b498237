"""Rebatching batches that hold custom types (``registerCustomArgParser``) in the loading process.

accelbatch's rebatcher re-forms tensors, tuples, lists, dicts and dataclasses. A custom object is turned
into a tuple of the tensors its parser yields before rebatching and rebuilt by ``reconstruct`` after it,
from the object of the latest batch read (the parser takes only its type and non-tensor parts from it).
The parsers travel with the transform, since a spawned loading process has not run the registrations.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any, Dict

from accelbatch.data.rebatch import rebatch

from . import custom_args


class _CustomTensors(tuple):
    """The tensors of one custom object, in its parser's order."""


def _to_plain(obj: Any, templates: list[Any]) -> Any:
    parser = custom_args.parser_for(obj)
    if parser is not None:
        templates.append(obj)
        return _CustomTensors(_to_plain(t, templates) for t in parser.yieldTensors(obj))
    if isinstance(obj, dict):
        return type(obj)((k, _to_plain(v, templates)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_to_plain(v, templates) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_to_plain(v, templates) for v in obj)
    return obj


def _from_plain(obj: Any, templates: Iterator[Any]) -> Any:
    if isinstance(obj, _CustomTensors):
        template = next(templates)
        tensors = [_from_plain(t, templates) for t in obj]
        return custom_args.parser_for(template).reconstruct(template, iter(tensors))
    if isinstance(obj, dict):
        return type(obj)((k, _from_plain(v, templates)) for k, v in obj.items())
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_from_plain(v, templates) for v in obj))
    if isinstance(obj, (tuple, list)):
        return type(obj)(_from_plain(v, templates) for v in obj)
    return obj


def rebatch_custom(batches: Iterable[Any], batch_size: int, drop_last: bool,
                   parsers: Dict[type, custom_args.ICustomArgParser]) -> Iterator[Any]:
    """:func:`accelbatch.data.rebatch.rebatch` for batches that may hold custom objects."""
    for data_type, parser in parsers.items():
        if custom_args.parser_for_type(data_type) is None:
            custom_args.registerCustomArgParser(data_type, parser)
    latest: list[Any] = []

    def plain() -> Iterator[Any]:
        for batch in batches:
            templates: list[Any] = []
            out = _to_plain(batch, templates)
            latest[:] = templates
            yield out

    for out in rebatch(plain(), batch_size, drop_last):
        yield _from_plain(out, iter(list(latest)))
