"""The batched front end's loader: the schedule's steps collated in data workers, optionally through the async
accessor.

``make_loader(data, config=None, *, collate=None, training=True, shard=(0, 1), rows=None, serve=None,
length_fn=None, **changes)``: ``data`` is a :class:`~accelbatch.data.datasets.Store`, a list of episodes (lists
of Messages), a list of single-turn Messages, or a path to a JSONL / ParlAI file (read on demand); ``config`` a
:class:`LoaderConfig` or Opts (``changes`` override single fields); ``collate(observations) -> tensors`` runs
where the batch is built (a data worker, the accessor process, or here), so it must be picklable (e.g.
:class:`AgentCollate` of the agent's ``vectorize`` and ``batchify``); ``shard`` is this process's share of the
episodes (index, count); ``rows`` the rows per step without dynamic batching (default ``batch_size``), of
which ``serve`` (default all) are this process's: a replica collates its rows of the combined batch.

Each step is the schedule's (:mod:`accelbatch.data.schedule`): without dynamic batching the rows of a
RowSchedule (whole episodes row by row: what a BatchWorld of teacher clones serves, so the same seed gives the
same batches either way), with ``--dynamic-batching`` the batches of a BatchPlan. Workers and the accessor
change where a step is built, never what it holds. ``async-rebatched`` is ``async``: planned steps lose no
tail. A pass is one epoch of the plan, one evaluation, or in training without dynamic batching the steps an
epoch of examples takes (rows run on across passes). ``state_dict()`` is the position as the caller consumed
it (not what was read ahead); ``load_state_dict`` makes a fresh loader continue there. With ``buckets`` (and
``static_rows``) every batch is padded to its planned shape (zero rows; ``seq_keys`` along dim 1).
"""

from __future__ import annotations

import gc
import hashlib
import math
import os
import pickle
import signal
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from accelbatch.data.accessor import AsyncDataAccessor, pickle_batch
from accelbatch.data.batching import (
    STRATEGIES,
    BatchingConfig,
    MessageLength,
    default_max_tokens,
    plan_buckets,
    token_cache_size,
)
from accelbatch.data.datasets import EpisodeStore, FileStore, Store
from accelbatch.data.rebatch import tree_map
from accelbatch.data.schedule import BatchPlan, RowSchedule, make_order
from accelbatch.messages import Message
from accelbatch.procs import FailureRecord, ProcessDied, ProcessTimeout
from accelbatch.tasks.files import FileIndex

__all__ = ["AgentCollate", "LoadedBatch", "Loader", "LoaderConfig", "MODES", "init_data_worker", "make_loader",
           "pad_to_shape"]

MODES = ("sync", "async", "async-rebatched")


@dataclass(frozen=True)
class LoaderConfig:
    """Every knob of the loader; :meth:`from_opts` reads the matching Opts fields."""

    batch_size: int = 32
    mode: str = "sync"
    num_workers: int = 0
    dynamic_batching: str = "none"
    max_batch_tokens: int = -1
    num_buckets: int = 8
    batch_sort_cache_size: int = 1000
    buffer_size: int = 3
    drop_last: bool = True
    shuffle: bool = True
    seed: int = 0
    text_truncate: int = 256
    label_truncate: int = -1        # with text_truncate: the default token budget (ParlAI's), -1: as text
    context_length: int = -1
    include_labels: bool = True
    row_multiple: int = 1           # rows of full/buckets batches: multiples of this (e.g. D x R x G)
    static_rows: bool = False       # pad partial fixed-row batches with padding rows to batch_size
    token_count: str = "padded"     # 'full': budget counts rows x longest ('padded') or the sum ('words')
    seq_keys: tuple[str, ...] = ("text_vec",)
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--dataloader-mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.dynamic_batching not in STRATEGIES:
            raise ValueError(f"--dynamic-batching: {self.dynamic_batching!r} is not one of {', '.join(STRATEGIES)}")
        for name in ("batch_size", "num_buckets", "batch_sort_cache_size", "buffer_size", "row_multiple"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers: must be 0 or more, got {self.num_workers}")

    @classmethod
    def from_opts(cls, opts: Any, **changes: Any) -> "LoaderConfig":
        names = {"batch_size": "batchsize", "mode": "dataloader_mode", "timeout_s": "data_timeout_s"}
        values = {f.name: opts[names.get(f.name, f.name)] for f in fields(cls)
                  if names.get(f.name, f.name) in opts}
        values.update(changes)
        return cls(**values)


@dataclass
class LoadedBatch:
    """One step as the loader delivers it: collated ``tensors`` with ``rows`` rows (rows ``num_real`` on are
    padding), the real rows' observations, their flat indices in the store (``ids``) and lengths, the planned
    padded length, and ``step`` = (pass, index in the pass)."""

    tensors: Any
    messages: list[Message]
    ids: list[int]
    lengths: list[int]
    rows: int
    padded_len: int
    step: tuple[int, int] = (0, 0)

    @property
    def num_real(self) -> int:
        return len(self.messages)

    @property
    def pad_fraction(self) -> float:
        total = self.rows * self.padded_len
        return (total - sum(self.lengths)) / total if total else 0.0


class AgentCollate:
    """``collate(messages) = batchify([vectorize(m) for m in messages])``; picklable if both are."""

    def __init__(self, vectorize: Callable[[Message], Message], batchify: Callable[[list[Message]], Any]):
        self.vectorize, self.batchify = vectorize, batchify

    def __call__(self, messages: list[Message]) -> Any:
        return self.batchify([self.vectorize(Message(m)) for m in messages])


def init_data_worker(worker_id: int) -> None:
    """Set up a data worker: Ctrl-C is the run's (it saves, then stops the workers); what the worker inherited
    (the store among it) lives as long as it does, so it is frozen out of the collector's reach: otherwise
    every full collection walks it and, in a forked worker, copies each page it touches."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    torch.set_num_threads(1)
    gc.freeze()


def pad_to_shape(tensors: Any, num_real: int, rows: int, padded_len: int | None = None,
                 seq_keys: Sequence[str] = ("text_vec",)) -> Any:
    """Zero-pad a collated batch to ``rows`` rows, and its ``seq_keys`` tensors along dim 1 to ``padded_len``."""
    def pad_rows(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == num_real and rows > num_real:
            return torch.cat([t, t.new_zeros((rows - num_real, *t.shape[1:]))], dim=0)
        return t

    if padded_len is not None and isinstance(tensors, dict):
        tensors = dict(tensors)
        for key in seq_keys:
            t = tensors.get(key)
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and t.shape[1] != padded_len:
                if t.shape[1] > padded_len:
                    raise ValueError(f"static shapes: '{key}' has length {t.shape[1]} but the batch was planned "
                                     f"for {padded_len}; the loader's length_fn undercounts the collate's "
                                     "sequence length (give make_loader a length_fn that counts the same tokens)")
                extra = t.new_zeros((t.shape[0], padded_len - t.shape[1], *t.shape[2:]))
                tensors[key] = torch.cat([t, extra], dim=1)
    return tree_map(pad_rows, tensors)


# --------------------------------------------------------------------------------------------------
# the steps of each pass
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Step:
    """What a data worker builds: step ``index`` of ``pass_`` serves flat indices ``ids`` (real rows) in a
    batch of ``rows`` rows padded to ``padded_len`` (0: the collate's own padding)."""

    pass_: int
    index: int
    ids: tuple[int, ...]
    rows: int
    padded_len: int


class _Steps(Sampler):
    """This process's steps, pass by pass: the rows of a RowSchedule or the batches of a BatchPlan."""

    def __init__(self, store: Store, config: LoaderConfig, training: bool, shard: tuple[int, int], rows: int,
                 lengths: np.ndarray | None, batching: BatchingConfig | None, serve: Sequence[int] | None = None):
        index, count = shard
        self.training, self.pad, self.static_rows = training, store.pad, config.static_rows
        self.table = store.table.shard(index, count)
        self.pass_, self.skip = 0, 0
        self._current: tuple[int, int] | None = None  # (pass, first index) of the pass under way
        if batching is None:
            order = make_order(self.table, training and config.shuffle, config.seed)
            self.rows = RowSchedule(self.table, rows, order, loop=training, pad=store.pad, serve=serve)
            self.plan, self.lengths = None, None
            self.per_pass = (math.ceil(self.table.num_examples / rows) if training else self.rows.steps)
        else:
            tables = [store.table.shard(r, count) for r in range(count)]
            self.plan = BatchPlan(tables, index, lengths, batching, training, training and config.shuffle,
                                  config.seed, config.drop_last)
            self.rows, self.lengths, self.per_pass = None, lengths, 0

    def steps_in(self, pass_: int) -> int:
        return self.per_pass if self.plan is None else self.plan.count(pass_)[0]

    def dropped(self, pass_: int) -> int:
        return 0 if self.plan is None else self.plan.count(pass_)[1]

    def begin_pass(self) -> None:
        """A new pass: called once per pass by the DataLoader (torch may iterate a sampler twice per pass)."""
        self._current = (self.pass_, self.skip)
        self.pass_, self.skip = self.pass_ + 1, 0

    def __len__(self) -> int:
        return self.steps_in(self.pass_ if self._current is None else self._current[0])

    def __iter__(self) -> Iterator[Step]:
        if self._current is None:
            self.begin_pass()
        pass_, first = self._current  # type: ignore[misc]
        if self.plan is not None:
            return (Step(pass_, i, tuple(b.items), b.rows, b.padded_len)
                    for i, b in enumerate(self.plan.batches(pass_, first), first))
        return self._row_steps(pass_, first)

    def _row_steps(self, pass_: int, first: int) -> Iterator[Step]:
        start = (pass_ * self.per_pass if self.training else 0) + first  # evaluation: each pass is the one pass
        if self.rows.next_step != start:
            self.rows.seek(start)
        index = first
        while index < self.per_pass:
            block = self.rows.block(min(self.per_pass - index, max(16, 65536 // self.rows.rows)))
            for row in block.tolist():
                ids = tuple(i for i in row if i != self.pad)
                yield Step(pass_, index, ids, self.rows.rows if self.static_rows else len(ids), 0)
                index += 1

    def digest(self, pass_: int) -> str:
        """What decides the steps (data, shard, rows or plan, order): a position of other ones is refused."""
        key = (f"{self.table.digest()}:{self.rows.layout_rows}:{self.rows.serve.tolist()}:{self.rows.order!r}"
               if self.plan is None else self.plan.key())
        return hashlib.sha256(key.encode()).hexdigest()[:16]


@dataclass
class _BuildStep(Dataset):
    """Builds a step's batch from the store (in a data worker, the accessor, or here)."""

    store: Store
    collate: Callable[[list[Message]], Any] | None
    context_length: int
    include_labels: bool
    length_fn: Callable[[Message], int]
    static_len: bool
    static_rows: bool
    seq_keys: tuple[str, ...]
    pack: bool

    def __getitem__(self, step: Step) -> LoadedBatch | bytes:
        if not self.pack:  # here or in the accessor: an exception is raised where it happens
            return self._build(step)
        try:
            return pickle_batch(self._build(step))
        except Exception as exc:  # noqa: BLE001 - a data worker reports it (torch would wrap it in a RuntimeError)
            info = get_worker_info()
            return pickle_batch(_Failed(FailureRecord.capture(exc), info.id if info else 0, os.getpid()))

    def _build(self, step: Step) -> LoadedBatch:
        messages = self.store.observations(step.ids, self.context_length, self.include_labels)
        lengths = [int(self.length_fn(m)) for m in messages]
        rows = step.rows
        tensors = None
        if self.collate is not None:
            tensors = self.collate(messages)
            padded = step.padded_len if self.static_len else None
            if rows > len(messages) or padded is not None:
                tensors = pad_to_shape(tensors, len(messages), rows, padded, self.seq_keys)
        return LoadedBatch(tensors, messages, list(step.ids), lengths, rows, step.padded_len or max(lengths, default=0),
                           (step.pass_, step.index))

    def __len__(self) -> int:
        return self.store.pad


@dataclass(frozen=True)
class _Failed:
    """What a data worker sends instead of a batch when building it raised."""

    record: FailureRecord
    worker: int
    pid: int


def _named_failures(batches: Iterator[Any], timeout_s: float) -> Iterator[Any]:
    """torch's DataLoader iterator, its workers' failures raised as the process family: a worker's exception
    (sent as :class:`_Failed`) with its own types and traceback, a dead or silent worker named."""
    try:
        for item in batches:
            yield item
    except RuntimeError as exc:  # torch reports a worker's death or silence as a RuntimeError with this text
        text = str(exc)
        if text.startswith("DataLoader timed out after"):
            raise ProcessTimeout(f"no batch from the data workers (--num-workers) within --data-timeout-s="
                                 f"{timeout_s:g} s: a worker hangs, or one batch takes longer than that (raise it "
                                 "if so); the workers were stopped", role="data worker") from None
        if text.startswith("DataLoader worker (pid"):
            raise ProcessDied(f"{text.rstrip('. ')} (--num-workers: killed from outside, out of memory, or a crash "
                              "in native code?); the workers were stopped", role="data worker") from None
        raise


class _PassLoader(DataLoader):
    """A DataLoader that starts one pass of its sampler per iteration (wherever it is iterated), its workers'
    seeds drawn from a generator of its own (made where it is iterated: a generator does not pickle), so
    starting workers draws nothing from the run's torch generator."""

    seed: int = 0

    def __iter__(self):  # type: ignore[override]
        if self.generator is None:
            self.generator = torch.Generator().manual_seed(self.seed)
        self.sampler.begin_pass()
        return _named_failures(super().__iter__(), self.timeout)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["generator"] = None
        return state


def _identity(x: Any) -> Any:
    return x


def _unpacked(items: Iterator[Any]) -> Iterator[Any]:
    try:
        for item in items:
            item = pickle.loads(item) if isinstance(item, bytes) else item
            if isinstance(item, _Failed):
                raise item.record.to_error("data worker", item.worker, item.pid,
                                           name=f"a data worker (--num-workers: worker {item.worker}, pid {item.pid})")
            yield item
    finally:  # an early stop reaches the source (the accessor resets its pass)
        close = getattr(items, "close", None)
        if close is not None:
            close()


class Loader:
    """Re-iterable source of :class:`LoadedBatch` (see the module docstring); build with :func:`make_loader`."""

    def __init__(self, dataloader: DataLoader, steps: _Steps, config: LoaderConfig, shapes: list | None):
        self.config, self.steps, self.shapes = config, steps, shapes
        self._dataloader: DataLoader | None = dataloader
        self._accessor: AsyncDataAccessor | None = None
        self._consumed = (0, 0)  # (pass, steps of it) the caller has received
        if config.mode != "sync":
            self._start_accessor()

    def _start_accessor(self) -> None:
        self._accessor = AsyncDataAccessor(self._dataloader, buffer_size=self.config.buffer_size,
                                           early_preload=True, load_indefinitely=True,
                                           timeout_s=self.config.timeout_s)

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
        return self._track(_unpacked(source))

    def _track(self, it: Iterator[LoadedBatch]) -> Iterator[LoadedBatch]:
        """Record each batch's step as it is handed to the caller (what the caller consumed)."""
        try:
            for batch in it:
                self._consumed = (batch.step[0], batch.step[1] + 1)
                yield batch
        finally:
            it.close()

    # data position ------------------------------------------------------------------------------
    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """The position as the caller consumed it: ``{"pass", "steps", "digest"}`` (JSON data); ``held``: the
        last batches received that the caller has not used yet (they are served again after a restore)."""
        pass_, done = self._consumed
        done -= held
        while done < 0:
            pass_ -= 1
            done += self.steps.steps_in(pass_)
        if done >= self.steps.steps_in(pass_):
            pass_, done = pass_ + 1, 0
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
            raise ValueError("data position: the checkpoint's batches differ from this run's (other data, --seed, "
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
                **changes: Any) -> Loader:
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
        batching, shapes = _batching(config, lengths[:-1], shard[1])
    steps = _Steps(store, config, training, shard, rows or config.batch_size, lengths, batching, serve)
    workers = config.num_workers
    build = _BuildStep(store, collate, config.context_length, config.include_labels, length_fn,
                       strategy == "buckets", config.static_rows, tuple(config.seq_keys), pack=workers > 0)
    # workers stay up across passes (no fork and cold queue at every epoch boundary); their seeds come from
    # a generator of their own, so starting them draws nothing from the run's torch generator
    kwargs: dict[str, Any] = dict(batch_size=None, num_workers=workers, collate_fn=_identity,
                                  persistent_workers=workers > 0)
    if workers > 0:
        kwargs.update(timeout=config.timeout_s, worker_init_fn=init_data_worker)
    dataloader = _PassLoader(build, sampler=steps, **kwargs)
    dataloader.seed = config.seed
    return Loader(dataloader, steps, config, shapes)


def _batching(config: LoaderConfig, lengths: np.ndarray, shards: int = 1) -> tuple[BatchingConfig, list | None]:
    strategy, bs = config.dynamic_batching, config.batch_size
    max_tokens, shapes = config.max_batch_tokens, None
    if strategy in ("full", "buckets") and max_tokens < 1:
        max_tokens = default_max_tokens(bs, config.text_truncate, config.label_truncate, lengths.tolist())
    if strategy == "buckets":
        shapes = plan_buckets(lengths.tolist(), config.num_buckets, bs, max_tokens, config.row_multiple,
                              shards=shards)
    cache = config.batch_sort_cache_size
    if strategy == "full":
        cache = token_cache_size(cache, max_tokens, lengths)
    batching = BatchingConfig(strategy, bs, max_tokens=max_tokens, cache_size=cache,
                              count=config.token_count, row_multiple=config.row_multiple,
                              pad_rows=config.static_rows, shapes=tuple(shapes) if shapes else None)
    return batching, shapes

