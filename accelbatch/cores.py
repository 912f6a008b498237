"""The cores this process may use, and how many processes a run may start on them."""

from __future__ import annotations

import os
from typing import Any


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_process_count(flag: str, count: int, what: str, total: int | None = None) -> None:
    """Refuse (OptionError, one line) ``count`` processes of a kind (``what``), or ``total`` processes in all,
    beyond 4 per usable core, and at least 16: more only wait for a core and multiply the memory
    (--num-workers 10**12 started workers until the machine stalled)."""
    from accelbatch.opts import OptionError

    cores = usable_cores()
    most = max(16, 4 * cores)
    if (count if total is None else total) > most:
        fewer = f"give at most {most}" if total is None else f"give fewer, at most {most} processes in all"
        raise OptionError(f"{flag} {count}: starts {count:,} {what}, more than the {most} this process's {cores} "
                          f"cores can run (4 a core, at least 16); {fewer}")


def check_processes(opts: Any) -> None:
    """Refuse a run whose processes together pass :func:`check_process_count`'s limit: ``--num-workers``
    data processes (and the async loader's own), and hogwild processes (``-nt``, on the cpu: elsewhere it is
    refused for the device) or replica processes (``-rf`` on cpu or cuda) each with its own."""
    check_process_count("--num-workers", opts.num_workers, "data processes")
    loaders = opts.num_workers + (opts.dataloader_mode != "sync")  # the async accessor is a process too
    for flag, count, what in (("-nt/--numthreads", opts.numthreads if opts.device == "cpu" else 1,
                               "hogwild processes"),
                              ("-rf/--replication-factor", opts.replication_factor if opts.device != "ipu" else 1,
                               "replica processes")):
        if count > 1:
            check_process_count(flag, count, what)
            total = count * (1 + loaders)
            loader = " and an async loader" if loaders > opts.num_workers else ""
            check_process_count(f"{flag} {count} with --num-workers", opts.num_workers, f"data processes{loader} in "
                                f"each of the {count} {what}, {total:,} processes in all", total)
