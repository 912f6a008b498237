"""Expensive reference runs shared by the tests of one pytest session, across its xdist workers.

A kill-and-resume test compares its resumed run with an uninterrupted one; where several tests (or
parameter sets) would run the same uninterrupted command, :func:`shared_dir` runs it once per session and
hands every caller the same folder. The key names the command (its arguments): callers that pass the same
key must build the same thing.
"""

from __future__ import annotations

import fcntl
import hashlib
from collections.abc import Callable
from pathlib import Path

import pytest


def _session_root(factory: pytest.TempPathFactory) -> Path:
    """A folder every worker of this session sees: the parent of the workers' base temp folders under xdist
    (each worker's basetemp is <session>/popen-gwN), the base temp folder otherwise."""
    base = factory.getbasetemp()
    root = base.parent if base.name.startswith("popen-gw") else base
    folder = root / "shared-runs"
    folder.mkdir(exist_ok=True)
    return folder


def shared_dir(factory: pytest.TempPathFactory, key: str, build: Callable[[Path], None]) -> Path:
    """The folder ``build(folder)`` filled for ``key``: built by the first caller of the session (under a
    file lock, so a second worker waits for it rather than building it again), reused by the others. A
    build that fails leaves no folder, so the next caller builds it again (and fails the same way)."""
    root = _session_root(factory)
    name = hashlib.sha1(key.encode()).hexdigest()[:16]
    folder, done = root / name, root / f"{name}.done"
    with open(root / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not done.exists():
                if folder.exists():  # a failed build's leftovers
                    import shutil

                    shutil.rmtree(folder)
                folder.mkdir()
                build(folder)
                done.write_text(key)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return folder
