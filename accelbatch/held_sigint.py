"""Holding SIGINT while child processes start, so that a terminal's Ctrl-C (which reaches the whole process
group) cannot interrupt a child's start-up, nor the parent between starting a child and recording it; and
starting the forkserver that way."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker
from typing import Any

from accelbatch import forkserver

__all__ = ["HeldSigint", "holding_sigint", "start_forkserver"]

class HeldSigint:
    """The SIGINT handler while :func:`holding_sigint`: it notes the signal (``previous`` gets it later)."""

    def __init__(self, previous: Any) -> None:
        self.previous, self.received = previous, False

    def __call__(self, signum: int, frame: Any) -> None:
        self.received = True


@contextlib.contextmanager
def holding_sigint(start_method: str | None = None) -> Iterator[Callable[[], bool]]:
    """While processes start: SIGINT is blocked in this thread and, in the main thread, a SIGINT that comes
    meanwhile is held and delivered (to the handler there was) at the end.

    What starts meanwhile inherits the blocked signal (a spawn child through exec, a forkserver and so every
    process it forks), so a terminal's Ctrl-C, which reaches the whole foreground process group, cannot
    interrupt a child while it bootstraps (imports torch, unpickles its work: tracebacks, a half-read
    message); :func:`_child_main` decides what a pending one means once the child is set up. The parent is
    not interrupted between starting a child and recording it either (that child would be leaked), nor
    while it sends a child its work; the Ctrl-C is not lost: it is raised when the children are recorded.
    (Where SIGINT is ignored it stays so, and the children inherit that.) ``start_method``: how they start
    ("spawn" and "forkserver" need multiprocessing's resource tracker, started first). It gives a function
    telling whether a SIGINT came meanwhile (pending, or held: another thread may have taken it)."""
    main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if main else None
    held = HeldSigint(previous) if previous not in (None, signal.SIG_IGN) else None
    if held is not None:
        signal.signal(signal.SIGINT, held)
    if start_method in ("spawn", "forkserver"):  # the tracker unblocks SIGINT after it starts: start it first
        with contextlib.suppress(Exception):
            resource_tracker.ensure_running()
    was_blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield lambda: signal.SIGINT in signal.sigpending() or held is not None and held.received
    finally:
        if not was_blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # a pending one: to ``held`` now
        if held is not None:
            signal.signal(signal.SIGINT, previous)
            if held.received:
                signal.raise_signal(signal.SIGINT)  # as it would have been handled (KeyboardInterrupt, a flag)


def start_forkserver() -> None:
    """Start the forkserver children fork from (:mod:`accelbatch.forkserver`) now, where there is one: its
    imports then overlap the caller's own start-up instead of delaying its first child. SIGINT is held
    meanwhile (:func:`holding_sigint`): the server and what it forks inherit it blocked, so a Ctrl-C cannot
    interrupt their imports (the server ignores it once they are done)."""
    if forkserver.start_method() == "forkserver":
        with holding_sigint("forkserver"):
            forkserver.ensure_running()
