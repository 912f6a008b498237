"""The caller's multiprocessing default start method, left unset where it was unset.

Starting a child fixes the default as a side effect (spawn's preparation data asks for it; torch's
DataLoader makes its queues, tqdm its lock, from the default context); a script or notebook that then calls
``multiprocessing.set_start_method`` would get "context has already been set" from what the library did."""

from __future__ import annotations

import functools
import multiprocessing
from typing import Any, Callable, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


def keeps_default_start_method(fn: F) -> F:
    """``fn``, after which multiprocessing's default start method is unset again if it was unset before."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        unset = multiprocessing.get_start_method(allow_none=True) is None
        try:
            return fn(*args, **kwargs)
        finally:
            if unset and multiprocessing.get_start_method(allow_none=True) is not None:
                multiprocessing.set_start_method(None, force=True)  # type: ignore[arg-type]  # CPython: unset

    return wrapper  # type: ignore[return-value]


def default_start_method() -> str:
    """The start method torch's DataLoader workers take: the one set, else the platform's default (without
    fixing it: ``get_start_method()`` would)."""
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]
