"""``poptorch.DataLoader``: a ``torch.utils.data.DataLoader`` that loads whole combined batches.

Behaviour reproduced from PopTorch (python/__init__.py ``DataLoader``, ``_SubDataset``; tests/dataloader_test.py):

- One element of the loader is a combined batch of ``batch_size * D * (R / input_group_size) * G`` rows,
  where D, R, G come from the options (which the loader freezes). ``len()`` is what torch computes for
  that batch size, or, when rebatching, ``len(dataset) // combined`` (+1 for a kept partial tail).
- Map-style datasets keep the item order; with ``Options.Distributed`` each process reads its own
  contiguous block (shuffled globally with ``randomSeed`` when ``shuffle=True``, leftovers rotating
  between epochs).
- ``IterableDataset`` with several workers: torch drops each worker's last partial batch (101 items,
  7 workers, batch 4: 80 used). ``mode=AsyncRebatched`` lets workers emit batches of
  ``rebatched_worker_size`` rows (default: the combined batch) without dropping, and the accessor
  re-forms full combined batches (100 used; with ``drop_last=False`` the 1 left over comes last).
- ``mode=Async`` reads through an ``AsynchronousDataAccessor``; with ``drop_last=False`` and a combined
  batch > 1 it rebatches, as PopTorch does.
- A user ``batch_sampler`` (exclusive with ``batch_size`` and ``shuffle``) yields micro-batches that are
  concatenated D*R*G at a time.

Where it differs: PopTorch's loading process (spawned) shuffles an Async loader from a generator of its own,
another order each run; here ``shuffle=True`` in the Async modes takes a generator seeded at construction from
torch's state (``torch.manual_seed``, ``Options.randomSeed``), which it leaves as it was: the same seed, the
same epochs, and the caller's later random numbers unchanged (not Sync's order, drawn at each epoch's start).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.data

from . import _structure
from .accessor import AsynchronousDataAccessor
from .enums import DataLoaderMode
from .options import Options
from .poptorch_core import py_error

logger = logging.getLogger("poptorch_emulator")


class _ProcessShard(torch.utils.data.Dataset):
    """This process's contiguous block of a map-style dataset in a distributed run.

    Blocks are whole combined batches when ``drop_last`` (every process gets the same number of
    batches), otherwise as even as possible. With a seed the indices are permuted over the whole dataset,
    the same way in every process; ``next_epoch`` draws a new permutation and moves the block by the
    number of left-over items on every other epoch, so left-over items are used too.
    """

    def __init__(self, dataset: Any, options: Options, step: int, drop_last: bool, shuffle: bool) -> None:
        n = len(dataset)
        procs, pid = options.Distributed.numProcesses, options.Distributed.processId
        if drop_last:
            per_proc = step * (n // (step * procs))
            offset = pid * per_proc
            self._length = max(0, min(per_proc, n - offset))
            self._leftovers = n % per_proc if per_proc else 0
        else:
            sizes = [n // procs + (1 if n % procs > p else 0) for p in range(procs)]
            offset = sum(sizes[:pid])
            self._length = sizes[pid]
            self._leftovers = 0
        self._dataset = dataset
        self._base_offset = offset
        # Shared so that persistent worker processes see the epoch's offset and permutation.
        self._offset = torch.tensor([offset], dtype=torch.int64).share_memory_()
        self._seed = options.random_seed if options.exists("random_seed") else None
        self._generator_state: torch.Tensor | None = None
        # Allocated now, in shared memory, so that every copy of the shard (data workers, the accessor's
        # process) reads the permutation of the epoch.
        self._permutation = torch.arange(n).share_memory_() if shuffle else None

    def next_epoch(self) -> None:
        """New global permutation and (every other epoch) a block shifted by the left-over count."""
        gen = torch.Generator()
        if self._generator_state is None:
            if self._seed is None:
                raise AssertionError("Seed must be set when shuffling so that all instances end up with "
                                     "the same shuffled global indices.")
            gen.manual_seed(self._seed)
        else:
            gen.set_state(self._generator_state)
        perm = torch.randperm(len(self._dataset), generator=gen)
        self._generator_state = gen.get_state()
        assert self._permutation is not None, "next_epoch() is for a shuffled shard"
        self._permutation.copy_(perm)
        shifted = int(self._offset[0]) != self._base_offset
        self._offset[0] = self._base_offset if shifted else self._base_offset + self._leftovers

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index: int) -> Any:
        i = index + int(self._offset[0])
        if self._permutation is not None:
            i = int(self._permutation[i])
        return self._dataset[i]


def _concat_batches(batches: list[Any]) -> Any:
    flat = [_structure.flatten(b) for b in batches]
    joined = [torch.cat(parts, dim=0) for parts in zip(*flat)]
    return _structure.rebuild(batches[-1], iter(joined))


def _combine_sampled_batches(batches: Iterator[Any], count: int, drop_last: bool) -> Iterator[Any]:
    """Concatenate ``count`` consecutive micro-batches from a batch sampler into one combined batch."""
    pending: list[Any] = []
    for batch in batches:
        pending.append(batch)
        if len(pending) == count:
            yield _concat_batches(pending)
            pending = []
    if pending and not drop_last:
        yield _concat_batches(pending)


class DataLoader(torch.utils.data.DataLoader):
    """PopTorch's data loader: each element is one host call's combined batch."""

    def __init__(self, options: Options, dataset: Any, batch_size: int | None = 1, shuffle: bool | None = None,
                 num_workers: int = 0, drop_last: bool = True, persistent_workers: bool | None = None,
                 auto_distributed_partitioning: bool = True, mode: DataLoaderMode = DataLoaderMode.Sync,
                 async_options: dict[str, Any] | None = None, rebatched_worker_size: int | None = None,
                 batch_sampler: Any = None, **kwargs: Any) -> None:
        if not isinstance(options, Options):
            raise AssertionError(f"options must be a poptorch.Options, not {type(options)}")
        self._user_batch_sampler = batch_sampler is not None
        self._batch_sampler_drop_last = drop_last
        if self._user_batch_sampler:
            if batch_size != 1 or shuffle:
                raise py_error("`batch_sampler` option is mutually exclusive with batch_size, shuffle.")
            if options.Distributed.numProcesses > 1 and auto_distributed_partitioning:
                raise py_error("`batch_sampler` option is mutually exclusive with "
                               "auto_distributed_partitioning=True.")
            batch_size = getattr(batch_sampler, "batch_size", batch_size)
            drop_last = None  # the batch sampler decides
        elif shuffle is None:
            shuffle = False

        options._freeze()
        self._options = options
        if persistent_workers is None:
            persistent_workers = num_workers > 0

        if batch_size is None:
            self._combined_batch_size = None
            self._num_batches_to_combine = None
        else:
            groups = options.replication_factor // options.input_group_size
            self._num_batches_to_combine = (options.device_iterations * groups
                                            * options.Training.gradient_accumulation)
            self._combined_batch_size = batch_size * self._num_batches_to_combine

        self._is_iterable = isinstance(dataset, torch.utils.data.IterableDataset)
        self._shard: _ProcessShard | None = None
        self._shard_shuffles = False
        self._accessor = None
        procs = options.Distributed.numProcesses
        if self._is_iterable:
            if auto_distributed_partitioning and procs != 1:
                raise AssertionError("auto_distributed_partitioning not supported for IterableDataset")
            if num_workers > 1 and "worker_init_fn" not in kwargs:
                logger.warning(
                    "IterableDataset used with num_workers=%d but no worker_init_fn specified: as a result "
                    "the DataLoader will return %d times each element in the dataset (See "
                    "torch.utils.data.IterableDataset's documentation for more information)",
                    num_workers, num_workers)
        else:
            n = len(dataset)
            if (not drop_last and not self._user_batch_sampler and self._combined_batch_size is not None
                    and n % (self._combined_batch_size * procs) != 0):
                logger.warning(
                    "The number of elements in the dataset (%d) is not divisible by the number of elements "
                    "processed per step (%d) and drop_last=False. The last tensor will have a batch size of "
                    "%d. To avoid having to handle this special case switch to drop_last=True",
                    n, self._combined_batch_size * procs, n % (self._combined_batch_size * procs))
            if procs > 1 and auto_distributed_partitioning:
                if shuffle and not options.exists("random_seed"):
                    raise AssertionError(
                        "When using auto_distributed_partitioning you must set poptorch.Options.randomSeed() "
                        "to ensure that tensors are in the same order in all processes.")
                if self._combined_batch_size is None:
                    raise AssertionError("batch_size=None not allowed when using "
                                         "auto_distributed_partitioning.")
                self._shard = _ProcessShard(dataset, options, self._combined_batch_size, drop_last,
                                            shuffle=bool(shuffle))
                dataset = self._shard
                self._shard_shuffles = bool(shuffle)
                shuffle = False  # the shard shuffles over the whole dataset instead

        loader_batch_size = 1 if self._user_batch_sampler else self._combined_batch_size
        real_drop_last = self._batch_sampler_drop_last if self._user_batch_sampler else drop_last
        rebatched_size = None
        self.rebatched_drop_last = real_drop_last
        combined_gt_one = self._combined_batch_size is not None and self._combined_batch_size > 1
        if mode == DataLoaderMode.AsyncRebatched or (
                mode == DataLoaderMode.Async and not real_drop_last and combined_gt_one):
            mode = DataLoaderMode.Async
            rebatched_size = self._combined_batch_size
            self.rebatched_drop_last = drop_last
            drop_last = False  # the accessor handles the leftovers
            if rebatched_worker_size is not None:
                if rebatched_worker_size > self._combined_batch_size:
                    raise AssertionError(
                        f"The rebatched_worker_size ({rebatched_worker_size}) must be <= to the combined "
                        f"batch size ({self._combined_batch_size})")
                loader_batch_size = rebatched_worker_size

        if mode == DataLoaderMode.Async and shuffle and kwargs.get("generator") is None:
            # the loading process's own torch generator never saw the caller's seed: shuffle with one
            # seeded here, from the caller's generator (torch.manual_seed, Options.randomSeed)
            state = torch.get_rng_state()
            kwargs["generator"] = torch.Generator().manual_seed(
                int(torch.empty((), dtype=torch.int64).random_().item()))
            torch.set_rng_state(state)
        super().__init__(dataset, batch_size=loader_batch_size, shuffle=shuffle, batch_sampler=batch_sampler,
                         num_workers=num_workers, drop_last=drop_last, persistent_workers=persistent_workers,
                         **kwargs)

        if mode == DataLoaderMode.Async:
            async_options = dict(async_options or {})
            if "rebatched_size" in async_options:
                raise AssertionError("You cannot use DataLoaderMode.AsyncRebatched and manually specify the "
                                     "rebatched_size in async_options")
            self._accessor = AsynchronousDataAccessor(self, **async_options, rebatched_size=rebatched_size)
            self._accessor._owned_by(self)

    # -- PopTorch API -------------------------------------------------------------------------------
    @property
    def combinedBatchSize(self) -> int | None:
        """Rows consumed from the dataset by one host call."""
        return self._combined_batch_size

    @property
    def options(self) -> Options:
        return self._options

    def terminate(self) -> None:
        """Stop the accessor's process (Async modes); nothing to do in Sync mode."""
        accessor = self.__dict__.get("_accessor")
        if accessor is not None:
            accessor.terminate()

    def __del__(self) -> None:
        self.terminate()

    def __len__(self) -> int:
        accessor = self.__dict__.get("_accessor")
        if accessor is not None and accessor.rebatched_size:
            n = len(self.dataset)
            length = n // accessor.rebatched_size
            if not self.rebatched_drop_last and n % accessor.rebatched_size:
                length += 1
            return length
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        accessor = self.__dict__.get("_accessor")
        if accessor is not None:
            return iter(accessor)
        return self._epoch_iter()

    def __getstate__(self) -> dict[str, Any]:
        # The loader is the source of its accessor: the accessor's process gets it without the accessor
        # (so iterating it there reads the dataset) and without a live iterator.
        state = dict(self.__dict__)
        state["_accessor"] = None
        state["_iterator"] = None
        return state

    def _epoch_iter(self) -> Iterator[Any]:
        """One epoch read as torch's DataLoader reads it (in the accessor's process in Async modes)."""
        if self._shard is not None and self._shard_shuffles:
            self._shard.next_epoch()
        if self._user_batch_sampler and self._num_batches_to_combine != 1:
            return _combine_sampled_batches(super().__iter__(), self._num_batches_to_combine,
                                            self._batch_sampler_drop_last)
        return super().__iter__()
