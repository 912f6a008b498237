"""Feeding benchmark: can the loader keep a model step busy when preprocessing costs as much as the step?

Each batch needs ``--load-ms`` of CPU preprocessing (per-row vectorize, then batchify) and the simulated model
step takes ``--step-ms``. ``--step sleep`` (default) models an accelerator: the host is idle while the device
computes; ``--step spin`` burns host CPU instead. The bound is max(load time, compute time) of an epoch: the
load time is measured by producing every batch serially in this process, the compute time is
batches x step. Every loader's epoch time is printed as a ratio to that bound (1.00 = perfect overlap;
about 2 = no overlap). Data workers: ``--workers`` (the same for every loader, torch's DataLoader included).
Map-style data (in memory) and a stream read from a JSONL file are both measured; for map-style data
async-rebatched is the same loader as async (batches are planned before the workers see them).

    .venv/bin/python bench/feeding.py [--batches 60] [--load-ms 20] [--step-ms 20] [--workers 1] [--step spin]

Goal (issue 3): async within 1.15x of the bound on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from accelbatch.data import StreamSource, make_loader  # noqa: E402
from accelbatch.data.batching import BatchingConfig  # noqa: E402
from accelbatch.data.datasets import StreamDataset  # noqa: E402
from accelbatch.messages import Message  # noqa: E402


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    x = 0
    while time.perf_counter() < end:
        x += 1


class CostlyCollate:
    """An agent's vectorize (CPU work per row) and batchify (padding); picklable, so it runs in workers."""

    def __init__(self, row_seconds: float):
        self.row_seconds = row_seconds

    def vectorize(self, msg: Message) -> Message:
        spin(self.row_seconds)
        msg = Message(msg)
        msg["text_vec"] = torch.tensor([hash(w) % 1000 for w in msg["text"].split()] or [0])
        return msg

    def batchify(self, rows: list[Message]) -> dict[str, torch.Tensor]:
        width = max(len(r["text_vec"]) for r in rows)
        out = torch.zeros(len(rows), width, dtype=torch.long)
        for i, r in enumerate(rows):
            out[i, :len(r["text_vec"])] = r["text_vec"]
        return {"text_vec": out, "labels": torch.arange(len(rows))}

    def __call__(self, rows: list[Message]) -> dict[str, torch.Tensor]:
        return self.batchify([self.vectorize(r) for r in rows])


class TorchStyle(torch.utils.data.Dataset):
    """The plain torch way: a map-style dataset of Messages, collated by DataLoader(batch_size=...)."""

    def __init__(self, messages: list[Message]):
        self.messages = messages

    def __len__(self) -> int:
        return len(self.messages)

    def __getitem__(self, i: int) -> Message:
        return self.messages[i]


def emit_tensors(collate):
    return _Emit(collate)


class _Emit:
    def __init__(self, collate):
        self.collate = collate

    def __call__(self, batch):
        return self.collate([msg for _, msg in batch.items])


def make_messages(n: int) -> list[Message]:
    return [Message({"text": f"example {i} " + "word " * (5 + i % 20), "labels": [f"a{i}"], "episode_done": True})
            for i in range(n)]


def epoch_time(loader, step: float, mode: str) -> tuple[float, int]:
    """Time of one epoch with a simulated step per batch (after a warm-up batch: process start is excluded)."""
    it = iter(loader)
    first = next(it)
    n = 1
    start = time.perf_counter()
    (spin if mode == "spin" else time.sleep)(step)
    del first
    for _ in it:
        (spin if mode == "spin" else time.sleep)(step)
        n += 1
    return time.perf_counter() - start, n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--batchsize", type=int, default=16)
    parser.add_argument("--load-ms", type=float, default=20.0, help="preprocessing per batch")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated model step per batch")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--step", choices=("sleep", "spin"), default="sleep")
    args = parser.parse_args()
    torch.set_num_threads(1)
    bs = args.batchsize
    n = args.batches * bs + 1     # + 1 warm-up batch
    messages = make_messages(n)
    collate = CostlyCollate(args.load_ms / 1000 / bs)
    step = args.step_ms / 1000
    workers = args.workers

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.jsonl")
        with open(path, "w") as f:
            for m in messages:
                f.write(json.dumps(dict(m)) + "\n")
        print(f"{args.batches} batches of {bs} rows; preprocessing {args.load_ms:g} ms and model step "
              f"{args.step_ms:g} ms ({args.step}) per batch; {workers} data worker(s); {os.cpu_count()} cores")
        for kind, data in (("map-style", messages), ("stream", path)):
            # the bound: serial load time of the whole epoch vs compute time
            with make_loader(data, collate=collate, training=False, batch_size=bs, num_workers=0) as serial:
                it = iter(serial)
                next(it)
                start = time.perf_counter()
                loaded = sum(1 for _ in it)
                load = (time.perf_counter() - start) * (loaded + 1) / max(loaded, 1)
            compute = (loaded + 1) * step
            bound = max(load, compute)
            print(f"\n{kind}: load {load:.2f} s, compute {compute:.2f} s, bound {bound:.2f} s")
            print(f"  {'loader':<34}{'epoch s':>9}{'ratio':>8}")
            runs = [("sync, 0 workers (no overlap)", dict(mode="sync", num_workers=0)),
                    (f"sync, {workers} workers", dict(mode="sync", num_workers=workers)),
                    ("async, 0 workers", dict(mode="async", num_workers=0)),
                    (f"async, {workers} workers", dict(mode="async", num_workers=workers)),
                    (f"async-rebatched, {workers} workers", dict(mode="async-rebatched", num_workers=workers))]
            results = {}
            for name, kw in runs:
                with make_loader(data, collate=collate, training=False, batch_size=bs, **kw) as loader:
                    secs, count = epoch_time(loader, step, args.step)
                results[name] = secs / bound
                print(f"  {name:<34}{secs:>9.2f}{secs / bound:>7.2f}x   ({count} batches)")
            if kind == "map-style":
                torch_loader = torch.utils.data.DataLoader(TorchStyle(messages), batch_size=bs, num_workers=workers,
                                                           collate_fn=collate)
            else:
                torch_loader = torch.utils.data.DataLoader(
                    StreamDataset(StreamSource(path), BatchingConfig("none", bs), emit=emit_tensors(collate)),
                    batch_size=None, num_workers=workers)
            secs, count = epoch_time(torch_loader, step, args.step)
            print(f"  {f'torch DataLoader, {workers} workers':<34}{secs:>9.2f}{secs / bound:>7.2f}x   ({count} batches)")
            best_async = results[f"async, {workers} workers"]
            print(f"  goal async within 1.15x: {'met' if best_async <= 1.15 else 'NOT met'} ({best_async:.2f}x)")


if __name__ == "__main__":
    main()
