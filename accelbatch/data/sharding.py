"""Sharding: split data across processes x replicas x data workers, nothing lost, nothing repeated.

A :class:`ShardSpec` names one shard among ``num_processes x num_replicas x num_workers``; its flat
:attr:`~ShardSpec.index` orders them process-major, then replica, then worker. Every splitting function here
partitions: over all shard indices the parts are disjoint and their union is the whole.

- map-style data: :func:`shard_indices` (strided, so every shard sees the same mix of the order it is given;
  ``contiguous=True`` for contiguous blocks), or :func:`shard_bounds` for one block;
- streams: :func:`shard_stream` (every shard reads the stream and keeps every n-th item) or, for files,
  :func:`byte_ranges` (each shard reads its own part of the file; see :mod:`accelbatch.data.datasets`);
- a shard's data worker is filled in from torch's worker info with :meth:`ShardSpec.in_worker`.

:func:`even_shards` makes training shards equally long (the smallest shard's length, the rest dropped and
counted), which synchronous data-parallel training needs; evaluation keeps everything.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Iterable, Iterator, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class ShardSpec:
    """One shard of data among processes x replicas x data workers (all counts >= 1)."""

    num_processes: int = 1
    process_index: int = 0
    num_replicas: int = 1
    replica_index: int = 0
    num_workers: int = 1
    worker_id: int = 0

    def __post_init__(self) -> None:
        for count_name, index_name in (("num_processes", "process_index"), ("num_replicas", "replica_index"),
                                       ("num_workers", "worker_id")):
            count, idx = getattr(self, count_name), getattr(self, index_name)
            if count < 1:
                raise ValueError(f"ShardSpec: {count_name} must be at least 1, got {count}")
            if not 0 <= idx < count:
                raise ValueError(f"ShardSpec: {index_name}={idx} is outside 0..{count - 1}")

    @property
    def num_shards(self) -> int:
        return self.num_processes * self.num_replicas * self.num_workers

    @property
    def index(self) -> int:
        return (self.process_index * self.num_replicas + self.replica_index) * self.num_workers + self.worker_id

    @property
    def rank(self) -> int:
        """Index among processes x replicas (the data-parallel rank; workers not counted)."""
        return self.process_index * self.num_replicas + self.replica_index

    @property
    def world_size(self) -> int:
        return self.num_processes * self.num_replicas

    def with_workers(self, num_workers: int, worker_id: int = 0) -> "ShardSpec":
        return replace(self, num_workers=max(1, num_workers), worker_id=worker_id)

    def without_workers(self) -> "ShardSpec":
        return replace(self, num_workers=1, worker_id=0)

    def in_worker(self) -> "ShardSpec":
        """This spec with the worker filled in from ``torch.utils.data.get_worker_info()`` (none: worker 0 of 1)."""
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        if info is None:
            return self.with_workers(1, 0)
        return self.with_workers(info.num_workers, info.id)

    @staticmethod
    def all(num_processes: int = 1, num_replicas: int = 1, num_workers: int = 1) -> list["ShardSpec"]:
        """Every shard of a layout, in index order."""
        return [ShardSpec(num_processes, p, num_replicas, r, num_workers, w)
                for p in range(num_processes) for r in range(num_replicas) for w in range(num_workers)]


def _check(num_shards: int, index: int) -> None:
    if num_shards < 1:
        raise ValueError(f"num_shards must be at least 1, got {num_shards}")
    if not 0 <= index < num_shards:
        raise ValueError(f"shard index {index} is outside 0..{num_shards - 1}")


def shard_bounds(n: int, num_shards: int, index: int) -> tuple[int, int]:
    """[start, stop) of block ``index`` when ``n`` items are cut into ``num_shards`` blocks differing by <= 1."""
    _check(num_shards, index)
    base, extra = divmod(n, num_shards)
    start = index * base + min(index, extra)
    return start, start + base + (1 if index < extra else 0)


def shard_indices(order: int | Sequence[T], num_shards: int, index: int, contiguous: bool = False) -> list:
    """This shard's part of ``order`` (or of ``range(order)``): strided by default, else a contiguous block."""
    seq = range(order) if isinstance(order, int) else order
    _check(num_shards, index)
    if contiguous:
        start, stop = shard_bounds(len(seq), num_shards, index)
        return list(seq[start:stop])
    return list(seq[index::num_shards])


def shard_stream(items: Iterable[T], num_shards: int, index: int) -> Iterator[T]:
    """Every ``num_shards``-th item of a stream, starting at ``index``."""
    _check(num_shards, index)
    return itertools.islice(items, index, None, num_shards)


def byte_ranges(size: int, num_shards: int) -> list[tuple[int, int]]:
    """Cut ``size`` bytes into ``num_shards`` contiguous [start, stop) ranges (some may be empty)."""
    return [shard_bounds(size, num_shards, i) for i in range(num_shards)]


def even_shards(lengths: Sequence[int]) -> tuple[int, int]:
    """(common length, items dropped) when every shard is cut to the shortest one (training only)."""
    if not lengths:
        return 0, 0
    common = min(lengths)
    return common, sum(n - common for n in lengths)
