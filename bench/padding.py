"""Padding benchmark: pad waste, batch count and distinct shapes of none / batchsort / full / buckets.

Lengths are generated like squashed dialogue data: episodes of 1-8 turns whose utterances have log-normal
word counts; each example's text is the whole history so far (``--context-length -1``, labels included),
clipped at ``--text-truncate``. A second, heavier-tailed set (one utterance per example, sigma 0.9) shows
where bucketing reaches its limits. Pad waste = pad tokens / all tokens of the padded batches (padding rows
included). ``full`` and ``buckets`` use the loader's default token budget, ParlAI's (text truncation + label
truncation) x batchsize, the label truncation being the text's (``--label-truncate`` to change it); a bucket's
rows vary with its length under that budget. ``bound`` is the least pad waste any ``--buckets`` static lengths
can reach with one example per row (the optimal partition the planner computes; rows never change it). Run:

    .venv/bin/python bench/padding.py [--examples 20000] [--batchsize 32] [--buckets 8]

Goals (issue 19): full and buckets at most 5 % waste, buckets with at most 8 shapes; where the bound is above
5 %, no bucketing with that many shapes can meet it and the table says how many shapes would.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelbatch.data.batching import STRATEGIES, batch_stats, default_max_tokens, make_batches  # noqa: E402
from accelbatch.data.buckets import bucket_padding_bound  # noqa: E402


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


def run(name: str, lengths: list[int], batchsize: int, buckets: int, truncate: int,
        label_truncate: int) -> dict[str, float]:
    items = list(range(len(lengths)))
    budget = default_max_tokens(batchsize, truncate, label_truncate, lengths)
    print(f"\n{name}: {len(lengths)} examples, mean length {sum(lengths) / len(lengths):.1f}, "
          f"max {max(lengths)}, batchsize {batchsize} (token budget of full and buckets: {budget})")
    print(f"  {'strategy':<22}{'batches':>8}{'rows':>7}{'pad waste':>11}{'bound':>8}{'shapes':>8}{'vs full':>9}"
          f"{'plan s':>8}")
    waste = {}
    rows = []
    trunc = dict(text_truncate=truncate, label_truncate=label_truncate)
    for strategy in STRATEGIES:
        start = time.perf_counter()
        stats = batch_stats(make_batches(items, lengths, strategy, batchsize, num_buckets=buckets,
                                         rng=random.Random(0), **trunc))
        rows.append((strategy, stats, time.perf_counter() - start, buckets if strategy == "buckets" else 0))
        waste[strategy] = stats.pad_fraction
    for k in (4, 12, 16, 32):
        stats = batch_stats(make_batches(items, lengths, "buckets", batchsize, num_buckets=k, **trunc))
        rows.append((f"buckets (num={k})", stats, float("nan"), k))
    full = waste["full"]
    for strategy, stats, secs, k in rows:
        ratio = stats.pad_fraction / full if full else float("inf")
        bound = f"{bucket_padding_bound(lengths, k):>7.2%}" if k else f"{'':>7}"
        print(f"  {strategy:<22}{stats.batches:>8}{stats.examples / stats.batches:>7.1f}"
              f"{stats.pad_fraction:>10.2%} {bound}{len(stats.shapes):>8}{ratio:>8.1f}x{secs:>8.2f}")
    needed = next((k for k in range(1, 257) if bucket_padding_bound(lengths, k) <= 0.05), None)
    print(f"  fewest static lengths whose bound is <= 5%: {needed}")
    waste["bound"] = bucket_padding_bound(lengths, buckets)
    return waste


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--examples", type=int, default=20000)
    parser.add_argument("--batchsize", type=int, default=32)
    parser.add_argument("--buckets", type=int, default=8)
    parser.add_argument("--text-truncate", type=int, default=128)
    parser.add_argument("--label-truncate", type=int, default=-1, help="-1: as the text truncation")
    args = parser.parse_args(argv)
    for option in ("examples", "batchsize", "buckets", "text_truncate"):
        if getattr(args, option) < 1:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option)}: give 1 or more")
    if args.label_truncate < 1 and args.label_truncate != -1:
        parser.error(f"--label-truncate {args.label_truncate}: give 1 or more, or -1 (as the text truncation)")
    results = {
        "dialogue": run(f"dialogue contexts (squashed, clipped at {args.text_truncate})",
                        dialogue_lengths(args.examples, args.text_truncate), args.batchsize, args.buckets,
                        args.text_truncate, args.label_truncate),
        "heavy tail": run("heavy tail (single utterances, lognormal sigma 0.9, clipped at 256)",
                          heavy_tail_lengths(args.examples, 256), args.batchsize, args.buckets, 256,
                          args.label_truncate),
    }
    print()
    for name, waste in results.items():
        print(f"goal on {name}: full <= 5%: {'met' if waste['full'] <= 0.05 else 'NOT met'} ({waste['full']:.2%}); "
              f"buckets <= 5% with <= {args.buckets} shapes: {'met' if waste['buckets'] <= 0.05 else 'NOT met'} "
              f"({waste['buckets']:.2%}; no {args.buckets} lengths pad less than {waste['bound']:.2%})")


if __name__ == "__main__":
    main()
