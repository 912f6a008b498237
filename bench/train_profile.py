"""Where the host's time goes in one ``accelbatch train`` run: the functions with the most own time
(cProfile) and, on a GPU, every place the host waited for the device (torch's sync-debug mode), counted
per call site.

    python bench/train_profile.py --device cuda -- -t babi:1 -m memnn -ne 1 --seed 3
    python bench/train_profile.py --device cuda --syncs -- -t babi:1 -m memnn -tstep 50

Run the same arguments with ``--device cpu`` for the baseline: a small model that trains slower on a GPU
than on the CPU spends the difference in kernel launches and host waits, and this names where.
``--syncs`` runs without the profiler (the sync-debug mode slows every operation it checks).
"""
from __future__ import annotations

import argparse
import collections
import cProfile
import io
import pathlib
import pstats
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def count_syncs(train_args: list[str]) -> tuple[int, collections.Counter[str]]:
    """Run ``accelbatch train`` with torch's sync-debug mode on; return its exit code and the host waits
    by call site."""
    import torch

    from accelbatch.cli import main as cli_main

    sys.path.insert(0, str(ROOT / "bench"))
    from cuda_throughput import sync_debug_sites

    torch.zeros(1, device="cuda")          # CUDA's lazy start is no wait of the run's
    with sync_debug_sites(frames=5) as sites:
        rc = cli_main(["train", *train_args])
    return rc, collections.Counter(sites)


def profile(train_args: list[str], top: int) -> tuple[int, float, str]:
    """Run ``accelbatch train`` under cProfile; return its exit code, wall seconds and the top functions."""
    from accelbatch.cli import main as cli_main

    profiler = cProfile.Profile()
    start = time.perf_counter()
    rc = profiler.runcall(cli_main, ["train", *train_args])
    wall = time.perf_counter() - start
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(top)
    return rc, wall, text.getvalue()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--syncs", action="store_true", help="count host waits by call site (cuda)")
    parser.add_argument("--top", type=int, default=30, help="functions to list (by own time)")
    parser.add_argument("train_args", nargs="*", help="accelbatch train arguments (after --)")
    args = parser.parse_args(argv)
    train_args = [*args.train_args, "--device", args.device, "--no-progress"]
    if args.syncs:
        if args.device != "cuda":
            parser.error("--syncs counts waits for a GPU: use it with --device cuda")
        import torch

        if not torch.cuda.is_available():  # checked here: count_syncs starts CUDA before the run would say why
            from accelbatch.backends.cuda import cuda_unavailable_reason

            parser.error(f"--syncs: {cuda_unavailable_reason()}; run it on a machine with a GPU")
        rc, sites = count_syncs(train_args)
        if rc != 0:  # the run said why in one line; no count of a run that did not happen
            return rc
        print(f"host waits for the GPU: {sum(sites.values())} at {len(sites)} call sites")
        for site, n in sites.most_common(15):
            print(f"{n:8d}  {site}")
        return rc
    rc, wall, text = profile(train_args, args.top)
    if rc != 0:  # the run said why in one line; no profile of a run that did not happen
        return rc
    print(f"accelbatch train on {args.device}: {wall:.2f} s under cProfile\n{text}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
