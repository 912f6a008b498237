"""``poptorch.AsynchronousDataAccessor`` on top of accelbatch's own ``AsyncDataAccessor``.

The loading itself (a background process filling a shared-memory ring, rebatching in that process, epoch
restarts, error propagation, clean shutdown) is :class:`accelbatch.data.accessor.AsyncDataAccessor`; this
module only gives it PopTorch's interface and behaviour (python/__init__.py ``AsynchronousDataAccessor``,
python/_dataloader.py):

- The constructor waits for the first batch, so a dataset that fails or is empty fails here with
  ``poptorch.Error("AsynchronousDataAccessor worker thread failed to start (Check above for details)")``.
  With ``early_preload=False`` (the default) the worker then waits for the first ``iter()`` (or ``next()``)
  before reading further; with ``True`` it fills the ring at once.
- The first batch must be a tensor, a dict of tensors, a registered custom type or a flat tuple / list of
  tensors (checked before rebatching, :mod:`._flat_batches`); anything else fails to start as above, from
  PopTorch's ``AssertionError("Tensor at index 1 is not a torch tensor (...) ...")``.
- ``iter()`` starts a pass; the pass begun by the constructor is the first one. Leaving a pass early and
  iterating again starts from the first item. The accessor is its own iterator (``next(accessor)``).
- Batches are views of shared memory, valid until the next batch: clone what you keep.
- ``rebatched_size`` re-forms batches of that many rows in the loading process, dropping the last partial
  one unless the wrapped ``poptorch.DataLoader`` was made with ``drop_last=False``.
- An exception in the dataset during a pass, or the loading process's death, is
  ``AssertionError("An error occurred in the data fetcher")`` raised from the original exception (or
  :class:`~accelbatch.procs.ProcessDied`, naming the signal). A dataset's exception first prints the
  worker's traceback to stderr as a failed ``multiprocessing`` process does (``Process <name>:`` then
  ``Traceback (most recent call last):``), which is what PopTorch's "Check above for details" points to; a
  killed process has none to print.
- ``miss_sleep_time_in_ms``: with the ring full, the worker takes a freed slot only at its next check, one
  every that many milliseconds (it waits without polling, with the same timing).

Accepted for compatibility but without effect: ``sharing_strategy`` (the loading process is always started
from a forkserver). A batch that takes longer than 60 s to arrive raises instead of hanging.
"""

from __future__ import annotations

import copy
import functools
import sys
import weakref
from collections.abc import Iterator
from typing import Any

from accelbatch.data.accessor import AsyncDataAccessor
from accelbatch.data.rebatch import rebatch
from accelbatch.procs import ProcessFailure, ProcessTimeout

from . import custom_args
from ._custom_rebatch import rebatch_custom
from ._flat_batches import FirstBatchCheck
from .enums import SharingStrategy
from .poptorch_core import py_error

FAILED_TO_START = "AsynchronousDataAccessor worker thread failed to start (Check above for details)"
FETCH_ERROR = "An error occurred in the data fetcher"


class AsynchronousDataAccessor:
    """Load ``dataset`` (any iterable, typically a ``poptorch.DataLoader``) in a background process."""

    def __init__(self, dataset: Any, buffer_size: int = 3, miss_sleep_time_in_ms: float = 0.1,
                 load_indefinitely: bool = True, early_preload: bool = False,
                 sharing_strategy: SharingStrategy = SharingStrategy.ForkServer,
                 rebatched_size: int | None = None) -> None:
        self._inner: AsyncDataAccessor | None = None
        self._current: Iterator[Any] | None = None
        self._first_pass_unclaimed = False
        if isinstance(miss_sleep_time_in_ms, bool) or not isinstance(miss_sleep_time_in_ms, (int, float)) \
                or miss_sleep_time_in_ms < 0:
            raise ValueError(f"miss_sleep_time_in_ms must be a number >= 0, got {miss_sleep_time_in_ms!r}")
        is_loader = hasattr(dataset, "combinedBatchSize")  # a poptorch.DataLoader (which imports this module)
        if is_loader:
            if dataset.__dict__.get("_accessor") is not None:
                raise py_error("The DataLoader already uses an AsynchronousDataAccessor internally. Either use "
                               "the existing one or set mode='poptorch.DataLoaderMode.Sync' in the DataLoader.")
            if (not dataset._user_batch_sampler and not dataset.drop_last and rebatched_size is None
                    and dataset.combinedBatchSize not in (None, 1)):
                raise AssertionError("The 'drop_last=False' option from the DataLoader only works if "
                                     "'rebatched_size' is specified too.")
        if rebatched_size is not None and not rebatched_size > 1:
            raise AssertionError("rebatched_size must be None or greater than 1")
        self._dataset: Any = dataset
        self._owner: weakref.ref | None = None
        self.rebatched_size = rebatched_size
        # A DataLoader is sent as a shallow copy (same dataset, sampler and options, no accessor), so that
        # the loading process's source does not hold on to the loader that owns this accessor.
        source = copy.copy(dataset) if is_loader else dataset
        drop_last = bool(getattr(dataset, "rebatched_drop_last", True))
        parsers = custom_args.registered_parsers()
        then: Any = None
        if rebatched_size is not None:  # custom types: see _custom_rebatch
            then = (functools.partial(rebatch_custom, batch_size=rebatched_size, drop_last=drop_last,
                                      parsers=parsers) if parsers else
                    functools.partial(rebatch, batch_size=rebatched_size, drop_last=drop_last))
        # PopTorch's worker refuses a first batch that is not a flat container of tensors (see _flat_batches)
        self._inner = AsyncDataAccessor(
            source, buffer_size=buffer_size, early_preload=early_preload, load_indefinitely=load_indefinitely,
            miss_sleep_s=miss_sleep_time_in_ms / 1000.0, transform=FirstBatchCheck(parsers, then))
        # Read the first batch now, as PopTorch's worker does while it starts.
        try:
            first_pass = self._inner.start_pass(hold_after=None if early_preload else 1)
            first = next(first_pass)
        except Exception as exc:  # the dataset failed or is empty, or the process died
            self.terminate()
            _print_worker_traceback(exc)
            raise py_error(FAILED_TO_START) from exc
        self._current = _prepend(first, first_pass)
        self._first_pass_unclaimed = True

    def _owned_by(self, loader: Any) -> None:
        """Called by the DataLoader that created this accessor: refer to it weakly (no reference cycle)."""
        self._owner = weakref.ref(loader)
        self._dataset = None

    def _source(self) -> Any:
        return self._owner() if self._owner is not None else self._dataset

    def terminate(self) -> None:
        """Stop the loading process (also done when the accessor is garbage collected)."""
        inner, self._inner, self._current = self._inner, None, None
        if inner is not None:
            inner.terminate()

    def __del__(self) -> None:
        self.terminate()

    def __len__(self) -> int:
        dataset = self._source()
        length = len(dataset)
        if self.rebatched_size and self._owner is None:
            length = length * getattr(dataset, "batch_size", 1) // self.rebatched_size
        return length

    def __iter__(self) -> "AsynchronousDataAccessor":
        if self._inner is None:
            raise AssertionError("The AsynchronousDataAccessor has been terminated")
        if self._first_pass_unclaimed:
            self._first_pass_unclaimed = False  # continue the pass the constructor started
            self._inner.release()
        else:
            self._current = iter(self._inner)
        return self

    def __next__(self) -> Any:
        if self._current is None or self._first_pass_unclaimed:
            self.__iter__()
        assert self._current is not None
        try:
            return next(self._current)
        except StopIteration:
            self._current = _exhausted()
            raise
        except ProcessTimeout:
            raise
        except Exception as exc:
            _print_worker_traceback(exc)
            raise AssertionError(FETCH_ERROR) from exc


def _print_worker_traceback(exc: BaseException) -> None:
    """Print the loading process's traceback, if ``exc`` carries one, as ``multiprocessing`` prints a failed
    process's (PopTorch's worker is such a process; its errors are read on stderr)."""
    seen: set[int] = set()
    link: BaseException | None = exc
    while link is not None and id(link) not in seen:
        seen.add(id(link))
        if isinstance(link, ProcessFailure) and link.child_traceback:
            name = f"AsynchronousDataAccessor worker (pid {link.pid})" if link.pid else "AsynchronousDataAccessor"
            sys.stderr.write(f"Process {name}:\n{link.child_traceback.rstrip()}\n")
            sys.stderr.flush()
            return
        link = link.__cause__ or link.__context__


def _prepend(first: Any, rest: Iterator[Any]) -> Iterator[Any]:
    yield first
    yield from rest


def _exhausted() -> Iterator[Any]:
    return iter(())


__all__ = ["AsynchronousDataAccessor"]
