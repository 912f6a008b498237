"""``--host-allocator reuse`` against ``system``: ``accelbatch train`` runs, each in its own process.

For each workload, rounds alternate the two choices (``system`` first in odd rounds, ``reuse`` first in even
ones) and read from each run: minor page faults and peak RSS (``getrusage`` of the finished child: figures
that do not depend on timing), the train row's examples per second, and the report, which must be the same
for both choices (the allocator changes where memory comes from, never a result).

    python bench/host_allocator.py
    python bench/host_allocator.py --rounds 5 --epochs 4
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from typing import Any

WORKLOADS = {
    "bag": ["-m", "bag", "-opt", "sgd", "-lr", "0.5"],
    "conv": ["-m", "conv", "-opt", "sgd", "-lr", "0.05"],
    "memnn": ["-t", "babi:1", "-m", "memnn"],
}


def one_run(workload: list[str], choice: str, epochs: int, episodes: int) -> dict[str, Any]:
    """One ``accelbatch train`` process: its report and what getrusage says of it."""
    with tempfile.TemporaryDirectory() as tmp:
        report_path = os.path.join(tmp, "report.json")
        command = [sys.executable, "-m", "accelbatch", "train", "-t", f"dialogues:{episodes}", "-bs", "32",
                   "--num-epochs", str(epochs), "--eval-splits", "valid", "--no-progress",
                   "--report-json", report_path, "--host-allocator", choice, *workload]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
        env.setdefault("OMP_NUM_THREADS", "1")
        with open(os.path.join(tmp, "log.txt"), "w+") as log:
            child = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
            _, status, usage = os.wait4(child.pid, 0)  # this child's own rusage
            child.returncode = os.waitstatus_to_exitcode(status)
            if child.returncode != 0:
                log.seek(0)
                raise SystemExit(f"{' '.join(command)} failed:\n{log.read()[-2000:]}")
        with open(report_path) as f:
            report = json.load(f)
    return {"report": report, "faults": usage.ru_minflt, "max_rss_mb": usage.ru_maxrss / 1024}


def _train_row(report: dict[str, Any]) -> dict[str, Any]:
    return report.get("train", report)


def _without_timing(report: Any) -> Any:
    """The report without its time figures (``time_s``, ``exs_per_s``: every key ending in ``_s``)."""
    if isinstance(report, dict):
        return {k: _without_timing(v) for k, v in report.items() if not k.endswith("_s")}
    return report


def main(argv: list[str] | None = None) -> dict[str, dict[str, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="bag,conv,memnn", help="comma separated, of " + ", ".join(WORKLOADS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=4000, help="dialogues episodes (bag, conv)")
    args = parser.parse_args(argv)
    unknown = [name for name in args.workloads.split(",") if name not in WORKLOADS]
    if unknown:
        parser.error(f"--workloads: unknown {', '.join(unknown)}; choose from {', '.join(WORKLOADS)} (comma separated)")
    for option in ("rounds", "epochs", "episodes"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} {getattr(args, option)}: give 1 or more")
    print(f"== --host-allocator reuse vs system: accelbatch train, {args.rounds} alternating rounds each ==")
    results = {}
    for name in args.workloads.split(","):
        runs: dict[str, list[dict[str, Any]]] = {"system": [], "reuse": []}
        for r in range(args.rounds):
            for choice in (("system", "reuse") if r % 2 == 0 else ("reuse", "system")):
                runs[choice].append(one_run(WORKLOADS[name], choice, args.epochs, args.episodes))
        reports = {json.dumps(_without_timing(run["report"]), sort_keys=True) for rs in runs.values() for run in rs}
        speeds = {c: [_train_row(run["report"]).get("exs_per_s", float("nan")) for run in rs]
                  for c, rs in runs.items()}
        faults = {c: statistics.median(run["faults"] for run in rs) for c, rs in runs.items()}
        rss = {c: statistics.median(run["max_rss_mb"] for run in rs) for c, rs in runs.items()}
        ratio = statistics.median(a / b for a, b in zip(speeds["reuse"], speeds["system"]))
        print(f"{name:6s} train ex/s reuse/system {ratio:.2f}x (reuse {statistics.median(speeds['reuse']):,.0f}, "
              f"system {statistics.median(speeds['system']):,.0f}); minor faults per run: system "
              f"{faults['system']:,.0f}, reuse {faults['reuse']:,.0f}; peak RSS system {rss['system']:.0f} MB, "
              f"reuse {rss['reuse']:.0f} MB; reports "
              f"{'identical' if len(reports) == 1 else 'DIFFER'}")
        results[name] = {"speed_ratio": ratio, "faults_system": faults["system"], "faults_reuse": faults["reuse"],
                         "rss_system_mb": rss["system"], "rss_reuse_mb": rss["reuse"],
                         "same_reports": float(len(reports) == 1)}
    return results


if __name__ == "__main__":
    main()
