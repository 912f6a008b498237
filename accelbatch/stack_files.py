"""Files where supervised child processes write their Python stacks when asked (faulthandler on a signal).

A supervisor makes one folder per set of children, named after its own pid, and removes it when they end.
A parent killed by SIGKILL runs no cleanup: the next supervisor removes the folders of parents that no longer
run.
"""

from __future__ import annotations

import faulthandler
import os
import shutil
import tempfile
from pathlib import Path

PREFIX = "accelbatch-stacks-"


def make_folder(nprocs: int) -> str:
    """A new folder holding an empty stack file per child (``{index}.txt``); first the folders that parents
    no longer running left are removed."""
    for path in Path(tempfile.gettempdir()).glob(f"{PREFIX}*-*"):
        owner = path.name[len(PREFIX):].split("-")[0]
        if owner.isdigit() and not _running(int(owner)) and path.stat().st_uid == os.getuid():
            shutil.rmtree(path, ignore_errors=True)
    folder = tempfile.mkdtemp(prefix=f"{PREFIX}{os.getpid()}-")
    for index in range(nprocs):
        open(os.path.join(folder, f"{index}.txt"), "w").close()
    return folder


def write_on_signal(folder: str, index: int, signum: int, header: str) -> None:
    """In child ``index``: write every thread's stack to its file on ``signum`` (the header first, so that a
    non-empty file says the child is ready to be asked)."""
    stacks = open(os.path.join(folder, f"{index}.txt"), "a")  # noqa: SIM115 - faulthandler keeps it open
    faulthandler.register(signum, stacks, all_threads=True)
    print(header, file=stacks, flush=True)


def _running(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True
