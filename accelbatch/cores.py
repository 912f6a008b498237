"""The cores this process may use, and how many processes a run may start on them."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def check_process_count(flag: str, count: int, what: str) -> None:
    """Refuse (OptionError, one line) ``count`` processes of a kind (``what``) beyond 4 per usable core, and
    at least 16: more only wait for a core and multiply the memory (--num-workers 10**12 started workers until
    the machine stalled)."""
    from accelbatch.opts import OptionError

    cores = usable_cores()
    most = max(16, 4 * cores)
    if count > most:
        raise OptionError(f"{flag} {count}: starts {count:,} {what}, more than the {most} this process's {cores} "
                          f"cores can run (4 a core, at least 16); give at most {most}")
