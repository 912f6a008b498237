"""Dynamic batching: which examples share a batch, and the padded shape of each batch.

Four strategies (``--dynamic-batching``), all working on a stream of ``(item, length)`` pairs through a
bounded cache, so they serve map-style and streaming datasets alike:

``none``
    fixed ``batch_size`` rows in arrival order.
``batchsort``
    fixed ``batch_size`` rows; inside a cache of ``cache_size`` examples the examples are sorted by length, so
    similar lengths share a batch (:class:`SortBatcher`).
``full``
    a token budget (:class:`TokenBatcher`): the row count varies so that ``rows x longest`` (the padded
    rectangle a device really computes, ``count="padded"``, the default) or the sum of the lengths
    (``count="words"``, the counting of ParlAI's worked example) stays within ``max_tokens``. Examples are
    sorted longest first inside the cache and batches are filled greedily. The default budget is ParlAI's,
    ``(text_truncate + label_truncate) x batch_size`` (:func:`default_max_tokens`).
``buckets``
    a few static shapes ``(rows, padded_len)`` planned from the data (:func:`plan_buckets`) for graph
    compilers (IPU, CUDA graphs): every batch has one of at most ``num_buckets`` shapes; an example goes to the
    shortest bucket that holds it and still takes examples this epoch (each takes whole batches, the few left
    over spill to the next longer bucket); the longest bucket's last, partial batch is completed with padding
    rows so no new shape appears. Bucket lengths are chosen by dynamic programming to minimise the padding over the
    length distribution (the least padding any ``num_buckets`` lengths allow: rows do not change the pad
    fraction). Rows vary with the length under the token budget (at most ``max_tokens // padded_len``), so
    short examples share big batches and long ones small ones, evened out over a bucket's batches.

Every strategy emits every pushed item exactly once (nothing is dropped here: dropping a partial training
batch is the loader's decision). ``pad fraction`` = pad tokens / all tokens of the padded batches, padding
rows included (:func:`batch_stats`).

``row_multiple`` (full and buckets) keeps row counts multiples of a number, e.g. D x R x G of an execution
plan, whose combined batch must divide evenly.
"""

from __future__ import annotations

import bisect
import random
from dataclasses import dataclass
from typing import Any, Generic, Iterable, Iterator, Sequence, TypeVar

import numpy as np

from accelbatch.data.buckets import BucketShape, check_positive, plan_buckets
from accelbatch.dictionary import tokenize

T = TypeVar("T")
STRATEGIES = ("none", "batchsort", "full", "buckets")


@dataclass(frozen=True)
class Batch(Generic[T]):
    """Items that share a batch and the shape they are padded to.

    ``rows`` may exceed ``len(items)``: the extra rows are padding rows (at the end of the batch).
    """

    items: tuple[T, ...]
    lengths: tuple[int, ...]
    rows: int
    padded_len: int

    @property
    def num_real(self) -> int:
        return len(self.items)

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.padded_len)

    @property
    def real_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def padded_tokens(self) -> int:
        return self.rows * self.padded_len

    @property
    def pad_tokens(self) -> int:
        return self.padded_tokens - self.real_tokens


def make_batch(items: Sequence[T], lengths: Sequence[int], rows: int | None = None,
               padded_len: int | None = None) -> Batch[T]:
    lengths = tuple(int(n) for n in lengths)
    return Batch(tuple(items), lengths, len(items) if rows is None else rows,
                 (max(lengths) if lengths else 0) if padded_len is None else padded_len)


@dataclass(frozen=True)
class BatchStats:
    batches: int
    examples: int
    real_tokens: int
    padded_tokens: int
    shapes: frozenset[tuple[int, int]]

    @property
    def pad_tokens(self) -> int:
        return self.padded_tokens - self.real_tokens

    @property
    def pad_fraction(self) -> float:
        """Pad tokens / all tokens (0 when there are no tokens)."""
        return self.pad_tokens / self.padded_tokens if self.padded_tokens else 0.0


def batch_stats(batches: Iterable[Batch[Any]]) -> BatchStats:
    n = ex = real = padded = 0
    shapes = set()
    for b in batches:
        n += 1
        ex += b.num_real
        real += b.real_tokens
        padded += b.padded_tokens
        shapes.add(b.shape)
    return BatchStats(n, ex, real, padded, frozenset(shapes))


def word_count(text: str | None) -> int:
    """ParlAI-style length of a text: its whitespace-separated words."""
    return len(text.split()) if text else 0


class MessageLength:
    """Picklable length function for Messages, the default of an agent without ``example_length``: tokens of
    the history (``full_text``, else ``text``), clipped at ``truncate`` when > 0. An agent may split on
    whitespace or with :func:`~accelbatch.dictionary.tokenize` (which also splits ``don't`` and drops a lone
    ``,``), so this counts the larger of the two: a static shape planned from it holds either."""

    def __init__(self, truncate: int = -1):
        self.truncate = truncate

    def __call__(self, msg: Any) -> int:
        text = msg.get("full_text", msg.get("text")) if isinstance(msg, dict) else msg
        n = max(word_count(text), len(tokenize(text))) if text else 0
        return min(n, self.truncate) if self.truncate and self.truncate > 0 else n


# --- streaming batchers: push(item, length) -> ready batches; finish() -> the rest -----------------------

class Batcher(Generic[T]):
    """Base of the strategies. ``push`` returns batches that are ready; ``finish`` returns all the rest."""

    def push(self, item: T, length: int) -> list[Batch[T]]:
        raise NotImplementedError

    def finish(self) -> list[Batch[T]]:
        raise NotImplementedError

    def run(self, pairs: Iterable[tuple[T, int]]) -> Iterator[Batch[T]]:
        """Batch a whole stream of (item, length) pairs lazily."""
        for item, length in pairs:
            yield from self.push(item, length)
        yield from self.finish()


def _cut(pairs: Sequence[tuple[T, int]], size: int, pad_rows: bool) -> list[Batch[T]]:
    out = []
    for start in range(0, len(pairs), size):
        chunk = pairs[start:start + size]
        out.append(make_batch([p[0] for p in chunk], [p[1] for p in chunk],
                              rows=size if pad_rows else None))
    return out


class FixedBatcher(Batcher[T]):
    """``none``: ``batch_size`` rows in arrival order; the tail is partial (or padded with ``pad_rows``)."""

    def __init__(self, batch_size: int, pad_rows: bool = False):
        check_positive("batch_size", batch_size)
        self.batch_size, self.pad_rows = batch_size, pad_rows
        self._pending: list[tuple[T, int]] = []

    def push(self, item: T, length: int) -> list[Batch[T]]:
        self._pending.append((item, length))
        return self.finish() if len(self._pending) == self.batch_size else []

    def finish(self) -> list[Batch[T]]:
        out = _cut(self._pending, self.batch_size, self.pad_rows)
        self._pending = []
        return out


class SortBatcher(Batcher[T]):
    """``batchsort``: fixed rows, examples sorted by length inside a cache of ``cache_size`` examples.

    When the cache fills, its examples are sorted and cut into full batches (emitted in random order when
    ``rng`` is given, so training does not see lengths rising); the few left over stay for the next fill.
    """

    def __init__(self, batch_size: int, cache_size: int = 1000, rng: random.Random | None = None,
                 pad_rows: bool = False):
        check_positive("batch_size", batch_size)
        check_positive("batch_sort_cache_size", cache_size)
        self.batch_size, self.pad_rows, self.rng = batch_size, pad_rows, rng
        self.cache_size = max(cache_size, batch_size)
        self._cache: list[tuple[T, int]] = []

    def push(self, item: T, length: int) -> list[Batch[T]]:
        self._cache.append((item, length))
        if len(self._cache) < self.cache_size:
            return []
        return self._emit(len(self._cache) // self.batch_size * self.batch_size, False)

    def finish(self) -> list[Batch[T]]:
        return self._emit(len(self._cache), self.pad_rows)

    def _emit(self, count: int, pad_rows: bool) -> list[Batch[T]]:
        """The ``count`` shortest cached examples cut into batches (shuffled with ``rng``); the rest stay."""
        self._cache.sort(key=lambda p: p[1])
        out = _cut(self._cache[:count], self.batch_size, pad_rows)
        self._cache = self._cache[count:]
        if self.rng is not None:
            self.rng.shuffle(out)
        return out


class TokenBatcher(Batcher[T]):
    """``full``: rows vary so each batch stays within a token budget.

    ``count="padded"``: rows x longest <= max_tokens (the padded rectangle; what memory and compute see).
    ``count="words"``: the sum of the lengths <= max_tokens (ParlAI's documented counting).
    Inside a cache of ``cache_size`` examples the examples are sorted longest first and batches filled
    greedily (:func:`token_cache_size` sizes the cache to the budget); the last, underfull batch of a fill waits
    for the next one. An example longer than the whole
    budget gets a batch of its own (``row_multiple`` rows at least). ``max_rows`` caps the row count.
    """

    def __init__(self, max_tokens: int, cache_size: int = 1000, count: str = "padded",
                 max_rows: int | None = None, row_multiple: int = 1, rng: random.Random | None = None):
        check_positive("max_batch_tokens", max_tokens)
        check_positive("batch_sort_cache_size", cache_size)
        check_positive("row_multiple", row_multiple)
        if count not in ("padded", "words"):
            raise ValueError(f"count: must be 'padded' or 'words', got {count!r}")
        if max_rows is not None:
            check_positive("max_rows", max_rows)
            max_rows = max(row_multiple, max_rows // row_multiple * row_multiple)
        self.max_tokens, self.count, self.max_rows = max_tokens, count, max_rows
        self.row_multiple, self.rng = row_multiple, rng
        self.cache_size = cache_size
        self._cache: list[tuple[T, int]] = []
        self._next_fill = cache_size

    def _take(self, pairs: list[tuple[T, int]], start: int) -> int:
        """How many items from ``start`` (pairs sorted longest first) fill one batch."""
        n = len(pairs) - start
        limit = n if self.max_rows is None else min(n, self.max_rows)
        if self.count == "padded":
            longest = max(pairs[start][1], 1)
            rows = min(limit, max(1, self.max_tokens // longest))
        else:
            total, rows = 0, 0
            while rows < limit and (rows == 0 or total + pairs[start + rows][1] <= self.max_tokens):
                total += pairs[start + rows][1]
                rows += 1
        m = self.row_multiple
        if rows % m:
            rows = rows // m * m if rows >= m else min(m, n)
        return rows

    def _fill(self, final: bool) -> list[Batch[T]]:
        pairs = sorted(self._cache, key=lambda p: -p[1])
        out, start = [], 0
        while start < len(pairs):
            take = self._take(pairs, start)
            chunk = pairs[start:start + take]
            if not final and start + take >= len(pairs):
                break  # the last, underfull batch waits for more examples
            rows = -(-len(chunk) // self.row_multiple) * self.row_multiple
            out.append(make_batch([p[0] for p in chunk], [p[1] for p in chunk], rows=rows))
            start += take
        self._cache = pairs[start:]
        self._next_fill = len(self._cache) + self.cache_size  # what waits is at most one batch
        if self.rng is not None:
            self.rng.shuffle(out)
        return out

    def push(self, item: T, length: int) -> list[Batch[T]]:
        self._cache.append((item, length))
        return self._fill(final=False) if len(self._cache) >= self._next_fill else []

    def finish(self) -> list[Batch[T]]:
        return self._fill(final=True)


class BucketBatcher(Batcher[T]):
    """``buckets``: every batch has one of a few static shapes (see :func:`plan_buckets`).

    An example goes to the shortest bucket whose ``padded_len`` holds it, or on to the next longer one once that
    has taken its ``take`` examples of this batcher's run (an epoch); a bucket emits when it has ``rows``
    examples; at the end each non-empty bucket emits a partial batch completed with padding rows, so the shape
    set never grows. An example longer than the longest bucket is an error (plan with ``max_len``).
    """

    def __init__(self, shapes: Sequence[BucketShape]):
        if not shapes:
            raise ValueError("buckets: no shapes given; plan them with plan_buckets()")
        self.shapes = sorted(shapes)
        self._lens = [s.padded_len for s in self.shapes]
        self._queues: list[list[tuple[T, int]]] = [[] for _ in self.shapes]
        self._taken = [0] * len(self.shapes)

    def _emit(self, k: int) -> Batch[T]:
        queue, shape = self._queues[k], self.shapes[k]
        self._queues[k] = []
        return make_batch([p[0] for p in queue], [p[1] for p in queue], rows=shape.rows,
                          padded_len=shape.padded_len)

    def push(self, item: T, length: int) -> list[Batch[T]]:
        k = bisect.bisect_left(self._lens, length)
        if k == len(self._lens):
            raise ValueError(f"buckets: an example of length {length} is longer than the longest bucket "
                             f"({self._lens[-1]}); plan the buckets with max_len >= the longest example "
                             "(lengths are clipped at --text-truncate)")
        while 0 <= self.shapes[k].take <= self._taken[k] and k + 1 < len(self.shapes):
            k += 1  # this bucket's whole batches are taken: a longer bucket holds the example too
        self._taken[k] += 1
        self._queues[k].append((item, length))
        return [self._emit(k)] if len(self._queues[k]) >= self.shapes[k].rows else []

    def finish(self) -> list[Batch[T]]:
        return [self._emit(k) for k in range(len(self.shapes)) if self._queues[k]]


# --- one entry point -------------------------------------------------------------------------------------

def default_max_tokens(batch_size: int, text_truncate: int = -1, label_truncate: int = -1,
                       lengths: Sequence[int] = ()) -> int:
    """The token budget of ``full`` and ``buckets`` when none is given: ParlAI's
    ``(text_truncate + label_truncate) x batch_size``, so ``-bs`` rows of the longest kind of example fit.

    ``text_truncate`` <= 0 (no truncation) stands for the longest of ``lengths``; ``label_truncate`` <= 0 for
    ``text_truncate`` (ParlAI's label truncation defaults to its truncation). The budget is spent on the
    padded text (rows x longest text), which is what these models pad; labels are not counted against it.
    """
    check_positive("batch_size", batch_size)
    text = text_truncate if text_truncate > 0 else max(max(lengths, default=1), 1)
    label = label_truncate if label_truncate > 0 else text
    return (text + label) * batch_size


def token_cache_size(cache_size: int, max_tokens: int, lengths: Sequence[int], batches: int = 32) -> int:
    """The sorting cache of ``full``: at least ``batches`` batches of the median length, so a budget that
    gives big batches still finds similar lengths to fill them (a cache of a few batches pads like none)."""
    values = np.asarray(lengths)
    if values.size == 0 or max_tokens < 1:
        return cache_size
    typical = max(1, int(np.median(values)))
    return max(cache_size, batches * max(1, max_tokens // typical))


def make_batcher(strategy: str, batch_size: int, *, max_tokens: int = -1, cache_size: int = 1000,
                 shapes: Sequence[BucketShape] | None = None,
                 count: str = "padded", row_multiple: int = 1, pad_rows: bool = False,
                 rng: random.Random | None = None) -> Batcher[Any]:
    """The streaming batcher of ``strategy`` (one of :data:`STRATEGIES`).

    ``full`` needs ``max_tokens > 0``; ``buckets`` needs ``shapes``.
    """
    if strategy == "none":
        return FixedBatcher(batch_size, pad_rows=pad_rows)
    if strategy == "batchsort":
        return SortBatcher(batch_size, cache_size, rng=rng, pad_rows=pad_rows)
    if strategy == "full":
        if max_tokens is None or max_tokens < 1:
            raise ValueError("--max-batch-tokens: 'full' dynamic batching needs a positive token budget")
        return TokenBatcher(max_tokens, cache_size, count=count, row_multiple=row_multiple, rng=rng)
    if strategy == "buckets":
        if not shapes:
            raise ValueError("buckets: give the shapes (plan_buckets) to batch with")
        return BucketBatcher(shapes)
    raise ValueError(f"--dynamic-batching: {strategy!r} is not one of {', '.join(STRATEGIES)}")


@dataclass(frozen=True)
class BatchingConfig:
    """Everything that picks a batcher, as one picklable value (it travels to data workers).

    ``buckets`` needs ``shapes`` and ``full`` a positive ``max_tokens`` (see :func:`plan_buckets`,
    :func:`default_max_tokens`).
    """

    strategy: str = "none"
    batch_size: int = 32
    max_tokens: int = -1
    cache_size: int = 1000
    count: str = "padded"
    row_multiple: int = 1
    pad_rows: bool = False
    shapes: tuple[BucketShape, ...] | None = None

    def __post_init__(self) -> None:
        if self.strategy not in STRATEGIES:
            raise ValueError(f"--dynamic-batching: {self.strategy!r} is not one of {', '.join(STRATEGIES)}")
        check_positive("batch_size", self.batch_size)

    def batcher(self, rng: random.Random | None = None) -> Batcher[Any]:
        return make_batcher(self.strategy, self.batch_size, max_tokens=self.max_tokens,
                            cache_size=self.cache_size, shapes=self.shapes,
                            count=self.count, row_multiple=self.row_multiple, pad_rows=self.pad_rows, rng=rng)


def make_batches(items: Sequence[T], lengths: Sequence[int], strategy: str = "none", batch_size: int = 32, *,
                 max_tokens: int = -1, num_buckets: int = 8, cache_size: int = 1000,
                 count: str = "padded", row_multiple: int = 1, pad_rows: bool = False,
                 rng: random.Random | None = None, text_truncate: int = -1,
                 label_truncate: int = -1) -> list[Batch[T]]:
    """Batch a whole list (map-style data). ``full`` and ``buckets`` without a budget use
    :func:`default_max_tokens` of the truncations; ``buckets`` plans its shapes from these lengths."""
    if len(items) != len(lengths):
        raise ValueError(f"make_batches: {len(items)} items but {len(lengths)} lengths")
    shapes = None
    if strategy in ("full", "buckets") and (max_tokens is None or max_tokens < 1):
        max_tokens = default_max_tokens(batch_size, text_truncate, label_truncate, lengths)
    if strategy == "buckets":
        if not items:
            return []
        shapes = plan_buckets(lengths, num_buckets, batch_size, max_tokens, row_multiple)
    if strategy == "full":
        cache_size = token_cache_size(cache_size, max_tokens, lengths)
    batcher = make_batcher(strategy, batch_size, max_tokens=max_tokens, cache_size=cache_size, shapes=shapes,
                           count=count, row_multiple=row_multiple, pad_rows=pad_rows, rng=rng)
    return list(batcher.run(zip(items, lengths)))
