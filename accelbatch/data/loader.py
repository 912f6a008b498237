"""The batched front end's loader: the schedule's steps collated in data workers, optionally through the async
accessor.

``make_loader(data, config=None, *, collate=None, training=True, shard=(0, 1), rows=None, serve=None,
length_fn=None, cut=None, **changes)``: ``data`` is a :class:`~accelbatch.data.datasets.Store`, a list of
episodes (lists of Messages), a list of single-turn Messages, or a path to a JSONL / ParlAI file (read on
demand); ``config`` a :class:`LoaderConfig` or Opts (``changes`` override single fields);
``collate(observations) -> tensors`` runs where the batch is built (a data worker, the accessor process, or
here), so it must be picklable (e.g. :class:`AgentCollate` of the agent's ``vectorize`` and ``batchify``);
``shard`` is this process's share of the episodes (index, count); ``rows`` the rows per step without dynamic
batching (default ``batch_size``), of which ``serve`` (default all) are this process's: a replica collates its
rows of the combined batch. With dynamic batching, ``cut(n)`` (each replica's rows of an ``n``-row
combined batch) has every replica plan the batches of all the data (``batch_size``: the combined batch) and run its
rows of each.

Each step is the schedule's (:mod:`accelbatch.data.schedule`): without dynamic batching the rows of a
RowSchedule (whole episodes row by row: what a BatchWorld of teacher clones serves, so the same seed gives the
same batches either way), with ``--dynamic-batching`` the batches of a BatchPlan. Workers and the accessor
change where a step is built, never what it holds; through the accessor a batch's tensors are views of its ring
and stay valid while the caller fetches the next one (a training loop fetches one batch ahead to stage its copy
to a device), until the one after. ``async-rebatched`` is ``async``: planned steps lose no tail. A pass is one
epoch of the plan, one evaluation, or in training without dynamic batching the steps an epoch of examples
takes (rows run on across passes). ``state_dict()`` is the position as the caller consumed it (not what was
read ahead); ``load_state_dict`` makes a fresh loader continue there. With ``buckets`` (and ``static_rows``)
every batch is padded to its planned shape (zero rows; ``seq_keys`` along dim 1).
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import DataLoader

from accelbatch.data.accessor import AsyncDataAccessor
from accelbatch.data.batching import MessageLength
from accelbatch.data.config import MODES, LoaderConfig
from accelbatch.data.datasets import EpisodeStore, FileStore, Store
from accelbatch.data.steps import PassSteps, batching_config
from accelbatch.data.workers import (
    AgentCollate,
    BuildStep,
    LoadedBatch,
    PassLoader,
    identity,
    init_data_worker,
    pad_to_shape,
    unpacked,
    unpickled,
)
from accelbatch.held_sigint import start_forkserver
from accelbatch.messages import Message
from accelbatch.start_method import default_start_method
from accelbatch.tasks.files import FileIndex

__all__ = ["AgentCollate", "LoadedBatch", "Loader", "LoaderConfig", "MODES", "init_data_worker", "make_loader",
           "pad_to_shape"]


class Loader:
    """Re-iterable source of :class:`LoadedBatch` (see the module docstring); build with :func:`make_loader`."""

    def __init__(self, dataloader: DataLoader, steps: PassSteps, config: LoaderConfig, shapes: list | None):
        self.config, self.steps, self.shapes = config, steps, shapes
        self._dataloader: DataLoader | None = dataloader
        self._accessor: AsyncDataAccessor | None = None
        self._consumed = (0, 0)  # (pass, steps of it) the caller has received
        if config.mode != "sync":
            self._start_accessor()

    def _start_accessor(self) -> None:
        self._accessor = AsyncDataAccessor(self._dataloader, buffer_size=self.config.buffer_size,
                                           early_preload=True, load_indefinitely=True,
                                           timeout_s=self.config.timeout_s, transform=unpickled,
                                           empty_passes=True,  # a replica's share of a small split may be none
                                           consumer_holds=2)   # LoaderWorld's batch and the one fetched ahead

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def dropped(self) -> int:
        """Examples left out of the coming pass (dynamic batching in training: partial batches, replicas)."""
        return self.steps.dropped(self.steps.pass_)

    def __len__(self) -> int:
        return self.steps.steps_in(self.steps.pass_)

    def __iter__(self) -> Iterator[LoadedBatch]:
        if self._dataloader is None:
            raise RuntimeError("this loader was closed; make a new one with make_loader()")
        source = iter(self._accessor) if self._accessor is not None else iter(self._dataloader)
        return self._track(unpacked(source))

    def _track(self, it: Iterator[LoadedBatch]) -> Iterator[LoadedBatch]:
        """Record each batch's step as it is handed to the caller (what the caller consumed)."""
        try:
            for batch in it:
                self._consumed = (batch.step[0], batch.step[1] + 1)
                yield batch
        finally:
            it.close()

    # data position ------------------------------------------------------------------------------
    def position(self, held: int = 0) -> tuple[int, int]:
        """(pass, steps of it) the caller has used, a finished pass as the next one's step 0; ``held``: the
        last batches received that the caller has not used yet."""
        pass_, done = self._consumed
        done -= held
        while done < 0:
            pass_ -= 1
            done += self.steps.steps_in(pass_)
        if done >= self.steps.steps_in(pass_):
            pass_, done = pass_ + 1, 0
        return pass_, done

    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """The position as the caller consumed it: ``{"pass", "steps", "digest"}`` (JSON data); ``held``: the
        last batches received that the caller has not used yet (they are served again after a restore)."""
        pass_, done = self.position(held)
        return {"pass": pass_, "steps": done, "digest": self.steps.digest(pass_)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next pass continue at a :meth:`state_dict` position (same data and options; before
        iterating on). ValueError when it does not fit this loader."""
        if self._dataloader is None:
            raise RuntimeError("this loader was closed; make a new one with make_loader()")
        try:
            pass_, done, digest = int(state["pass"]), int(state["steps"]), str(state["digest"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"data position: {state!r} is not a loader position") from None
        if pass_ < 0 or not 0 <= done <= self.steps.steps_in(pass_) or self.steps.digest(pass_) != digest:
            raise ValueError("data position: the checkpoint's batches differ from this run's (other data: a data "
                             "file changed since the checkpoint?, --seed, "
                             "--batchsize, --dynamic-batching or its options, or replicas); resume with the same "
                             "ones, or start afresh without --resume")
        self.steps.pass_, self.steps.skip, self.steps._current = pass_, done, None
        self._consumed = (pass_, done)
        if self._accessor is not None:  # it has loaded ahead from the old position: start it afresh
            self._accessor.terminate()
            self._start_accessor()

    def close(self) -> None:
        if self._accessor is not None:
            self._accessor.terminate()
            self._accessor = None
        self._dataloader = None

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def as_store(data: Any, training: bool, speaker: str = "loader") -> Store:
    """A store for ``data`` (see :func:`make_loader`)."""
    if isinstance(data, Store):
        return data
    if isinstance(data, (str, os.PathLike)):
        return FileStore(FileIndex.build(os.fspath(data)), speaker, training)
    data = list(data)
    if not data:
        raise ValueError("make_loader: the dataset holds no examples")
    episodes = data if isinstance(data[0], (list, tuple)) else [[m] for m in data]
    return EpisodeStore(episodes, speaker, training)


def make_loader(data: Any, config: LoaderConfig | Any | None = None, *, collate: Callable | None = None,
                training: bool = True, shard: tuple[int, int] = (0, 1), rows: int | None = None,
                serve: Sequence[int] | None = None, length_fn: Callable[[Message], int] | None = None,
                cut: Callable[[int], Sequence[Sequence[int]]] | None = None, **changes: Any) -> Loader:
    """Build the loader for ``data`` (see the module docstring for every argument and what it yields)."""
    if config is None:
        config = LoaderConfig(**changes)
    elif isinstance(config, LoaderConfig):
        config = replace(config, **changes) if changes else config
    else:
        config = LoaderConfig.from_opts(config, **changes)
    store = as_store(data, training)
    length_fn = length_fn or MessageLength(config.text_truncate)
    strategy = config.dynamic_batching
    batching, lengths, shapes = None, None, None
    if strategy != "none":
        lengths = store.lengths(length_fn, config.context_length, config.include_labels)
        planned = lengths[:-1]
        if not cut and shard[1] > 1:  # a hogwild process: its buckets fit its own share of the episodes
            own = store.table.shard(*shard)
            planned = lengths[own.flat(np.arange(own.num_episodes))]
        batching, shapes = batching_config(config, planned, 1)
    steps = PassSteps(store, config, training, shard, rows or config.batch_size, lengths, batching, serve, cut)
    workers = config.num_workers
    build = BuildStep(store, collate, config.context_length, config.include_labels, length_fn,
                       strategy == "buckets", config.static_rows, tuple(config.seq_keys), pack=workers > 0)
    # workers stay up across passes (no fork and cold queue at every epoch boundary); their seeds come from
    # a generator of their own, so starting them draws nothing from the run's torch generator
    kwargs: dict[str, Any] = dict(batch_size=None, num_workers=workers, collate_fn=identity,
                                  persistent_workers=workers > 0)
    if workers > 0:
        kwargs.update(timeout=config.timeout_s, worker_init_fn=init_data_worker)  # PassLoader: which thread starts
        if default_start_method() == "forkserver":  # the workers fork from the run's server, which ends with it
            start_forkserver()
    dataloader = PassLoader(build, sampler=steps, **kwargs)
    dataloader.seed = config.seed
    return Loader(dataloader, steps, config, shapes)


