"""The data side: stores of episodes, the schedule both front ends read, squashing, dynamic batching,
rebatching, the async accessor and the batched front end's loader.

Most callers need :func:`make_loader` only; see :mod:`accelbatch.data.loader` for what it yields.
"""

from __future__ import annotations

from accelbatch.data.accessor import AsyncDataAccessor
from accelbatch.data.batching import (
                                      STRATEGIES,
                                      Batch,
                                      BatchingConfig,
                                      BatchStats,
                                      BucketShape,
                                      MessageLength,
                                      batch_stats,
                                      make_batches,
                                      plan_buckets,
)
from accelbatch.data.datasets import ConcatStore, EpisodeStore, FileStore, Store
from accelbatch.data.loader import (
                                      MODES,
                                      AgentCollate,
                                      LoadedBatch,
                                      Loader,
                                      LoaderConfig,
                                      make_loader,
                                      pad_to_shape,
)
from accelbatch.data.rebatch import Rows, rebatch
from accelbatch.data.schedule import BatchPlan, EpisodeTable, RowFeed, RowSchedule
from accelbatch.data.squash import histories, squash_episode, squash_episodes

__all__ = [
    "AsyncDataAccessor", "STRATEGIES", "Batch", "BatchingConfig", "BatchStats", "BucketShape", "MessageLength",
    "batch_stats", "make_batches", "plan_buckets", "ConcatStore", "EpisodeStore", "FileStore", "Store", "MODES",
    "AgentCollate", "LoadedBatch", "Loader", "LoaderConfig", "make_loader", "pad_to_shape", "Rows", "rebatch",
    "BatchPlan", "EpisodeTable", "RowFeed", "RowSchedule", "histories", "squash_episode", "squash_episodes",
]
