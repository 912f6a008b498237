"""The data loader every world uses: dynamic batching, sharding, data workers and the async accessor.

Public API
----------

``make_loader(data, config=None, *, collate=None, training=True, shard=None, length_fn=None, **changes)
-> Loader``

``data``
    - an :class:`~accelbatch.data.datasets.ExampleDataset`, a list of single-turn Messages, or a list of
      episodes (lists of Messages; squashed with ``context_length`` / ``include_labels``): map-style;
    - a :class:`~accelbatch.data.datasets.StreamSource` or a path (or list of paths) to JSONL / ParlAI
      files: streamed lazily from disk (``-dt ...:stream``), squashed on the fly.
``config``
    a :class:`LoaderConfig`, or an :class:`~accelbatch.opts.Opts` (read with :meth:`LoaderConfig.from_opts`),
    or None for defaults; keyword ``changes`` override single fields (``batch_size=8, mode="async"``).
``collate``
    ``collate(messages: list[Message]) -> tensors`` (anything made of tensors, tuples, lists, dicts). It
    runs in the data workers (or in the accessor process, or in the caller with ``mode="sync",
    num_workers=0``), so it must be picklable: a module-level function or an object such as
    :class:`AgentCollate` holding the agent's ``vectorize`` and ``batchify``. If it has ``vectorize`` and
    ``batchify`` attributes, ``async-rebatched`` streams vectorize rows in the workers and batchify the
    re-formed batches in the accessor process. None: no tensors (``LoadedBatch.tensors`` is None).
``training``
    True: shuffled map-style order (seed + epoch), the partial last batch of fixed-row strategies dropped
    when ``drop_last`` (counted in :attr:`Loader.dropped`), data-parallel ranks cut to the same number of
    batches. False (evaluation): fixed order, nothing dropped: every example is in exactly one batch of
    exactly one rank, whatever the strategy, mode and number of workers.
``shard``
    a :class:`~accelbatch.data.sharding.ShardSpec` naming this process and replica (the data workers are
    filled in by the loader). Every rank gets its own part of the data.
``length_fn``
    ``Message -> int`` used for dynamic batching (default: words of ``text`` clipped at ``text_truncate``).
    For ``buckets`` it must not undercount the sequence length the collate produces.

A :class:`Loader` is re-iterable (one pass = one epoch) and yields :class:`LoadedBatch`:

``tensors``      the collate's output with ``rows`` rows (padding rows are zeros, see below)
``messages``     the real rows' original Messages (not vectorized), in row order, for metrics and replies
``ids``          their example ids: dataset index (map-style) or ``(file index, line number)`` (streams)
``lengths``      their lengths (``length_fn``)
``rows``         rows of the tensors; rows ``num_real..rows-1`` are padding rows
``padded_len``   the planned padded length (``buckets``: the bucket's length)

``source``       ``(epoch, index)``: where the batch is in its epoch's plan (map-style; None for streams)
``origin``       ``(epoch, worker, n)``: the ``n``-th batch of that data worker in that epoch (streams)

``len(loader)`` is the number of batches of the coming epoch (map-style only). ``loader.close()`` (or
``with``) stops the accessor process and the data workers. In ``async`` modes the tensors of a batch are
views of the accessor's shared ring: valid until the next batch is asked for (``.clone()`` what you keep).

Data position (resume). ``loader.position()`` is JSON data naming the batches the caller has *received*
(not those the workers or the accessor loaded ahead): ``{"epoch": E, "batches": K, "plan_sha256": ...}``,
the first K batches of epoch E's plan consumed. ``loader.restore(position)`` on a fresh loader built with the
same data and options makes the next pass start at batch K of epoch E: the epoch's plan is rebuilt from
(seed, epoch) and the consumed batches are skipped in the sampler, so they are neither read nor collated
(the accessor process, if any, is restarted from there).

A stream's position counts batches per data worker, as the caller received them: ``{"epoch": E,
"batches": [n_0, ...], "done": [...], "rotation": r, "stream": "workers" | "rebatched", "files": [sizes]}``
(``batches[w]``: batches of worker ``w`` received in epoch E; ``done[w]``: its shard's end was reached). A
stream has no plan to skip in, so the restore re-reads: each worker reads and re-batches its shard from the
start of the epoch and discards its first ``n_w`` batches without collating them (cost: reading and parsing
the consumed part of the shard; memory stays bounded), and the workers' turns are rotated so the batches
come in the interrupted run's order. In ``async-rebatched`` mode the accessor process re-forms batches from
the rows of all workers, so ``batches`` is one count, of re-formed batches: the restore replays the epoch's
rows through the workers (which vectorize them again) and the accessor discards the first ``n`` re-formed
batches without batchifying them. Batches buffered ahead (data workers, the accessor, a dynamic-batching
cache) are never counted: the position is where the caller's consumption is.

Modes (``--dataloader-mode``), with ``--num-workers`` W data worker processes:

``sync``
    batches are produced in the caller's process (W = 0) or by W workers, as torch's DataLoader does.
``async``
    an :class:`~accelbatch.data.accessor.AsyncDataAccessor` process keeps ``buffer_size`` batches ready in
    shared memory while the caller computes. It collates them itself (W = 0) or has W workers do it: a
    :class:`~accelbatch.data.plan_pool.PlanPool` for in-memory data (every batch is planned before a
    worker sees it, so the accessor deals batches to the workers in turn, with less per-batch work than
    torch's DataLoader), torch's DataLoader workers for streams.
``async-rebatched``
    streams: workers emit small chunks of vectorized rows, the accessor process re-forms the batches (with
    the dynamic batching strategy) and batchifies them, so no worker drops a partial tail (PopTorch's
    AsyncRebatched). Map-style data loses nothing in any mode (batches are planned before the workers see
    them), so there it is the same as ``async``.

Static shapes. With ``buckets`` (and with ``static_rows=True`` for the fixed-row strategies) every batch is
padded to its planned shape: every tensor whose dim 0 is the number of real rows gets zero padding rows up
to ``rows``, and the tensors named in ``seq_keys`` (default ``text_vec``) are zero-padded along dim 1 to
``padded_len``. A collate producing a longer sequence than planned is an error naming ``length_fn``.
"""

from __future__ import annotations

import hashlib
import logging
import os
import pickle
import random
from dataclasses import dataclass, fields, replace
from typing import Any, Callable, Iterator, Sequence

import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from accelbatch.data.accessor import AsyncDataAccessor, pickle_batch
from accelbatch.data.batching import (STRATEGIES, Batch, BatchingConfig, BatchStats, BucketShape, MessageLength,
                                      batch_stats, default_max_tokens, plan_buckets)
from accelbatch.data.datasets import ExampleDataset, ShardEnd, StreamDataset, StreamResume, StreamSource
from accelbatch.data.plan_pool import PlanPool, init_data_worker
from accelbatch.data.rebatch import tree_map
from accelbatch.data.stream_position import StreamProgress, read_stream_position
from accelbatch.data.sharding import ShardSpec, even_shards
from accelbatch.messages import Message

__all__ = ["LoaderConfig", "LoadedBatch", "Loader", "AgentCollate", "make_loader", "pad_to_shape", "MODES"]

log = logging.getLogger(__name__)
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
    batch_length_range: int = 5
    buffer_size: int = 3
    drop_last: bool = True
    shuffle: bool = True
    seed: int = 0
    text_truncate: int = 256
    context_length: int = -1
    include_labels: bool = True
    row_multiple: int = 1           # rows of full/buckets batches: multiples of this (e.g. D x R x G)
    static_rows: bool = False       # pad partial fixed-row batches with padding rows to batch_size
    token_count: str = "padded"     # 'full': budget counts rows x longest ('padded') or the sum ('words')
    seq_keys: tuple[str, ...] = ("text_vec",)
    rows_per_chunk: int = 16        # async-rebatched streams: rows per worker message
    bucket_sample: int = 10000      # streams + buckets: examples read up front to plan the shapes
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"--dataloader-mode: {self.mode!r} is not one of {', '.join(MODES)}")
        if self.dynamic_batching not in STRATEGIES:
            raise ValueError(f"--dynamic-batching: {self.dynamic_batching!r} is not one of {', '.join(STRATEGIES)}")
        for name in ("batch_size", "num_buckets", "batch_sort_cache_size", "batch_length_range", "buffer_size",
                     "row_multiple", "rows_per_chunk", "bucket_sample"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if self.num_workers < 0:
            raise ValueError(f"--num-workers: must be 0 or more, got {self.num_workers}")

    @classmethod
    def from_opts(cls, opts: Any, **changes: Any) -> "LoaderConfig":
        names = {"batch_size": "batchsize", "mode": "dataloader_mode", "timeout_s": "data_timeout_s"}
        values = {}
        for f in fields(cls):
            key = names.get(f.name, f.name)
            if key in opts:
                values[f.name] = opts[key]
        values.update(changes)
        return cls(**values)


@dataclass
class LoadedBatch:
    """One batch as the loader delivers it (see the module docstring)."""

    tensors: Any
    messages: list[Message]
    ids: list[Any]
    lengths: list[int]
    rows: int
    padded_len: int
    source: tuple[int, int] | None = None  # (epoch, index in that epoch's plan); map-style only
    origin: tuple[int, int, int] | None = None  # (epoch, data worker, n-th batch of it); streams only

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


def _split(collate: Any) -> tuple[Callable | None, Callable | None]:
    vec, bat = getattr(collate, "vectorize", None), getattr(collate, "batchify", None)
    return (vec, bat) if callable(vec) and callable(bat) else (None, None)


# --------------------------------------------------------------------------------------------------
# static shapes
# --------------------------------------------------------------------------------------------------

def pad_to_shape(tensors: Any, num_real: int, rows: int, padded_len: int | None = None,
                 seq_keys: Sequence[str] = ("text_vec",)) -> Any:
    """Zero-pad a collated batch to ``rows`` rows, and its ``seq_keys`` tensors along dim 1 to ``padded_len``."""
    def pad_rows(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() >= 1 and t.shape[0] == num_real and rows > num_real:
            extra = t.new_zeros((rows - num_real, *t.shape[1:]))
            return torch.cat([t, extra], dim=0)
        return t

    if padded_len is not None and isinstance(tensors, dict):
        tensors = type(tensors)(tensors) if type(tensors) is not dict else dict(tensors)
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


@dataclass(frozen=True)
class _Finisher:
    """Collate a planned Batch into a LoadedBatch (runs wherever the collate runs)."""

    collate: Callable[[list[Message]], Any] | None
    static_len: bool
    seq_keys: tuple[str, ...]

    def tensors(self, rows_in: list[Any], batch: Batch, fn: Callable | None) -> Any:
        if fn is None:
            return None
        out = fn(rows_in)
        if batch.rows > batch.num_real or self.static_len:
            out = pad_to_shape(out, batch.num_real, batch.rows, batch.padded_len if self.static_len else None,
                               self.seq_keys)
        return out

    def __call__(self, batch: Batch, messages: list[Message], ids: list[Any]) -> LoadedBatch:
        return LoadedBatch(self.tensors(messages, batch, self.collate), messages, ids, list(batch.lengths),
                           batch.rows, batch.padded_len)


# --------------------------------------------------------------------------------------------------
# map-style: batches planned by a sampler, collated in the workers
# --------------------------------------------------------------------------------------------------

class _PlanSampler(Sampler):
    """Yields this rank's planned batches (Batch of example indices) for each epoch."""

    def __init__(self, lengths: Sequence[int], config: LoaderConfig, batching: BatchingConfig, training: bool,
                 shard: ShardSpec):
        self.lengths, self.config, self.batching = list(lengths), config, batching
        self.training, self.shard = training, shard.without_workers()
        self.epoch = 0
        self.skip: tuple[int, int] | None = None  # (epoch, K): that epoch's next pass starts at batch K
        self._pass: tuple[int, int] | None = None  # (epoch, first batch) of the pass under way
        self._cache: tuple[int, list[Batch[int]], int] | None = None

    def _rank_plan(self, order: list[int], rank: int, world: int, rng: random.Random | None) -> list[Batch[int]]:
        mine = order[rank::world]
        batcher = self.batching.batcher(rng)
        batches = list(batcher.run((i, self.lengths[i]) for i in mine))
        if self.training and self.config.drop_last and self.batching.strategy in ("none", "batchsort"):
            batches = [b for b in batches if b.num_real == self.batching.batch_size]
        return batches

    def plan(self, epoch: int) -> tuple[list[Batch[int]], int]:
        """(this rank's batches, examples dropped) for ``epoch``."""
        if self._cache is not None and self._cache[0] == epoch:
            return self._cache[1], self._cache[2]
        order = list(range(len(self.lengths)))
        shuffle = self.training and self.config.shuffle
        if shuffle:
            random.Random(hash((self.config.seed, epoch))).shuffle(order)
        world, rank = self.shard.world_size, self.shard.rank

        def rng(r: int) -> random.Random | None:
            return random.Random(hash((self.config.seed, epoch, r))) if shuffle else None

        batches = self._rank_plan(order, rank, world, rng(rank))
        dropped = len(order[rank::world]) - sum(b.num_real for b in batches)
        if self.training and world > 1:  # synchronous replicas need the same number of steps
            counts = [len(self._rank_plan(order, r, world, rng(r))) if r != rank else len(batches)
                      for r in range(world)]
            common, _ = even_shards(counts)
            dropped += sum(b.num_real for b in batches[common:])
            batches = batches[:common]
        self._cache = (epoch, batches, dropped)
        return batches, dropped

    def begin_pass(self) -> None:
        """A new pass (epoch) begins: called once per pass by :class:`_PlanDataLoader` (torch's DataLoader
        may call ``iter(sampler)`` more than once for one pass: twice with workers)."""
        epoch = self.epoch
        self.epoch += 1
        start = self.skip[1] if self.skip is not None and self.skip[0] == epoch else 0
        self.skip = None
        self._pass = (epoch, start)

    def __iter__(self) -> Iterator[tuple[int, int, Batch[int]]]:
        """``(epoch, index, batch)`` for each planned batch of the pass (after a restore's skip)."""
        if self._pass is None:
            self.begin_pass()
        epoch, start = self._pass
        batches, _ = self.plan(epoch)
        return iter([(epoch, i, batches[i]) for i in range(start, len(batches))])

    def __len__(self) -> int:
        return len(self.plan(self.epoch)[0])


def _pack(batch: LoadedBatch) -> bytes:
    """A worker's batch as one pickled payload, tensors by value: for the small tensors of text batches this
    is several times cheaper than torch's default of one shared-memory segment and one passed file
    descriptor per tensor. Tensors travel as raw bytes (pickle_batch), not one torch.save per storage."""
    return pickle_batch(batch)


class _MapDataset(Dataset):
    def __init__(self, examples: ExampleDataset, finisher: _Finisher, pack: bool):
        self.examples, self.finisher, self.pack = examples, finisher, pack

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, planned: tuple[int, int, Batch[int]] | Batch[int]) -> LoadedBatch | bytes:
        source, batch = (planned[:2], planned[2]) if isinstance(planned, tuple) else (None, planned)
        messages = [self.examples[i] for i in batch.items]
        out = self.finisher(batch, messages, list(batch.items))
        out.source = source
        return _pack(out) if self.pack else out


def _identity(x: Any) -> Any:
    return x


class _PlanDataLoader(DataLoader):
    """A DataLoader that starts one pass of its :class:`_PlanSampler` per iteration (wherever it is
    iterated: in the caller or in the accessor process)."""

    def __iter__(self):
        self.sampler.begin_pass()
        return super().__iter__()


class _EpochDataLoader(DataLoader):
    """A DataLoader that tells its stream which epoch begins: in this process, and to data workers when they
    start (they keep their copy across epochs and count its passes from there)."""

    def __iter__(self):
        epoch = self.__dict__.get("_passes", 0)
        self.__dict__["_passes"] = epoch + 1
        self.dataset.epoch = epoch
        return super().__iter__()


# --------------------------------------------------------------------------------------------------
# streams
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _EmitBatch:
    """Stream workers (sync/async): collate each batch (packed for the trip when in a worker)."""

    finisher: _Finisher
    pack: bool

    def __call__(self, batch: Batch, origin: tuple[int, int, int] | None = None) -> LoadedBatch | bytes:
        ids = [item[0] for item in batch.items]
        messages = [item[1] for item in batch.items]
        out = self.finisher(batch, messages, ids)
        out.origin = origin
        return _pack(out) if self.pack else out


@dataclass(frozen=True)
class _EmitRows:
    """Stream workers (async-rebatched): vectorize a chunk of rows and send it as one pickled payload
    (pickled by value: cheaper than sharing many small tensors one by one)."""

    vectorize: Callable[[Message], Any] | None

    def __call__(self, batch: Batch, origin: Any = None) -> bytes:
        rows = []
        for (item_id, msg), length in zip(batch.items, batch.lengths):
            vec = self.vectorize(Message(msg)) if self.vectorize is not None else None
            rows.append((item_id, msg, length, vec))
        return pickle_batch(rows)


@dataclass
class _RebatchRows:
    """In the accessor process: re-form batches from the workers' row chunks, then batchify them.

    One call is one epoch (``epoch`` counts them in the accessor's copy). Each batch is stamped with
    ``origin = (epoch, 0, n)`` and the pass ends with a :class:`ShardEnd`; ``resume`` makes its epoch drop
    the first ``counts[0]`` re-formed batches without batchifying them."""

    batching: BatchingConfig
    finisher: _Finisher
    batchify: Callable[[list[Any]], Any] | None
    drop_partial: bool
    epoch: int = 0
    resume: StreamResume | None = None

    def _batches(self, payloads: Iterator[bytes]) -> Iterator[Batch]:
        batcher = self.batching.batcher()
        for payload in payloads:
            for item_id, msg, length, vec in pickle.loads(payload):
                yield from batcher.push((item_id, msg, vec), length)
        for batch in batcher.finish():
            if not (self.drop_partial and batch.num_real < self.batching.batch_size):
                yield batch

    def __call__(self, payloads: Iterator[bytes]) -> Iterator[LoadedBatch | ShardEnd]:
        epoch = self.epoch
        self.epoch += 1
        resume = self.resume if self.resume is not None and self.resume.epoch == epoch else None
        skip = resume.counts[0] if resume is not None else 0
        count = 0
        for batch in self._batches(payloads):
            if count >= skip:
                out = self._finish(batch)
                out.origin = (epoch, 0, count)
                yield out
            count += 1
        yield ShardEnd(epoch, 0, count)

    def _finish(self, batch: Batch) -> LoadedBatch:
        ids = [it[0] for it in batch.items]
        messages = [it[1] for it in batch.items]
        if self.batchify is not None:
            tensors = self.finisher.tensors([it[2] for it in batch.items], batch, self.batchify)
        else:
            tensors = self.finisher.tensors(messages, batch, self.finisher.collate)
        return LoadedBatch(tensors, messages, ids, list(batch.lengths), batch.rows, batch.padded_len)


@dataclass(frozen=True)
class _FullOnly:
    """Keep only full batches: each stream worker's partial last batch is dropped (``none``, training,
    drop_last; plain torch semantics: up to batch_size - 1 rows per worker lost; async-rebatched keeps them)."""

    batch_size: int

    def __call__(self, batch: Batch) -> bool:
        return batch.num_real == self.batch_size


def _unpack(item: Any) -> Any:
    return pickle.loads(item) if isinstance(item, bytes) else item


def _unpack_all(items: Iterator[Any]) -> Iterator[Any]:
    try:
        for item in items:
            yield _unpack(item)
    finally:  # an early stop reaches the source (the accessor resets its pass)
        close = getattr(items, "close", None)
        if close is not None:
            close()


# --------------------------------------------------------------------------------------------------
# the loader
# --------------------------------------------------------------------------------------------------

class Loader:
    """Re-iterable source of :class:`LoadedBatch` (see the module docstring); build with :func:`make_loader`."""

    def __init__(self, dataloader: DataLoader | PlanPool, config: LoaderConfig, *, sampler: _PlanSampler | None,
                 transform: Callable | None, shapes: Sequence[BucketShape] | None, streaming: bool):
        self.config, self.sampler = config, sampler
        self.shapes = list(shapes) if shapes else None
        self.streaming = streaming
        self.epoch = 0
        self._consumed = (0, 0)  # (epoch, batches of it) the caller has received
        self._stream = StreamProgress.start(0, self._stream_workers()) if streaming else None
        self._digests: dict[int, str] = {}
        self._dataloader = dataloader
        self._accessor: AsyncDataAccessor | None = None
        # data workers send each batch as one pickled payload (tensors as raw bytes); with the accessor in
        # between it relays the payload untouched and this process unpacks it (one unpickle, not three)
        self._packed = config.num_workers > 0 and transform is None
        self._transform = transform
        if config.mode != "sync":
            self._start_accessor()

    def _start_accessor(self) -> None:
        self._accessor = AsyncDataAccessor(self._dataloader, buffer_size=self.config.buffer_size,
                                           early_preload=True, load_indefinitely=True,
                                           timeout_s=self.config.timeout_s, transform=self._transform)

    @property
    def mode(self) -> str:
        return self.config.mode

    @property
    def dropped(self) -> int:
        """Examples this rank drops in the coming epoch (map-style training; 0 in evaluation)."""
        return self.sampler.plan(self.epoch)[1] if self.sampler is not None else 0

    def plan_stats(self) -> BatchStats:
        """Batches, tokens, padding and shapes of the coming epoch (map-style)."""
        if self.sampler is None:
            raise TypeError("plan_stats: a streamed dataset has no plan before it is read")
        return batch_stats(self.sampler.plan(self.epoch)[0])

    def __len__(self) -> int:
        if self.sampler is None:
            raise TypeError("len(loader): a streamed dataset's number of batches is unknown before reading it")
        return len(self.sampler.plan(self.epoch)[0])

    def __iter__(self) -> Iterator[LoadedBatch]:
        if self._dataloader is None:
            raise RuntimeError("this loader was closed; make a new one with make_loader()")
        epoch = self.epoch
        self.epoch += 1
        if self.sampler is not None and epoch == 0:
            _, dropped = self.sampler.plan(epoch)
            if dropped:
                log.info("data: %d examples left out of each epoch (partial batch with --drop-last, or "
                         "replicas cut to the same number of batches)", dropped)
        it = iter(self._accessor) if self._accessor is not None else iter(self._dataloader)
        if self._packed:
            it = _unpack_all(it)
        return self._track(it) if self._stream is None else self._track_stream(it)

    def _track(self, it: Iterator[LoadedBatch]) -> Iterator[LoadedBatch]:
        """Record each batch's plan position as it is handed to the caller (what the caller consumed)."""
        try:
            for batch in it:
                if batch.source is not None:
                    self._consumed = (int(batch.source[0]), int(batch.source[1]) + 1)
                yield batch
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _track_stream(self, it: Iterator[Any]) -> Iterator[LoadedBatch]:
        """Count each stream batch as it is handed to the caller; take the workers' ShardEnd marks out."""
        try:
            for item in it:
                if isinstance(item, ShardEnd):
                    self._stream.ended(item)
                    continue
                if item.origin is not None:
                    self._stream.received(item.origin)
                yield item
        finally:
            close = getattr(it, "close", None)
            if close is not None:
                close()

    def _stream_workers(self) -> int:
        """How many counts a stream position holds: one per data worker, or one for the re-formed batches."""
        return 1 if self.config.mode == "async-rebatched" else max(1, self.config.num_workers)

    def _stream_kind(self) -> str:
        return "rebatched" if self.config.mode == "async-rebatched" else "workers"

    def _stream_files(self) -> list[int]:
        return [os.path.getsize(p) for p in self._dataloader.dataset.source.paths]

    # data position -------------------------------------------------------------------------------
    def _plan_digest(self, epoch: int) -> str:
        if epoch not in self._digests:
            batches = self.sampler.plan(epoch)[0]
            text = ";".join(",".join(map(str, b.items)) for b in batches)
            self._digests = {epoch: hashlib.sha256(text.encode("ascii")).hexdigest()[:16]}
        return self._digests[epoch]

    def position(self) -> dict[str, Any]:
        """The data position as the caller consumed it: ``{"epoch", "batches", "plan_sha256"}`` (JSON).

        ``batches`` is how many batches of ``epoch``'s plan the caller has received; an epoch received in
        full is reported as the next epoch at batch 0. A stream's position: see the module docstring.
        """
        if self._stream is not None:
            return {**self._stream.position(), "stream": self._stream_kind(), "files": self._stream_files()}
        epoch, done = self._consumed
        if done >= len(self.sampler.plan(epoch)[0]):
            epoch, done = epoch + 1, 0
        return {"epoch": epoch, "batches": done, "plan_sha256": self._plan_digest(epoch)}

    def restore(self, position: dict[str, Any]) -> None:
        """Make the next pass continue from :meth:`position` (same data and options; before iterating on).

        The epoch's plan is rebuilt from (seed, epoch) and its first ``batches`` batches are skipped
        without being read or collated; a running accessor process is restarted from there. Raises
        ValueError when the position does not fit this loader's data and options.
        """
        if self._dataloader is None:
            raise RuntimeError("this loader was closed; make a new one with make_loader()")
        if self._stream is not None:
            return self._restore_stream(position)
        if "plan_sha256" not in position and "stream" in position:
            raise ValueError("data position: the checkpoint was taken reading the data as a stream "
                             "(-dt ...:stream), this run reads it into memory; resume with the same -dt")
        try:
            epoch, done, digest = int(position["epoch"]), int(position["batches"]), str(position["plan_sha256"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"data position: {position!r} is not a loader position") from None
        planned = len(self.sampler.plan(epoch)[0]) if epoch >= 0 else -1
        if epoch < 0 or not 0 <= done <= planned:
            raise ValueError(f"data position: batch {done} of epoch {epoch} does not exist in this loader's "
                             f"plan ({planned} batches); resume with the same data and options")
        if self._plan_digest(epoch) != digest:
            raise ValueError(f"data position: epoch {epoch}'s batch plan differs from the checkpointed run's "
                             "(other data, --seed, --batchsize, --dynamic-batching or its options, or "
                             "replicas); resume with the same ones, or start afresh without --resume")
        if done >= planned:
            epoch, done = epoch + 1, 0
        self.sampler.epoch = epoch
        self.sampler.skip = (epoch, done) if done else None
        self.epoch = epoch
        self._consumed = (epoch, done)
        if self._accessor is not None:  # it has loaded ahead from the old position: start it afresh
            self._accessor.terminate()
            self._start_accessor()

    def _restore_stream(self, position: dict[str, Any]) -> None:
        """:meth:`restore` for a stream: each worker skips what was consumed (see the module docstring)."""
        resume = read_stream_position(position, self._stream_kind(), self._stream_workers(), self._stream_files())
        if all(resume.done):
            resume = StreamResume(resume.epoch + 1, (0,) * len(resume.counts), (False,) * len(resume.done))
        if self.config.mode == "async-rebatched":
            self._transform.epoch, self._transform.resume = resume.epoch, resume
        else:
            self._dataloader.dataset.resume = resume
            self._dataloader.__dict__["_passes"] = resume.epoch
            self._stop_workers()  # persistent workers hold copies of the stream from before the restore
        self.epoch = resume.epoch
        self._stream = StreamProgress(resume.epoch, list(resume.counts), list(resume.done),
                                       (resume.rotation - 1) % len(resume.counts))
        if self._accessor is not None:  # it has loaded ahead from the old position: start it afresh
            self._accessor.terminate()
            self._start_accessor()

    def _stop_workers(self) -> None:
        """Shut down the data workers this process's DataLoader keeps across epochs (sync mode); the next
        pass starts new ones with the current dataset."""
        it = getattr(self._dataloader, "_iterator", None)  # torch keeps persistent workers' iterator there
        if it is not None:
            it._shutdown_workers()
            self._dataloader._iterator = None

    def close(self) -> None:
        if self._accessor is not None:
            self._accessor.terminate()
            self._accessor = None
        self._dataloader = None

    def __enter__(self) -> "Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _as_dataset(data: Any, config: LoaderConfig, length_fn: Callable) -> ExampleDataset | StreamSource:
    if isinstance(data, (ExampleDataset, StreamSource)):
        return data
    if isinstance(data, (str, os.PathLike)):
        return StreamSource(data, context_length=config.context_length, include_labels=config.include_labels)
    data = list(data)
    if data and all(isinstance(x, (str, os.PathLike)) for x in data):
        return StreamSource(data, context_length=config.context_length, include_labels=config.include_labels)
    if data and isinstance(data[0], (list, tuple)):
        return ExampleDataset.from_episodes(data, config.context_length, config.include_labels, length_fn)
    return ExampleDataset([Message(m) for m in data], length_fn)


def make_loader(data: Any, config: LoaderConfig | Any | None = None, *, collate: Callable | None = None,
                training: bool = True, shard: ShardSpec | None = None,
                length_fn: Callable[[Message], int] | None = None, **changes: Any) -> Loader:
    """Build the loader for ``data`` (see the module docstring for every argument and what it yields)."""
    if config is None:
        config = LoaderConfig(**changes)
    elif isinstance(config, LoaderConfig):
        config = replace(config, **changes) if changes else config
    else:
        config = LoaderConfig.from_opts(config, **changes)
    shard = (shard or ShardSpec()).without_workers()
    explicit_length = length_fn
    length_fn = length_fn or MessageLength(config.text_truncate)
    dataset = _as_dataset(data, config, length_fn)
    if isinstance(dataset, ExampleDataset) and explicit_length is not None and dataset.length_fn is not explicit_length:
        dataset = ExampleDataset(dataset.examples, explicit_length)
    strategy = config.dynamic_batching
    static_len = strategy == "buckets"
    finisher = _Finisher(collate, static_len, tuple(config.seq_keys))
    pad_rows = config.static_rows
    workers = config.num_workers
    # data workers stay up across epochs: no fork and cold prefetch queue at every epoch boundary, and no
    # fork of a process that has started threads by then (the accessor shares its ring through a thread:
    # a worker forked while it held an import lock would hang). Map-style: the plan is made where the
    # DataLoader is iterated. Streams: each worker's copy counts its passes (StreamDataset.epoch), starting
    # from the epoch set when the workers start; torch starts every worker's pass, so the counts agree
    loader_kwargs: dict[str, Any] = dict(batch_size=None, num_workers=workers, collate_fn=_identity,
                                         persistent_workers=workers > 0,
                                         worker_init_fn=init_data_worker if workers > 0 else None)
    if workers > 0:
        loader_kwargs["timeout"] = config.timeout_s

    if isinstance(dataset, ExampleDataset):
        if len(dataset) == 0:
            raise ValueError("make_loader: the dataset holds no examples")
        lengths = dataset.lengths
        batching = _batching(config, lengths, pad_rows, streaming=False)
        sampler = _PlanSampler(lengths, config, batching, training, shard)
        mapped = _MapDataset(dataset, finisher, pack=workers > 0)
        if workers > 0 and config.mode != "sync":  # the accessor's own worker pool (see plan_pool)
            dataloader: DataLoader | PlanPool = PlanPool(mapped, sampler, workers, timeout_s=config.timeout_s)
        else:
            dataloader = _PlanDataLoader(mapped, sampler=sampler, **loader_kwargs)
        return Loader(dataloader, config, sampler=sampler, transform=None, shapes=batching.shapes, streaming=False)

    # streams
    lengths_sample = None
    if strategy in ("buckets", "full") and (strategy == "buckets" or config.max_batch_tokens < 1):
        lengths_sample = dataset.sample_lengths(config.bucket_sample, length_fn)
        if not lengths_sample:
            raise ValueError(f"make_loader: {', '.join(dataset.paths)} holds no examples")
    batching = _batching(config, lengths_sample or [], pad_rows, streaming=True)
    drop_partial = training and config.drop_last and strategy == "none"
    seed = config.seed if training and config.shuffle else None
    if config.mode == "async-rebatched":
        vectorize, batchify = _split(collate)
        rows = StreamDataset(dataset, BatchingConfig("none", config.rows_per_chunk), length_fn, shard,
                             emit=_EmitRows(vectorize))
        dataloader = DataLoader(rows, **loader_kwargs)
        transform = _RebatchRows(batching, finisher, batchify, drop_partial)
        return Loader(dataloader, config, sampler=None, transform=transform, shapes=batching.shapes,
                      streaming=True)
    stream = StreamDataset(dataset, batching, length_fn, shard, emit=_EmitBatch(finisher, pack=workers > 0),
                           seed=seed, keep=_FullOnly(config.batch_size) if drop_partial else None,
                           positions=True)
    dataloader = _EpochDataLoader(stream, **loader_kwargs)
    return Loader(dataloader, config, sampler=None, transform=None, shapes=batching.shapes, streaming=True)


def _batching(config: LoaderConfig, lengths: Sequence[int], pad_rows: bool, streaming: bool) -> BatchingConfig:
    strategy, bs = config.dynamic_batching, config.batch_size
    max_tokens = config.max_batch_tokens
    shapes = None
    if strategy in ("full", "buckets") and max_tokens < 1 and strategy == "full":
        max_tokens = default_max_tokens(bs, lengths)
    if strategy == "buckets":
        budget = max_tokens if max_tokens > 0 else None
        cap = config.text_truncate if streaming and config.text_truncate > 0 else None
        if cap is not None and lengths and max(lengths) > cap:
            cap = None
        shapes = tuple(plan_buckets(lengths, config.num_buckets, bs, budget, config.row_multiple, max_len=cap))
    return BatchingConfig(strategy, bs, max_tokens=max_tokens, cache_size=config.batch_sort_cache_size,
                          length_range=config.batch_length_range if streaming and strategy == "batchsort" else None,
                          count=config.token_count, row_multiple=config.row_multiple, pad_rows=pad_rows,
                          shapes=shapes)
