"""Generation benchmark: the bundled generator's training and evaluation speed, side by side in one run.

Training examples/s of ``-m transformer/generator`` with ``--dynamic-batching full`` vs ``none`` (the same
steps' worth of examples), and evaluation examples/s with greedy decoding vs the teacher-forced loss only
(``--skip-generation``), each run in its own process so its peak RSS is its own (``os.wait4``). Ratios are
against the first row of each pair, measured in the same run.

    .venv/bin/python bench/generation.py [-t reverse:4000] [--steps 100] [-bs 32]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args: list[str]) -> tuple[dict, float]:
    """(report, peak RSS in MiB) of one ``accelbatch`` run in a child process."""
    with tempfile.TemporaryDirectory() as tmp:
        report = Path(tmp) / "report.json"
        env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
        proc = subprocess.Popen([sys.executable, "-m", "accelbatch", *args, "--no-progress", "--report-json",
                                 str(report)], cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)
        if proc.returncode != 0:
            raise SystemExit(f"accelbatch {' '.join(args)} failed with exit code {proc.returncode}")
        return json.loads(report.read_text()), usage.ru_maxrss / 1024


BASELINES = ("--dynamic-batching none", "greedy decoding")  # each pair's first row, which its ratios divide by


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-t", "--task", default="reverse:4000")
    parser.add_argument("--steps", type=int, default=100, help="training steps of the model evaluated")
    parser.add_argument("-bs", "--batchsize", type=int, default=32)
    parser.add_argument("--label-truncate", type=int, default=16)
    a = parser.parse_args(argv)
    common = ["-m", "transformer/generator", "-t", a.task, "-bs", str(a.batchsize), "--label-truncate",
              str(a.label_truncate), "--eval-splits", "", "-veps", "-1"]
    rows = []
    for name, extra in (("train 1 epoch, batches of -bs rows", ["--dynamic-batching", "none"]),
                        ("train 1 epoch, token budget (full)", ["--dynamic-batching", "full"])):
        rep, rss = run(["train", *common, *extra, "-ne", "1"])
        train = rep["train"]
        rows.append((name, train["exs"], train["exs_per_s"], rss))
    with tempfile.TemporaryDirectory() as tmp:
        model = str(Path(tmp) / "m.pt")
        run(["train", *common, "-tstep", str(a.steps), "-mf", model])
        for name, extra in (("eval, greedy decoding", []), ("eval, loss only (--skip-generation)",
                                                             ["--skip-generation"])):
            rep, rss = run(["eval", *common[:-4], "-dt", "valid", "-mf", model, *extra])
            valid = rep["valid"]
            rows.append((name, valid["exs"], valid["exs"] / valid["time_s"], rss))
    # the ratio column: exs/s over the first row of its pair (training: dynamic batching none; evaluation:
    # greedy decoding), named on each row
    print(f"{'run':38} {'exs':>7} {'exs/s':>9}  {'exs/s ratio vs':<29} {'peak RSS MiB':>12}")
    for i, (name, exs, speed, rss) in enumerate(rows):
        ratio = speed / rows[i - i % 2][2]
        print(f"{name:38} {exs:7d} {speed:9.1f}  {f'{ratio:.2f}x {BASELINES[i // 2]}':<29} {rss:12.0f}")


if __name__ == "__main__":
    main()
