"""Bucket planning for the ``buckets`` dynamic-batching strategy: at most K static batch shapes
(rows_k, len_k) chosen to pad the data's lengths least, each bucket's rows set by its length under the token
budget, and the least padding any K static lengths allow (the floor bench/padding.py prints)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

import numpy as np


def check_positive(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")


@dataclass(frozen=True, order=True)
class BucketShape:
    """One static batch shape of the ``buckets`` strategy; ``take``: the examples an epoch puts in it before the
    rest that fit it spill on to the next longer bucket (a multiple of ``rows``, so all its batches are full;
    -1: no limit)."""

    padded_len: int
    rows: int
    take: int = -1

    @property
    def shape(self) -> tuple[int, int]:
        return (self.rows, self.padded_len)


def _bucket_rows(padded_len: int, count: int, batch_size: int, max_tokens: int | None, row_multiple: int,
                 up: bool = False) -> int:
    """Rows of one bucket: as many as the budget allows at this length (``batch_size`` without a budget), a
    multiple of ``row_multiple``; then evened out over the fewest batches its ``count`` examples need: rounded
    down (whole batches, fewer than one example per batch left to spill on), or ``up`` (a last batch nearly
    full, for the longest bucket, which has nowhere to spill)."""
    cap = max_tokens // max(padded_len, 1) if max_tokens and max_tokens > 0 else batch_size
    cap = max(row_multiple, cap // row_multiple * row_multiple)
    if count < 1:
        return cap
    batches = -(-count // cap)
    if up:
        return -(-(-(-count // batches)) // row_multiple) * row_multiple  # cap is a multiple: still <= cap
    return max(row_multiple, count // batches // row_multiple * row_multiple)


def _shapes(ends: list[int], counts: list[int], batch_size: int, max_tokens: int | None,
            row_multiple: int) -> list[BucketShape]:
    """The shapes of buckets of these lengths (ascending) and example counts: each bucket takes the whole
    batches its examples (and those spilled from the shorter one) fill; the few left over spill on to the next
    longer bucket, which holds them, so an epoch of these counts ends on one partial batch at most, the longest
    bucket's (dropped in training)."""
    out, carry = [], 0
    for i, (length, count) in enumerate(zip(ends, counts)):
        here = count + carry
        last = i == len(ends) - 1
        rows = _bucket_rows(length, here, batch_size, max_tokens, row_multiple, up=last)
        take = -1 if last else here // rows * rows
        out.append(BucketShape(length, rows, take))
        carry = here - take
    return out


def plan_buckets(lengths: Iterable[int], num_buckets: int = 8, batch_size: int = 32,
                 max_tokens: int | None = None, row_multiple: int = 1,
                 max_len: int | None = None, shards: int = 1) -> list[BucketShape]:
    """Choose at most ``num_buckets`` static shapes ``(rows_k, len_k)`` that minimise padding for these lengths.

    The padded lengths are the optimal partition of the sorted lengths into ``num_buckets`` intervals, each
    padded to its longest member (exact dynamic programming over the distinct lengths: no choice of
    ``num_buckets`` lengths pads less, see :func:`bucket_padding_bound`); a length below 1 counts as 1 (a static
    width holds one position at least). The longest bucket is ``max_len`` when given (so a stream never meets a
    longer example), else the longest length. Rows vary with the length: with a token budget at most
    ``max_tokens // len_k`` (so ``rows_k x len_k <= max_tokens`` unless one row alone is longer), else
    ``batch_size``; a multiple of ``row_multiple``; evened out over the batches the bucket's examples (``1 /
    shards`` of them per shard) need. A bucket takes the whole batches they fill and spills the few left over to
    the next longer one (``take``), so an epoch ends on one partial batch at most: the longest bucket's.
    """
    check_positive("num_buckets", num_buckets)
    check_positive("batch_size", batch_size)
    # a static length is at least 1: collates pad an empty text to one padding position (a tensor of width 0
    # is no input a model can pool or attend over), so an example of length 0 is planned as one of length 1
    values, counts = np.unique(np.maximum(np.asarray(list(lengths), dtype=np.int64), 1), return_counts=True)
    if values.size == 0:
        raise ValueError("plan_buckets: no lengths to plan from (the dataset is empty)")
    if max_len is not None:
        if values[-1] > max_len:
            raise ValueError(f"plan_buckets: a length {values[-1]} exceeds max_len={max_len}")
        if values[-1] < max_len:
            values, counts = np.append(values, max_len), np.append(counts, 0)
    m = values.size
    k_max = min(num_buckets, m)
    c = counts.astype(np.float64)
    wc = np.concatenate([[0.0], np.cumsum(c * values)])
    cc = np.concatenate([[0.0], np.cumsum(c)])

    def cost(i: np.ndarray, j: int) -> np.ndarray:
        """Padding of the items with distinct lengths values[i..j] padded to values[j]."""
        return values[j] * (cc[j + 1] - cc[i]) - (wc[j + 1] - wc[i])

    inf = float("inf")
    best = np.full((k_max + 1, m), inf)
    choice = np.zeros((k_max + 1, m), dtype=np.int64)
    best[1] = [cost(np.array([0]), j)[0] for j in range(m)]
    for k in range(2, k_max + 1):
        for j in range(k - 1, m):
            starts = np.arange(k - 1, j + 1)        # the k-th bucket covers values[starts..j]
            total = best[k - 1, starts - 1] + cost(starts, j)
            pick = int(np.argmin(total))
            best[k, j], choice[k, j] = total[pick], starts[pick]
    k = int(np.argmin(best[1:, m - 1])) + 1        # fewest buckets reaching the minimum
    ends, members, j = [], [], m - 1
    while k >= 1:
        start = choice[k, j] if k > 1 else 0
        ends.append(int(values[j]))
        members.append(int(counts[start:j + 1].sum()))
        j, k = start - 1, k - 1
    check_positive("shards", shards)
    return _shapes(ends[::-1], [-(-count // shards) for count in members[::-1]], batch_size, max_tokens,
                   row_multiple)


def bucket_padding_bound(lengths: Iterable[int], num_buckets: int) -> float:
    """The least pad fraction any ``num_buckets`` static lengths can reach on these lengths, one example per
    row and no padding rows (the optimum :func:`plan_buckets` finds): a floor for every bucketing."""
    values = np.asarray(list(lengths), dtype=np.int64)
    if values.size == 0:
        return 0.0
    padded = np.asarray([s.padded_len for s in plan_buckets(values.tolist(), num_buckets)], dtype=np.int64)
    per_example = padded[np.searchsorted(padded, values)]
    return float((per_example - values).sum() / per_example.sum())


__all__ = ["BucketShape", "bucket_padding_bound", "check_positive", "plan_buckets"]
