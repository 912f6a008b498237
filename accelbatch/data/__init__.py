"""The data side: squashing, dynamic batching, datasets, sharding, rebatching, the async accessor, loaders.

Most callers need :func:`make_loader` only; see :mod:`accelbatch.data.loader` for what it yields.
"""

from accelbatch.data.accessor import (AccessorError, AsyncDataAccessor, EmptySourceError, WorkerDiedError,
                                      WorkerTimeoutError)
from accelbatch.data.batching import (STRATEGIES, Batch, BatchingConfig, BatchStats, BucketShape, MessageLength,
                                      batch_stats, make_batches, plan_buckets)
from accelbatch.data.datasets import ExampleDataset, StreamDataset, StreamSource, read_episodes
from accelbatch.data.loader import MODES, AgentCollate, LoadedBatch, Loader, LoaderConfig, make_loader, pad_to_shape
from accelbatch.data.rebatch import Rows, rebatch
from accelbatch.data.sharding import ShardSpec, shard_indices, shard_stream
from accelbatch.data.squash import squash_episode, squash_episodes

__all__ = [
    "AccessorError", "AsyncDataAccessor", "EmptySourceError", "WorkerDiedError", "WorkerTimeoutError",
    "STRATEGIES", "Batch", "BatchingConfig", "BatchStats", "BucketShape", "MessageLength", "batch_stats",
    "make_batches", "plan_buckets", "ExampleDataset", "StreamDataset", "StreamSource", "read_episodes",
    "MODES", "AgentCollate", "LoadedBatch", "Loader", "LoaderConfig", "make_loader", "pad_to_shape",
    "Rows", "rebatch", "ShardSpec", "shard_indices", "shard_stream", "squash_episode", "squash_episodes",
]
