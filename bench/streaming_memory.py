"""Streaming memory benchmark: peak RSS while streaming a big file vs a small one (-dt train:stream).

Two JSONL files of multi-turn dialogues (``--big-mb``, default 1024, and ``--small-mb``, default 10) are
written to a temporary directory (deleted afterwards). Each is read in a fresh child process by the
loader with ``--dynamic-batching`` (default batchsort, a cache of ``--batch-sort-cache-size`` examples) or
none, squashing and a tokenizing collate, for one epoch; the child reports its peak resident set size. A third
child only imports the same modules (the floor). A streamed file's text is never held: what grows with the
file is its index (per episode: byte offset, line, turns) and, for the schedule, a few integers per example
(each example's length for dynamic batching, the epoch's order): the report gives the bytes per example.

    .venv/bin/python bench/streaming_memory.py [--big-mb 1024] [--small-mb 10]
    .venv/bin/python bench/streaming_memory.py --big-mb 100        # quicker
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_file(path: str, megabytes: float, seed: int = 0) -> None:
    """Multi-turn JSONL dialogues; a 1 MB block of random episodes is repeated up to the size."""
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(5000)]
    lines, size = [], 0
    while size < 1 << 20:
        turns = rng.randint(1, 6)
        for t in range(turns):
            text = " ".join(rng.choices(words, k=rng.randint(3, 40)))
            label = " ".join(rng.choices(words, k=rng.randint(3, 30)))
            line = json.dumps({"text": text, "labels": [label], "episode_done": t == turns - 1}) + "\n"
            lines.append(line)
            size += len(line)
    block = "".join(lines)
    target = int(megabytes * (1 << 20))
    with open(path, "w") as f:
        written = 0
        while written < target:
            f.write(block)
            written += len(block)


def child(path: str | None, cache: int, strategy: str) -> None:
    import torch

    from accelbatch.data import make_loader

    if path is None:
        print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return
    start = time.perf_counter()
    examples = batches = 0
    collate = Tokenize()
    with make_loader(path, collate=collate, training=True, batch_size=32, dynamic_batching=strategy,
                     batch_sort_cache_size=cache, context_length=-1) as loader:
        for batch in loader:
            examples += batch.num_real
            batches += 1
            assert isinstance(batch.tensors["text_vec"], torch.Tensor)
    print(json.dumps({"rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                      "examples": examples, "batches": batches, "seconds": time.perf_counter() - start}))


class Tokenize:
    """A small agent-like collate: hashed word ids, padded (keeps the child busy like a real loader)."""

    def __call__(self, messages):
        import torch

        rows = [[hash(w) % 30000 for w in m["text"].split()[-128:]] for m in messages]
        width = max(len(r) for r in rows) or 1
        out = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r)] = torch.tensor(r, dtype=torch.long)
        return {"text_vec": out}


def run_child(path: str | None, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", path or "-", "--batch-sort-cache-size",
           str(args.batch_sort_cache_size), "--dynamic-batching", args.dynamic_batching]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"))
    if out.returncode != 0:  # the child's own last line (its error), not a traceback of this process
        said = out.stderr.strip().splitlines()
        raise SystemExit(f"{os.path.basename(__file__)}: error: the child reading {path or 'nothing'} exited "
                         f"{out.returncode}: {said[-1] if said else 'without a message'}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--big-mb", type=float, default=1024)
    parser.add_argument("--small-mb", type=float, default=10)
    parser.add_argument("--batch-sort-cache-size", type=int, default=1000)
    parser.add_argument("--dynamic-batching", default="batchsort", choices=("none", "batchsort", "full", "buckets"))
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child is not None:
        child(None if args.child == "-" else args.child, args.batch_sort_cache_size, args.dynamic_batching)
        return
    # checked before any file is written: an empty file has no examples, and the loader takes a cache of 1+
    for option, mb in (("--big-mb", args.big_mb), ("--small-mb", args.small_mb)):
        if not 0 < mb < math.inf:
            parser.error(f"{option} {mb:g}: give a size in MB above 0")
    if args.big_mb <= args.small_mb:
        parser.error(f"--big-mb {args.big_mb:g}: give more than --small-mb {args.small_mb:g} (the two are compared)")
    if args.batch_sort_cache_size < 1:
        parser.error(f"--batch-sort-cache-size {args.batch_sort_cache_size}: give 1 or more")
    with tempfile.TemporaryDirectory() as tmp:
        results = {"imports only": run_child(None, args)}
        file_bytes = {}
        for name, mb in (("small", args.small_mb), ("big", args.big_mb)):
            path = os.path.join(tmp, f"{name}.jsonl")
            start = time.perf_counter()
            write_file(path, mb)
            file_bytes[name] = os.path.getsize(path)  # whole blocks of about 1 MiB: at least --big/small-mb
            size = file_bytes[name] / (1 << 20)
            if name == "big" and file_bytes["big"] == file_bytes["small"]:
                parser.error(f"--big-mb {args.big_mb:g} --small-mb {args.small_mb:g}: both files are {size:.0f} MB "
                             "(written in whole blocks of about 1 MB): give sizes at least 1 MB apart")
            print(f"wrote {size:.0f} MB in {time.perf_counter() - start:.1f} s", flush=True)
            results[f"{name} ({size:.0f} MB)"] = run_child(path, args)
            os.remove(path)
    print(f"\n{'file':<18}{'examples':>11}{'batches':>9}{'seconds':>9}{'peak RSS MB':>13}")
    for name, r in results.items():
        print(f"{name:<18}{r.get('examples', 0):>11}{r.get('batches', 0):>9}{r.get('seconds', 0):>9.1f}"
              f"{r['rss_mb']:>13.1f}")
    (small, small_exs), (big, big_exs) = [(r["rss_mb"], r["examples"]) for n, r in results.items()
                                          if n.startswith(("small", "big"))]
    per_example = (big - small) * (1 << 20) / max(1, big_exs - small_exs)
    print(f"\npeak RSS big / small: {big / small:.3f}x; {per_example:.1f} bytes per example more "
          f"(the file written: {file_bytes['big'] / max(1, big_exs):.0f} bytes per example)")


if __name__ == "__main__":
    main()
