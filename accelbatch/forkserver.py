"""The forkserver accelbatch's child processes start from, where the platform has one (Linux, macOS).

A ``spawn`` child is a new interpreter that imports torch again (1.5-3 s of CPU) and, at its first optimizer
step, torch._dynamo (as much again). The forkserver imports them once per process (:data:`PRELOAD`); each
child forks from it in milliseconds and shares those pages. Like spawn, and unlike ``fork``, a child gets
none of the caller's threads, locks or CUDA context, and imports the caller's ``__main__`` script again.

A forked child starts from the server's state as it was when the server started, not from its parent's
now: :class:`ParentState` carries the parent's environment and standard output and error as they are when
the child starts (a variable set since, a test's captured output), and the supervisor sends each child its
work over its pipe (any number of shared tensors; the server takes at most 252 descriptors with a start).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
from multiprocessing import forkserver, reduction
from typing import Any

from accelbatch.orphans import parent_for

__all__ = ["PRELOAD", "ParentState", "ensure_running", "start_method"]

# what the server imports once: first the module that makes it end with its starter (SERVER_PARENT), then
# torch, what its first optimizer step imports, and the modules accelbatch's children run (replicas and
# hogwild processes import the rest of the core through these)
PRELOAD = ["accelbatch.forkserver_start", "torch", "torch._dynamo", "torch.distributed", "accelbatch.procs",
           "accelbatch.data.accessor", "accelbatch.worlds", "accelbatch.agents"]
SERVER_PARENT = "ACCELBATCH_FORKSERVER_PARENT"  # set while the server starts: the pid it ends with


def start_method() -> str:
    """"forkserver" where the platform has it, else "spawn"."""
    return "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"


def ensure_running() -> None:
    """Start this process's forkserver with :data:`PRELOAD` if it is not running. (The preload list is
    process-wide and read when the server starts: one started by other code keeps its own.) The caller holds
    SIGINT meanwhile (:func:`accelbatch.held_sigint.holding_sigint`): the server and every child inherit it blocked.

    The server starts with SIGTERM blocked too: it is in the caller's process group, and a SIGTERM to the
    whole group (a scheduler's, ``kill -TERM -PGID``) must reach the caller, which stops its children as it
    chooses (a checkpoint first), not end the server and, with it, every child. Children unblock it
    (:meth:`ParentState.apply`).

    And it ends with the caller (:mod:`accelbatch.forkserver_start`, where started from the main thread,
    whose end is the process's): left to itself it would end only once it noticed the caller gone and then
    tore down an interpreter with torch loaded (0.9-1.5 s on a quiet machine, more under load), and the children
    end with the server."""
    multiprocessing.get_context("forkserver").set_forkserver_preload(PRELOAD)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    parent = parent_for("spawn")  # the server is a spawned child of this process
    if parent:
        os.environ[SERVER_PARENT] = str(parent)
    try:
        forkserver.ensure_running()
    finally:
        os.environ.pop(SERVER_PARENT, None)
        if signal.SIGTERM not in blocked:
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


def _standard_fd(fd: int) -> Any:
    """``fd`` wrapped to reach a child being started (None when closed here)."""
    try:
        os.fstat(fd)
    except OSError:
        return None
    return reduction.DupFd(fd)


class ParentState:
    """The parent's environment, standard output and error and default start method, as they are when a forked
    child starts: pickled with the child's start (the descriptors go with it), applied there by :meth:`apply`."""

    def __init__(self, env: dict[str, str] | None = None, stdout: Any = None, stderr: Any = None,
                 start_method: str | None = None) -> None:
        self.env, self.stdout, self.stderr, self.start_method = env, stdout, stderr, start_method

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return ParentState, (dict(os.environ), _standard_fd(1), _standard_fd(2),
                             multiprocessing.get_start_method(allow_none=True))

    def apply(self) -> None:
        """In the child: the parent's environment replaces the server's, its fds 1 and 2 the server's, SIGTERM
        is unblocked, the server's keep-alive pipe is let go (:func:`_let_server_go`), and the default start
        method is the parent's (a server's child has "forkserver": a DataLoader's workers there would start
        a server of its own, which outlives a killed child, their deaths seen only at --data-timeout-s)."""
        _let_server_go()
        multiprocessing.set_start_method(self.start_method, force=True)  # type: ignore[arg-type]  # None: unset
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})  # blocked in the server only
        if self.env is not None:
            os.environ.clear()
            os.environ.update(self.env)
        for target, wrapped in ((1, self.stdout), (2, self.stderr)):
            if wrapped is not None:
                fd = wrapped.detach()
                with contextlib.suppress(OSError):
                    os.dup2(fd, target)
                os.close(fd)


def _let_server_go() -> None:
    """In a forked child: close the server's keep-alive pipe, which every child inherits (to start processes
    from the same server). The server ends when that pipe has no writer left; a child holding it would keep
    the server alive after a killed parent, and itself with it (it ends with the server: PDEATHSIG). A child
    that starts processes of its own starts a server of its own."""
    server = getattr(forkserver, "_forkserver", None)
    fd = getattr(server, "_forkserver_alive_fd", None)
    if fd is not None and getattr(server, "_forkserver_pid", 0) is None:  # forked: no server of its own yet
        with contextlib.suppress(OSError):
            os.close(fd)
        server._forkserver_alive_fd = None  # type: ignore[union-attr]
