"""How long accelbatch's child processes (replicas, hogwild processes, the async data worker) take to start,
started with Python's spawn vs forked from the forkserver (accelbatch.forkserver), as ratios from one run.

Each child does what a replica or hogwild process does before its first step: imports accelbatch's worlds
and agents, builds a model and an optimizer and takes one step (which imports torch._dynamo), then reports
ready. A round starts N children and times until all are ready; spawn is timed first, then the forkserver
cold (its own start and imports included: a run's first children) and warm (a later start in the same run,
as a validation's or a resumed run's, or the next test of a suite).

    .venv/bin/python bench/process_start.py [--children 2] [--rounds 3]

Also reported: the seconds of CPU the children took (spawn: their own; forkserver: the server's imports once,
then each child's own), from /proc, which does not depend on what else the machine runs.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

from accelbatch import forkserver
from accelbatch.held_sigint import holding_sigint
from accelbatch.procs import ChildSpec, Supervisor

TICKS = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User + system CPU of a live process, from /proc."""
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICKS


def ready_child(index: int, conn) -> None:
    """Set up as a replica does before its first step, say so with the CPU it took, wait to be stopped."""
    import torch

    import accelbatch.agents  # noqa: F401 - what a replica imports
    import accelbatch.worlds  # noqa: F401

    model = torch.nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(4, 8)).sum().backward()
    optimizer.step()  # the first step imports torch._dynamo
    conn.send(("ready", cpu_seconds(os.getpid())))
    conn.recv()


def start_round(method: str, children: int) -> tuple[float, float]:
    """Seconds until ``children`` children started by ``method`` are all ready, and their CPU seconds."""
    spec = ChildSpec(role="bench child", start_method=method, pipe=True, stop_request="stop", stop_grace_s=5.0)
    began = time.perf_counter()
    with Supervisor(spec, ready_child, children) as sup:
        cpu = 0.0
        for _ in range(children):
            _, (_, seconds) = sup.receive(120)
            cpu += seconds
        took = time.perf_counter() - began
    return took, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--children", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    for option in ("children", "rounds"):
        if getattr(args, option) < 1:
            parser.error(f"--{option} {getattr(args, option)}: give 1 or more")
    spawn = [start_round("spawn", args.children) for _ in range(args.rounds)]
    with holding_sigint("forkserver"):
        forkserver.ensure_running()  # returns at once: the first round waits for the server's imports
    cold = start_round("forkserver", args.children)
    cold_s, server_cpu = cold[0], cpu_seconds(forkserver_pid())
    warm = [start_round("forkserver", args.children) for _ in range(args.rounds)]

    def median(rounds: list[tuple[float, float]], i: int) -> float:
        return statistics.median(r[i] for r in rounds)

    print(f"{args.children} children, {args.rounds} rounds each (medians); 'ready' = imports + model, optimizer, "
          "one step")
    print(f"spawn:             {median(spawn, 0):6.2f} s to ready, children's CPU {median(spawn, 1):6.2f} s")
    print(f"forkserver, cold:  {cold_s:6.2f} s to ready (server start and imports: CPU {server_cpu:.2f} s, once "
          f"per process), children's CPU {cold[1]:6.2f} s")
    print(f"forkserver, warm:  {median(warm, 0):6.2f} s to ready, children's CPU {median(warm, 1):6.2f} s")
    print(f"ratios spawn / forkserver: time to ready cold {median(spawn, 0) / cold_s:.2f}x, "
          f"warm {median(spawn, 0) / median(warm, 0):.2f}x; CPU incl. the server's imports, cold "
          f"{median(spawn, 1) / (cold[1] + server_cpu):.2f}x, "
          f"warm {median(spawn, 1) / max(median(warm, 1), 1e-3):.2f}x")


def forkserver_pid() -> int:
    """The pid of this process's forkserver."""
    from multiprocessing import forkserver as mp_forkserver

    return mp_forkserver._forkserver._forkserver_pid  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()
