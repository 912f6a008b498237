"""Padding benchmark: pad waste, batch count and distinct shapes of none / batchsort / full / buckets.

Lengths are generated like squashed dialogue data: episodes of 1-8 turns whose utterances have log-normal
word counts; each example's text is the whole history so far (``--context-length -1``, labels included),
clipped at ``--text-truncate``. A second, heavier-tailed set (one utterance per example, sigma 0.9) shows
where bucketing reaches its limits. Pad waste = pad tokens / all tokens of the padded batches (padding rows
included). Run:

    .venv/bin/python bench/padding.py [--examples 20000] [--batchsize 32] [--buckets 8]

Goals (issue 3): full and buckets under 10 % waste, buckets with at most 8 shapes.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelbatch.data.batching import STRATEGIES, batch_stats, make_batches  # noqa: E402


def dialogue_lengths(n: int, truncate: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    out: list[int] = []
    while len(out) < n:
        history = 0
        for _ in range(rng.randint(1, 8)):
            text = max(1, int(rng.lognormvariate(2.3, 0.6)))
            label = max(1, int(rng.lognormvariate(2.3, 0.6)))
            history += text
            out.append(min(history, truncate))
            history += label
    return out[:n]


def heavy_tail_lengths(n: int, truncate: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [max(1, min(truncate, int(rng.lognormvariate(2.5, 0.9)))) for _ in range(n)]


def run(name: str, lengths: list[int], batchsize: int, buckets: int) -> dict[str, float]:
    items = list(range(len(lengths)))
    print(f"\n{name}: {len(lengths)} examples, mean length {sum(lengths) / len(lengths):.1f}, "
          f"max {max(lengths)}, batchsize {batchsize} (token budget for full: batchsize x median)")
    print(f"  {'strategy':<22}{'batches':>8}{'pad waste':>11}{'shapes':>8}{'vs full':>9}{'plan s':>8}")
    waste = {}
    rows = []
    for strategy in STRATEGIES:
        start = time.perf_counter()
        stats = batch_stats(make_batches(items, lengths, strategy, batchsize, num_buckets=buckets,
                                         rng=random.Random(0)))
        rows.append((strategy, stats, time.perf_counter() - start))
        waste[strategy] = stats.pad_fraction
    for k in (4, 12, 16):
        stats = batch_stats(make_batches(items, lengths, "buckets", batchsize, num_buckets=k))
        rows.append((f"buckets (num={k})", stats, float("nan")))
    full = waste["full"]
    for strategy, stats, secs in rows:
        ratio = stats.pad_fraction / full if full else float("inf")
        print(f"  {strategy:<22}{stats.batches:>8}{stats.pad_fraction:>10.2%}{len(stats.shapes):>8}"
              f"{ratio:>8.1f}x{secs:>8.2f}")
    return waste


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--batchsize", type=int, default=32)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--text-truncate", type=int, default=128)
    args = parser.parse_args()
    waste = run(f"dialogue contexts (squashed, clipped at {args.text_truncate})",
                dialogue_lengths(args.examples, args.text_truncate), args.batchsize, args.buckets)
    run("heavy tail (single utterances, lognormal sigma 0.9, clipped at 256)",
        heavy_tail_lengths(args.examples, 256), args.batchsize, args.buckets)
    ok_full = waste["full"] < 0.10
    ok_buckets = waste["buckets"] < 0.10
    print(f"\ngoal on dialogue contexts: full < 10% waste: {'met' if ok_full else 'NOT met'} "
          f"({waste['full']:.2%}); buckets < 10% with <= {args.buckets} shapes: "
          f"{'met' if ok_buckets else 'NOT met'} ({waste['buckets']:.2%})")


if __name__ == "__main__":
    main()
