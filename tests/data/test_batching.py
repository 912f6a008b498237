"""Dynamic batching: ParlAI's worked examples, the four strategies, and exactly-once as a property."""

from __future__ import annotations

import random
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.data.batching import (
    STRATEGIES,
    BatchingConfig,
    BucketBatcher,
    BucketShape,
    TokenBatcher,
    batch_stats,
    default_max_tokens,
    make_batcher,
    make_batches,
    plan_buckets,
)
from accelbatch.data.buckets import bucket_padding_bound

# ParlAI's 12 movie quotes (id -> number of words), from "Worlds, Sharing & Batching"
QUOTE_WORDS = [8, 10, 17, 2, 2, 38, 6, 12, 6, 12, 13, 5]


def test_full_reproduces_parlai_worked_example():
    batches = make_batches(list(range(12)), QUOTE_WORDS, "full", 3, max_tokens=80, count="words")
    assert [b.real_tokens for b in batches] == [80, 51]
    assert set(batches[0].items) == {5, 2, 10, 7} or set(batches[0].items) == {5, 2, 10, 9}
    assert sorted(i for b in batches for i in b.items) == list(range(12))


def test_full_padded_budget_keeps_rows_times_longest_within_budget():
    batches = make_batches(list(range(12)), QUOTE_WORDS, "full", 3, max_tokens=80)
    assert all(b.padded_tokens <= 80 for b in batches)
    assert sorted(i for b in batches for i in b.items) == list(range(12))
    assert [b.num_real for b in batches] == [2, 6, 4]     # 38+17 | 13,12,12,10,8,6 | 6,5,2,2


def test_batchsort_reproduces_parlai_grouping():
    batches = make_batches(list(range(12)), QUOTE_WORDS, "batchsort", 3)
    assert [sorted(b.lengths) for b in batches] == [[2, 2, 5], [6, 6, 8], [10, 12, 12], [13, 17, 38]]


def test_none_keeps_order_and_pads_to_longest():
    batches = make_batches(list(range(12)), QUOTE_WORDS, "none", 3)
    assert [list(b.items) for b in batches] == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert batches[1].shape == (3, 38) and batches[1].pad_tokens == 3 * 38 - 42


def test_pad_fraction_counts_padding_rows():
    stats = batch_stats(make_batches(list(range(5)), [4] * 5, "none", 4, pad_rows=True))
    assert stats.batches == 2 and stats.padded_tokens == 32 and stats.real_tokens == 20
    assert stats.pad_fraction == pytest.approx(12 / 32)


def long_tail(n=5000, seed=0):
    rng = random.Random(seed)
    return [max(1, min(256, int(rng.lognormvariate(2.5, 0.7)))) for _ in range(n)]


def test_sorting_strategies_cut_padding_on_long_tails():
    lengths = long_tail()
    waste = {s: batch_stats(make_batches(list(range(len(lengths))), lengths, s, 32, max_tokens=640)).pad_fraction
             for s in STRATEGIES}
    assert waste["none"] > 0.4
    assert waste["batchsort"] < 0.15 and waste["full"] < 0.1
    assert waste["buckets"] < waste["none"] / 2


def test_buckets_use_few_static_shapes_whose_rows_follow_the_default_budget():
    lengths = long_tail()
    batches = make_batches(list(range(len(lengths))), lengths, "buckets", 32, num_buckets=6, text_truncate=200,
                           label_truncate=56)
    stats = batch_stats(batches)
    budget = (200 + 56) * 32  # ParlAI's (text truncation + label truncation) x batchsize
    assert len(stats.shapes) <= 6 and all(rows * n <= budget for rows, n in stats.shapes)
    by_len = sorted(stats.shapes, key=lambda s: s[1])
    assert by_len[0][0] > by_len[-1][0]  # short examples share bigger batches than long ones
    assert stats.examples == len(lengths)
    budget = make_batches(list(range(len(lengths))), lengths, "buckets", 32, num_buckets=6, max_tokens=640,
                          row_multiple=4)
    shapes = batch_stats(budget).shapes
    assert len(shapes) <= 6 and all(r % 4 == 0 and (r * n <= 640 or r == 4) for r, n in shapes)


def test_plan_buckets_is_optimal_on_a_small_case():
    # lengths 1,2 (many) and 10: two buckets should split {1,2} | {10}
    shapes = plan_buckets([1] * 5 + [2] * 5 + [10], num_buckets=2, batch_size=4)
    assert [s.padded_len for s in shapes] == [2, 10]
    # fewer distinct lengths than buckets: one bucket per length, no padding at all
    assert [s.padded_len for s in plan_buckets([3, 3, 7], 8)] == [3, 7]
    # max_len makes the longest bucket cover later, longer examples
    assert plan_buckets([3, 4], 2, max_len=20)[-1].padded_len == 20


def test_buckets_take_whole_batches_and_spill_the_rest_to_a_longer_bucket():
    """43 examples of length 3 and 22 of length 10, budget 30 tokens: the short bucket's cap is 10 rows, so its
    43 need 5 batches: 5 x 8 rows taken, 3 spill into the long one (3 rows at most), whose 25 need 9 batches of
    3 (rounded up: it spills nowhere), the last holding 1. An epoch drops 1 example (the old plan: rows 9 and 3,
    partial batches of 7 and 1, 8 dropped)."""
    lengths = [3] * 43 + [10] * 22
    shapes = plan_buckets(lengths, num_buckets=2, batch_size=8, max_tokens=30)
    assert shapes == [BucketShape(3, 8, 40), BucketShape(10, 3, -1)]
    order = list(range(len(lengths)))
    random.Random(0).shuffle(order)
    batches = list(BucketBatcher(shapes).run((i, lengths[i]) for i in order))
    assert [b.num_real for b in batches if b.shape == (8, 3)] == [8] * 5
    assert sorted(b.num_real for b in batches if b.shape == (3, 10)) == [1] + [3] * 8
    spilled = [i for b in batches if b.shape == (3, 10) for i in b.items if lengths[i] == 3]
    assert sorted(spilled) == sorted([i for i in order if lengths[i] == 3][-3:])  # the last short ones to come


def test_bucket_batcher_rejects_examples_longer_than_planned():
    batcher = BucketBatcher([BucketShape(8, 2)])
    with pytest.raises(ValueError, match="longer than the longest bucket"):
        batcher.push("x", 9)


def test_token_batcher_memory_is_bounded_by_the_cache_and_one_batch():
    batcher = TokenBatcher(max_tokens=64, cache_size=16)
    out, biggest = [], 0
    for i in range(1000):
        out += batcher.push(i, 1)
        biggest = max(biggest, len(batcher._cache))
    out += batcher.finish()
    assert biggest <= 16 + 64
    assert sorted(i for b in out for i in b.items) == list(range(1000))
    assert all(b.padded_tokens <= 64 for b in out)


def test_unknown_strategy_names_the_option():
    with pytest.raises(ValueError, match="--dynamic-batching"):
        make_batcher("sorted", 4)
    with pytest.raises(ValueError, match="--max-batch-tokens"):
        make_batcher("full", 4)


@settings(max_examples=150, deadline=None)
@given(lengths=st.lists(st.integers(0, 60), min_size=0, max_size=120),
       strategy=st.sampled_from(STRATEGIES), batch_size=st.integers(1, 9), cache=st.integers(1, 40),
       row_multiple=st.integers(1, 3), count=st.sampled_from(["padded", "words"]),
       num_buckets=st.integers(1, 5), budget=st.integers(1, 200), pad_rows=st.booleans())
def test_every_example_is_in_exactly_one_batch(lengths, strategy, batch_size, cache, row_multiple, count,
                                               num_buckets, budget, pad_rows):
    items = list(range(len(lengths)))
    if strategy == "buckets":
        if not lengths:
            return
        shapes = tuple(plan_buckets(lengths, num_buckets, batch_size, budget if budget % 2 else None,
                                    row_multiple))
    else:
        shapes = None
    config = BatchingConfig(strategy, batch_size, max_tokens=budget, cache_size=cache, count=count,
                            row_multiple=row_multiple,
                            pad_rows=pad_rows, shapes=shapes)
    batches = list(config.batcher(random.Random(0)).run(zip(items, lengths)))
    assert Counter(i for b in batches for i in b.items) == Counter(items)
    for b in batches:
        assert b.num_real >= 1 and b.rows >= b.num_real
        assert all(n <= b.padded_len for n in b.lengths)
        assert 0 <= b.pad_tokens <= b.padded_tokens
    if strategy == "buckets":
        assert len({b.shape for b in batches}) <= num_buckets
        assert {b.shape for b in batches} <= {s.shape for s in shapes}
    if strategy == "full":
        for b in batches:
            assert b.rows % row_multiple == 0
            over = b.padded_tokens > budget if count == "padded" else b.real_tokens > budget
            assert not over or b.num_real <= row_multiple
    if strategy in ("none", "batchsort"):
        assert all(b.num_real == batch_size for b in batches[:-1]) or strategy == "batchsort"


def test_default_budget_by_hand():
    # ParlAI: (text_truncate + label_truncate) x batchsize; label truncation -1 falls back to the text's
    assert default_max_tokens(32, 256, -1) == 512 * 32
    assert default_max_tokens(32, 360, 128) == 488 * 32
    assert default_max_tokens(4, -1, 2, lengths=[3, 9, 5]) == (9 + 2) * 4  # no truncation: the longest


@settings(max_examples=200, deadline=None)
@given(lengths=st.lists(st.integers(1, 80), min_size=1, max_size=300), num_buckets=st.integers(1, 9),
       batch_size=st.integers(1, 16), budget=st.one_of(st.none(), st.integers(1, 600)),
       row_multiple=st.integers(1, 4), seed=st.integers(0, 3))
def test_bucket_plan_property(lengths, num_buckets, batch_size, budget, row_multiple, seed):
    """Never more than --num-buckets shapes; every batch within the token budget (a single row multiple may
    exceed it when one example alone does); every example exactly once in an epoch; rows at most what the
    budget allows at the bucket's length; one batch with padding rows at most, the longest bucket's last (the
    other buckets take whole batches and spill the rest on), its padding rows fewer than its batches x the row
    multiple."""
    max_tokens = budget or default_max_tokens(batch_size, 40, -1, lengths)
    shapes = plan_buckets(lengths, num_buckets, batch_size, max_tokens, row_multiple)
    order = list(range(len(lengths)))
    random.Random(seed).shuffle(order)
    batches = list(BucketBatcher(shapes).run((i, lengths[i]) for i in order))
    assert len(shapes) <= num_buckets and len({b.shape for b in batches}) <= num_buckets
    assert Counter(i for b in batches for i in b.items) == Counter(range(len(lengths)))
    for shape in shapes:
        assert shape.rows % row_multiple == 0
        assert shape.rows <= max(row_multiple, max_tokens // shape.padded_len // row_multiple * row_multiple)
        mine = [b for b in batches if b.shape == shape.shape]
        assert sum(b.rows - b.num_real for b in mine) < max(1, len(mine)) * row_multiple
        assert shape == shapes[-1] or all(b.num_real == b.rows for b in mine)
    for b in batches:
        assert b.padded_tokens <= max_tokens or b.rows == row_multiple
        assert all(n <= b.padded_len for n in b.lengths)


def test_bucket_padding_bound_is_the_optimum_by_brute_force():
    rng = random.Random(1)
    lengths = [rng.randint(1, 12) for _ in range(60)]
    best = 1.0
    values = sorted(set(lengths))
    from itertools import combinations
    for k in range(1, 4):
        for cut in combinations(values[:-1], k - 1):
            ends = sorted(set(cut) | {values[-1]})
            padded = [min(e for e in ends if e >= n) for n in lengths]
            best = min(best, (sum(padded) - sum(lengths)) / sum(padded))
    assert bucket_padding_bound(lengths, 3) == pytest.approx(best)
