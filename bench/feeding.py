"""Feeding benchmark: can the loader keep a model step busy when preprocessing costs as much as the step?

Each batch needs ``--load-ms`` of CPU preprocessing (per-row vectorize, then batchify) and the simulated model
step takes ``--step-ms``. ``--step sleep`` (default) models an accelerator: the host is idle while the device
computes; ``--step spin`` burns host CPU instead. The bound is max(load time, compute time) of an epoch: the
load time is measured by producing every batch serially in this process, the compute time is
batches x step. Every loader's epoch time is printed as a ratio to that bound (1.00 = perfect overlap;
about 2 = no overlap). Data workers: ``--workers`` (the same for every loader, torch's DataLoader included).
Every loader runs ``--repeats`` times (a fresh loader each time), each run judged against a bound measured
just before it; the median ratio is reported (all of them are printed), which keeps the noise of other
processes sharing the machine out of the comparison as far as it can be.
Data in memory and the same data read on demand from a JSONL file (``-dt ...:stream``) are both measured;
every loader serves the same steps (the schedule's), so the variants differ only in where a batch is built.

    .venv/bin/python bench/feeding.py [--batches 60] [--load-ms 20] [--step-ms 20] [--workers 1] [--step spin]

Goal: async within 1.10x of the bound on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from accelbatch.data import make_loader  # noqa: E402
from accelbatch.messages import Message  # noqa: E402


def spin(seconds: float) -> None:
    """Burn ``seconds`` of this thread's CPU time (real work: slower in wall time when cores are shared)."""
    end = time.thread_time() + seconds
    x = 0
    while time.thread_time() < end:
        x += 1


class CostlyCollate:
    """An agent's vectorize (CPU work per row) and batchify (padding); picklable, so it runs in workers."""

    def __init__(self, row_seconds: float, how: str = "spin"):
        self.row_seconds, self.how = row_seconds, how

    def vectorize(self, msg: Message) -> Message:
        (spin if self.how == "spin" else time.sleep)(self.row_seconds)
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


def make_messages(n: int) -> list[Message]:
    return [Message({"text": f"example {i} " + "word " * (5 + i % 20), "labels": [f"a{i}"], "episode_done": True})
            for i in range(n)]


def rows_for(batches: int, batchsize: int) -> int:
    """Rows of the data: a warm-up batch, then ``batches`` full batches that the epoch times."""
    return (batches + 1) * batchsize


def verdict(ratio: float, goal: float = 1.10) -> str:
    """The goal line's word for a median ratio of epoch time to max(load, compute)."""
    if ratio < 1.0:  # no loader beats the bound: the serial load time it was measured against ran slow
        return "below the bound: the bound's measurement was noisy, rerun"
    return "met" if ratio <= goal else "NOT met"


def epoch_time(loader, step: float, mode: str) -> tuple[float, int]:
    """Time of one epoch with a simulated step per batch, after a warm-up batch and its step (process start
    is excluded; the timed part is the batches the bound counts); the time and the batches timed."""
    it = iter(loader)
    next(it)
    (spin if mode == "spin" else time.sleep)(step)
    n = 0
    start = time.perf_counter()
    for _ in it:
        (spin if mode == "spin" else time.sleep)(step)
        n += 1
    return time.perf_counter() - start, n


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--batchsize", type=int, default=16)
    parser.add_argument("--load-ms", type=float, default=20.0, help="preprocessing per batch")
    parser.add_argument("--step-ms", type=float, default=20.0, help="simulated model step per batch")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--step", choices=("sleep", "spin"), default="sleep")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--load", choices=("spin", "sleep"), default="spin",
                        help="preprocessing as CPU work (spin) or as waiting, e.g. on I/O (sleep)")
    args = parser.parse_args(argv)
    for option in ("batches", "batchsize", "repeats"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} {getattr(args, option)}: give 1 or more")
    for option in ("workers", "load_ms", "step_ms"):
        if getattr(args, option) < 0:
            parser.error(f"--{option.replace('_', '-')} {getattr(args, option):g}: give 0 or more")
    torch.set_num_threads(1)
    bs = args.batchsize
    messages = make_messages(rows_for(args.batches, bs))
    collate = CostlyCollate(args.load_ms / 1000 / bs, args.load)
    step = args.step_ms / 1000
    workers = args.workers

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "data.jsonl")
        with open(path, "w") as f:
            for m in messages:
                f.write(json.dumps(dict(m)) + "\n")
        print(f"{args.batches} batches of {bs} rows; preprocessing {args.load_ms:g} ms ({args.load}) and model "
              f"step {args.step_ms:g} ms ({args.step}) per batch; {workers} data worker(s); {os.cpu_count()} cores; "
              f"load average {os.getloadavg()[0]:.1f}")
        for kind, data in (("map-style", messages), ("stream", path)):
            names = ["sync, 0 workers (no overlap)", f"sync, {workers} workers", "async, 0 workers",
                     f"async, {workers} workers"]
            kwargs: list[dict | None] = [dict(mode="sync", num_workers=0), dict(mode="sync", num_workers=workers),
                                         dict(mode="async", num_workers=0), dict(mode="async", num_workers=workers)]
            if kind == "map-style":  # the plain torch way, for comparison
                names.append(f"torch DataLoader, {workers} workers")
                kwargs.append(None)
            ratios: dict[str, list[float]] = {n: [] for n in names}
            times: dict[str, list[float]] = {n: [] for n in names}
            bounds = []
            for _ in range(args.repeats):
                # the bound, measured next to the runs it judges: serial load time vs compute time
                with make_loader(data, collate=collate, training=False, batch_size=bs, num_workers=0) as serial:
                    it = iter(serial)
                    next(it)
                    start = time.perf_counter()
                    loaded = sum(1 for _ in it)
                    load = time.perf_counter() - start
                bound = max(load, loaded * step)
                bounds.append((load, loaded * step))
                for name, kw in zip(names, kwargs):
                    if kw is None:
                        loader = torch.utils.data.DataLoader(TorchStyle(messages), batch_size=bs, num_workers=workers,
                                                             collate_fn=collate)
                        secs = epoch_time(loader, step, args.step)[0]
                    else:
                        with make_loader(data, collate=collate, training=False, batch_size=bs, **kw) as loader:
                            secs = epoch_time(loader, step, args.step)[0]
                    times[name].append(secs)
                    ratios[name].append(secs / bound)
            load, compute = statistics.median(b[0] for b in bounds), statistics.median(b[1] for b in bounds)
            print(f"\n{kind}: load {load:.2f} s, compute {compute:.2f} s (medians; {loaded} batches after a "
                  f"warm-up batch); ratio = epoch time / max(load, compute) measured next to it")
            print(f"  {'loader':<34}{'epoch s':>9}{'ratio':>8}   all ratios")
            for name in names:
                r = statistics.median(ratios[name])
                print(f"  {name:<34}{statistics.median(times[name]):>9.2f}{r:>7.2f}x   "
                      + " ".join(f"{x:.2f}" for x in ratios[name]))
            for name in ("async, 0 workers", f"async, {workers} workers"):
                r = statistics.median(ratios[name])
                print(f"  goal {name} within 1.10x: {verdict(r)} ({r:.2f}x)")


if __name__ == "__main__":
    main()
