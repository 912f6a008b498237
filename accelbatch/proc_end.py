"""Ending a :class:`~accelbatch.procs.Supervisor`'s children: a stop request, a grace period, SIGTERM, 3 s,
SIGKILL; then the children reaped and what they leave behind removed (pipes, error files, stack dumps, the
/dev/shm names of one killed while torch made a segment). The supervisor's finalizer runs :func:`end`, so it
holds :class:`Children`, never the supervisor itself."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing.connection
import os
import shutil
import time
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as tmp

__all__ = ["Children", "end"]


@dataclasses.dataclass
class Children:
    """What stopping the children needs; the finalizer holds it, so it must not refer to the Supervisor."""

    spec: Any  # the ChildSpec they started by
    conns: list[Any]
    stack_dir: str | None
    processes: list[Any] = dataclasses.field(default_factory=list)
    # where torch's wrapper leaves a child's traceback when it raised before ours could report: a file per
    # child (torch >= 2.1) or a queue (torch 2.0, the Poplar SDK's)
    errors: list[Any] = dataclasses.field(default_factory=list)
    exitcodes: list[int | None] | None = None  # once stopped


def end(children: Children) -> None:
    """Stop request, grace, SIGTERM, 3 s, SIGKILL; reap the children, close the pipes, remove the files."""
    procs, spec = children.processes, children.spec
    for conn, proc in zip(children.conns, procs):
        if spec.stop_request is not None and proc.exitcode is None:
            with contextlib.suppress(Exception):
                conn.send(spec.stop_request)
    readers = [conn.reader for conn in children.conns]
    for grace, step in ((spec.stop_grace_s, "terminate"), (3.0, "kill"), (None, None)):
        if grace is not None:  # what they send now goes unread: one blocked on a full pipe reads its stop
            wait_dropping_messages(procs, readers, time.monotonic() + grace)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.join(0.0 if grace is not None else None)
        for proc in procs:
            with contextlib.suppress(Exception):
                if step and proc.exitcode is None:
                    getattr(proc, step)()
    children.exitcodes = [proc.exitcode for proc in procs]
    remove_shared_memory_of([proc.pid for proc in procs if (proc.exitcode or 0) < 0])
    for item in (*children.conns, *procs):
        with contextlib.suppress(Exception):
            item.close()
    for where in children.errors:
        with contextlib.suppress(OSError, AttributeError):
            os.unlink(where) if isinstance(where, str) else where.close()
    if children.stack_dir:
        shutil.rmtree(children.stack_dir, ignore_errors=True)


def wait_dropping_messages(procs: Sequence[Any], readers: list[Any], deadline: float) -> None:
    """Wait until every child of ``procs`` has exited or ``deadline``, reading and dropping what comes on
    ``readers`` meanwhile (a child blocked writing to a full pipe never reads its stop request)."""
    readers = [reader for reader in readers if not reader.closed]
    while (left := deadline - time.monotonic()) > 0:
        try:
            alive = [proc.sentinel for proc in procs if proc.exitcode is None]
        except ValueError:  # closed by an end under way (a second Ctrl-C): nothing left to wait for here
            return
        if not alive:
            return
        for ready in multiprocessing.connection.wait([*readers, *alive], timeout=left):
            if ready in readers:
                try:
                    ready.recv_bytes()
                except (EOFError, OSError):
                    readers.remove(ready)


def remove_shared_memory_of(pids: Sequence[int]) -> None:
    """Remove the /dev/shm names torch made in children killed by a signal. Under the ``file_descriptor``
    strategy a name is unlinked right after it is made (the segment travels as a descriptor), so a name of a
    dead child is one it was killed while making, in use by no process, and would stay until reboot."""
    if not pids or tmp.get_sharing_strategy() != "file_descriptor" or not os.path.isdir("/dev/shm"):
        return
    killed = {str(pid) for pid in pids}
    for name in os.listdir("/dev/shm"):
        if name.startswith("torch_") and name.split("_")[1] in killed:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join("/dev/shm", name))
