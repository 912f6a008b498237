"""Datasets: examples in memory (map-style) and examples streamed lazily from JSONL / ParlAI files.

:class:`ExampleDataset`
    squashed single-turn examples in memory; ``dataset[i]`` is a Message, ``dataset.lengths`` their lengths.
:class:`StreamSource`
    files read line by line, never whole: memory stays flat in the file size. Episodes are squashed as they
    are read. Reading can be split into shards by byte range (:func:`read_episodes`): shard ``k`` of ``n``
    owns every episode whose first line starts inside its ``k``-th byte range, so each shard reads about
    ``1/n`` of every file and together they read each episode exactly once.
:class:`StreamDataset`
    a torch ``IterableDataset`` over a StreamSource: in each data worker it reads the worker's shard, batches
    on the fly through a bounded cache (:class:`~accelbatch.data.batching.BatchingConfig`; ParlAI's streaming
    batchsort groups lengths within ``--batch-length-range``) and yields ``emit(batch)`` for every batch, where
    a batch's items are ``(example_id, Message)`` pairs and ``example_id`` is ``(file index, line number)``.

Data position (resume). With ``positions=True`` a StreamDataset calls ``emit(batch, origin)`` with
``origin = (epoch, worker, n)`` (the ``n``-th batch this worker emits in ``epoch``) and ends every worker's
pass with a :class:`ShardEnd`. Its ``resume`` (a :class:`StreamResume`) makes one epoch continue where a
run stopped: each worker re-reads its shard and re-batches it, discarding its first ``n`` batches without
emitting them (no collate or vectorize: the cost is reading and parsing the consumed part of the shard),
and the workers' turns are rotated so torch's round-robin over them serves batches in the same order as
the interrupted run.
"""

from __future__ import annotations

import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

from torch.utils.data import Dataset, IterableDataset

from accelbatch.data.batching import Batch, BatchingConfig, MessageLength
from accelbatch.data.sharding import ShardSpec, byte_ranges
from accelbatch.data.squash import check_context_length, squash_episode
from accelbatch.messages import EPISODE_DONE, Message
from accelbatch.tasks.files import DataFileError, file_format, parse_jsonl_line, parse_parlai_line

ExampleId = tuple[int, int]
_BLOCK = 1 << 16


# --------------------------------------------------------------------------------------------------
# map-style
# --------------------------------------------------------------------------------------------------

class ExampleDataset(Dataset):
    """Single-turn examples in memory (already squashed), with their lengths for dynamic batching."""

    def __init__(self, examples: Sequence[Message], length_fn: Callable[[Message], int] | None = None):
        self.examples = list(examples)
        self.length_fn = length_fn or MessageLength()
        self._lengths: list[int] | None = None

    @classmethod
    def from_episodes(cls, episodes: Iterable[Sequence[Message]], context_length: int = -1,
                      include_labels: bool = True,
                      length_fn: Callable[[Message], int] | None = None) -> "ExampleDataset":
        examples = [ex for ep in episodes for ex in squash_episode(ep, context_length, include_labels)]
        return cls(examples, length_fn)

    @classmethod
    def from_files(cls, paths: str | Sequence[str], context_length: int = -1, include_labels: bool = True,
                   length_fn: Callable[[Message], int] | None = None, fmt: str | None = None) -> "ExampleDataset":
        source = StreamSource(paths, fmt=fmt, context_length=context_length, include_labels=include_labels)
        return cls([msg for _, msg in source.examples()], length_fn)

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> Message:
        return self.examples[index]

    @property
    def lengths(self) -> list[int]:
        if self._lengths is None:
            self._lengths = [int(self.length_fn(m)) for m in self.examples]
        return self._lengths


# --------------------------------------------------------------------------------------------------
# reading files by byte range
# --------------------------------------------------------------------------------------------------

def _is_example(line: bytes, fmt: str) -> bool:
    stripped = line.strip()
    return bool(stripped) and not (fmt == "parlai" and stripped.startswith(b"#"))


def _parse(raw: bytes, path: str, lineno: int, fmt: str) -> Message:
    if raw.endswith(b"\r\n"):
        raw = raw[:-2] + b"\n"
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                            "save the file as UTF-8") from None
    return (parse_jsonl_line if fmt == "jsonl" else parse_parlai_line)(line, path, lineno)


def _count_newlines(handle, stop: int) -> int:
    handle.seek(0)
    count, left = 0, stop
    while left > 0:
        chunk = handle.read(min(left, 1 << 20))
        if not chunk:
            break
        count += chunk.count(b"\n")
        left -= len(chunk)
    return count


def _previous_example_line(handle, pos: int, fmt: str) -> tuple[bytes, int] | None:
    """The last example line before ``pos`` (a line start > 0) and how many other lines lie between it and
    ``pos``; None when there is none. Reads backwards in blocks: memory is bounded by the longest line."""
    cursor, tail, between, first = pos, b"", 0, True
    while cursor > 0:
        new_cursor = max(0, cursor - _BLOCK)
        handle.seek(new_cursor)
        data = handle.read(cursor - new_cursor)
        if first:
            data, first = data[:-1], False  # drop the newline that ends the line before pos
        data += tail
        cursor = new_cursor
        parts = data.split(b"\n")
        tail, complete = (parts[0], parts[1:]) if cursor > 0 else (b"", parts)
        for part in reversed(complete):
            if _is_example(part, fmt):
                return part, between
            between += 1
    return None


def read_episodes(path: str, fmt: str | None = None, start: int = 0,
                  stop: int | None = None) -> Iterator[tuple[int, list[Message]]]:
    """Yield ``(first line number, episode)`` for every episode whose first line starts in [start, stop).

    An episode that starts in the range is read to its end, past ``stop`` if need be. With the whole file as
    the range this is :func:`accelbatch.tasks.files.iter_episodes` with line numbers; an unfinished last
    episode is closed, not dropped. Errors name the file and line.
    """
    fmt = fmt or file_format(path)
    if not os.path.exists(path):
        raise DataFileError(f"{path}: no such file; check the path given to -t")
    size = os.path.getsize(path)
    stop = size if stop is None else min(stop, size)
    if start >= stop:
        return
    with open(path, "rb") as handle:
        pos, lineno, inside_foreign_episode = 0, 1, False
        if start > 0:
            handle.seek(start - 1)
            pos = start if handle.read(1) == b"\n" else start + len(handle.readline())
            if pos >= stop:
                return
            lineno = _count_newlines(handle, pos) + 1
            prev = _previous_example_line(handle, pos, fmt)
            if prev is not None:  # an episode left open before pos belongs to an earlier range
                prev_line, between = prev
                inside_foreign_episode = not _parse(prev_line, path, lineno - 1 - between, fmt)[EPISODE_DONE]
            handle.seek(pos)
        episode: list[Message] = []
        first_line = 0
        for raw in handle:
            line_start, current = pos, lineno
            pos, lineno = pos + len(raw), lineno + 1
            if not _is_example(raw, fmt):
                continue
            msg = _parse(raw, path, current, fmt)
            if inside_foreign_episode:
                inside_foreign_episode = not msg[EPISODE_DONE]
                continue
            if not episode:
                if line_start >= stop:
                    return
                first_line = current
            episode.append(msg)
            if msg[EPISODE_DONE]:
                yield first_line, episode
                episode = []
        if episode:
            episode[-1][EPISODE_DONE] = True
            yield first_line, episode


# --------------------------------------------------------------------------------------------------
# streaming
# --------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class StreamSource:
    """JSONL / ParlAI-format files read lazily, squashed on the fly (picklable: it travels to workers)."""

    paths: tuple[str, ...]
    fmt: str | None = None
    context_length: int = -1
    include_labels: bool = True

    def __init__(self, paths: str | Sequence[str], fmt: str | None = None, context_length: int = -1,
                 include_labels: bool = True):
        paths = (paths,) if isinstance(paths, (str, os.PathLike)) else tuple(paths)
        if not paths:
            raise ValueError("StreamSource: no files given")
        check_context_length(context_length)
        object.__setattr__(self, "paths", tuple(os.fspath(p) for p in paths))
        object.__setattr__(self, "fmt", fmt)
        object.__setattr__(self, "context_length", context_length)
        object.__setattr__(self, "include_labels", include_labels)
        for p in self.paths:
            if not os.path.exists(p):
                raise DataFileError(f"{p}: no such file; check the path given to -t")

    def episodes(self, num_shards: int = 1, index: int = 0) -> Iterator[tuple[ExampleId, list[Message]]]:
        """((file index, first line), episode) for this shard's episodes of every file, in file order."""
        for file_index, path in enumerate(self.paths):
            start, stop = byte_ranges(os.path.getsize(path), num_shards)[index]
            for line, episode in read_episodes(path, self.fmt, start, stop):
                yield (file_index, line), episode

    def examples(self, num_shards: int = 1, index: int = 0) -> Iterator[tuple[ExampleId, Message]]:
        """((file index, line), squashed example) for this shard, lazily."""
        for (file_index, line), episode in self.episodes(num_shards, index):
            squashed = squash_episode(episode, self.context_length, self.include_labels)
            for offset, msg in enumerate(squashed):
                yield (file_index, line + offset), msg

    def sample_lengths(self, count: int, length_fn: Callable[[Message], int]) -> list[int]:
        """Lengths of the first ``count`` examples (to plan bucket shapes before streaming)."""
        out = []
        for _, msg in self.examples():
            out.append(int(length_fn(msg)))
            if len(out) >= count:
                break
        return out


def _identity(batch: Any, origin: Any = None) -> Any:
    return batch


@dataclass(frozen=True)
class ShardEnd:
    """Yielded after a worker's last batch of an epoch (``positions=True``): ``count`` batches emitted."""

    epoch: int
    worker: int
    count: int


@dataclass(frozen=True)
class StreamResume:
    """Where a stream's ``epoch`` continues: ``counts[w]`` batches of logical worker ``w`` already consumed,
    ``done[w]`` when its :class:`ShardEnd` was; ``rotation``: torch worker ``j`` plays logical worker
    ``(j + rotation) % len(counts)``, so the round-robin goes on with the worker after the last one served."""

    epoch: int
    counts: tuple[int, ...]
    done: tuple[bool, ...]
    rotation: int = 0

    def worker(self, torch_worker: int) -> int:
        return (torch_worker + self.rotation) % len(self.counts)


@dataclass
class StreamDataset(IterableDataset):
    """Batches streamed from disk; each data worker reads its own shard (see the module docstring).

    ``emit`` turns each :class:`~accelbatch.data.batching.Batch` of ``(example_id, Message)`` items into what
    the dataset yields (e.g. collated tensors); by default the Batch itself. ``keep`` (optional) decides which
    batches are emitted at all. ``shard`` names the process and replica; the worker is taken from torch's
    worker info when iterated. ``seed`` (training) shuffles the order of the batches a cache emits, varying
    with ``epoch``. ``positions`` and ``resume``: see the module docstring.
    """

    source: StreamSource
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    length_fn: Callable[[Message], int] = field(default_factory=MessageLength)
    shard: ShardSpec = field(default_factory=ShardSpec)
    emit: Callable[..., Any] = _identity
    seed: int | None = None
    keep: Callable[[Batch], bool] | None = None
    epoch: int = 0
    positions: bool = False
    resume: StreamResume | None = None

    def __post_init__(self) -> None:
        super().__init__()

    def _spec(self, epoch: int) -> tuple[ShardSpec, StreamResume | None]:
        """This worker's shard, and the resume that applies to this pass (None: start at the beginning)."""
        spec = self.shard.in_worker()
        resume = self.resume if self.resume is not None and self.resume.epoch == epoch else None
        if resume is None:
            return spec, None
        if len(resume.counts) != spec.num_workers:
            raise ValueError(f"data position: the stream was read by {len(resume.counts)} data workers, this "
                             f"run has {spec.num_workers}; resume with the same --num-workers")
        return spec.with_workers(spec.num_workers, resume.worker(spec.worker_id)), resume

    def _batches(self, spec: ShardSpec, rng: random.Random | None) -> Iterator[Batch]:
        """The shard's batches that are kept, in order (not emitted)."""
        batcher = self.batching.batcher(rng)
        keep = self.keep
        for item_id, msg in self.source.examples(spec.num_shards, spec.index):
            for batch in batcher.push((item_id, msg), int(self.length_fn(msg))):
                if keep is None or keep(batch):
                    yield batch
        for batch in batcher.finish():
            if keep is None or keep(batch):
                yield batch

    def __iter__(self) -> Iterator[Any]:
        epoch = self.epoch
        self.epoch += 1  # data workers iterate copies: set before they start, each then counts its passes
        spec, resume = self._spec(epoch)
        worker = spec.worker_id
        if resume is not None and resume.done[worker]:
            return  # this worker's part of the epoch was consumed to its end
        skip = resume.counts[worker] if resume is not None else 0
        rng = None if self.seed is None else random.Random(hash((self.seed, epoch, spec.index)))
        count = 0
        for batch in self._batches(spec, rng):
            if count >= skip:
                yield self.emit(batch, (epoch, worker, count)) if self.positions else self.emit(batch)
            count += 1
        if self.positions:
            yield ShardEnd(epoch, worker, count)
