"""Tests of accelbatch.data; ``no_leaks`` is the leak check every multi-process test uses."""

from __future__ import annotations

import gc
import multiprocessing
import os
import time

import pytest


def shm_mappings() -> int:
    """How many /dev/shm mappings this process holds (ring buffers, shared tensors, named semaphores)."""
    with open("/proc/self/maps") as f:
        return sum(1 for line in f if "/dev/shm/" in line)


def orphaned_shm(before: set[str]) -> set[str]:
    """/dev/shm entries created since ``before`` that no process maps any more: leaked segments.

    Other test sessions may share /dev/shm; their multiprocessing semaphores (``sem.mp-*``) can sit there
    unmapped until their own resource tracker removes them, so those names are not held against us (a
    semaphore of ours would still be mapped by this process, which :func:`shm_mappings` catches).
    """
    new = {n for n in set(os.listdir("/dev/shm")) - before if not n.startswith("sem.mp-")}
    if not new:
        return set()
    mapped = set()
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                with open(f"/proc/{pid}/maps") as f:
                    mapped.update(line.rsplit("/", 1)[-1].split()[0] for line in f if "/dev/shm/" in line)
            except (OSError, IndexError):
                pass
    return {n for n in new if n not in mapped and os.path.exists(f"/dev/shm/{n}")}


def gone(pid: int, within: float = 10.0) -> bool:
    """True once process ``pid`` has exited (or is a zombie) within ``within`` seconds."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def no_leaks():
    """After the test: no child process left, no shared memory still mapped here, no orphaned segment."""
    gc.collect()
    names, mappings = set(os.listdir("/dev/shm")), shm_mappings()
    yield
    gc.collect()
    deadline = time.monotonic() + 10
    while multiprocessing.active_children() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert multiprocessing.active_children() == []
    # a torch DataLoader's queues (their semaphores are /dev/shm mappings) go when its feeder threads have
    # ended, a moment after its workers: wait for that, then hold what is still mapped against the test
    deadline = time.monotonic() + 5
    while shm_mappings() > mappings and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.05)
    assert shm_mappings() <= mappings
    deadline = time.monotonic() + 3
    while orphaned_shm(names) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert orphaned_shm(names) == set()
