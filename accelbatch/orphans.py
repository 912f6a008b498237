"""Children that end with their parent: a run killed by SIGKILL (the OOM killer, ``kill -9``, a scheduler's
hard limit) cannot stop its children itself, so each child asks the kernel to end it when its parent ends."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import threading

__all__ = ["end_with_parent", "parent_for"]

_PR_SET_PDEATHSIG = 1  # prctl(2)


def end_with_parent(parent_pid: int | None) -> None:
    """In a child: on Linux the kernel SIGKILLs this process when its parent ends (prctl's PR_SET_PDEATHSIG),
    so a run killed by SIGKILL leaves no child behind: a data worker blocked writing to a pipe nobody reads
    would never notice, a hogwild process would train on to its end. ``parent_pid``: the process that started
    this one (fork, spawn), which, if already gone, ends this one now; 0: whichever parent it has (a
    forkserver's child: the forkserver ends with the run); None: nothing (started from a thread other than the
    main one, whose end, not the process's, would fire the signal). Elsewhere than Linux nothing either."""
    if parent_pid is None or not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if parent_pid and os.getppid() != parent_pid:  # it ended before the request took hold
        os.kill(os.getpid(), signal.SIGKILL)


def parent_for(start_method: str) -> int | None:
    """What :func:`end_with_parent` takes in a child this thread starts by ``start_method``."""
    if threading.current_thread() is not threading.main_thread():
        return None
    return 0 if start_method == "forkserver" else os.getpid()
