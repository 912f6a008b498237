"""One supervisor for accelbatch's child processes, and the one error family their failures raise.

:class:`Supervisor` starts N children with :func:`torch.multiprocessing.start_processes` (``join=False``), a
duplex pipe to each; an entry wrapper sets each child up (:class:`ChildSpec`) and reports what ended it (an
exception as a :class:`FailureRecord`, a KeyboardInterrupt's message, the return value). The parent sends,
receives, waits, signals, dumps the children's Python stacks and stops them (a stop request, a grace period,
SIGTERM, SIGKILL; also on garbage collection and at interpreter exit). Children start with SIGINT blocked
(:mod:`accelbatch.held_sigint`): a terminal's Ctrl-C, which reaches the whole process group, cannot interrupt
their start-up (a traceback each); the parent takes it once they are recorded, and stops them. A failure raises a
:class:`ProcessFailure`: :class:`ProcessRaised`, :class:`ProcessDied` or :class:`ProcessTimeout`. Data
workers of other pools report with ``FailureRecord.capture(exc)`` there and ``record.to_error(...)`` here;
:func:`raised_as` turns a failure into what a script catches (the child's exception with its own type).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import dataclasses
import math
import multiprocessing
import os
import pickle
import select
import signal
import sys
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.reduction import ForkingPickler
from pathlib import Path
from typing import Any, NamedTuple

import torch
import torch.multiprocessing as tmp

from accelbatch import forkserver, stack_files
from accelbatch.held_sigint import HeldSigint, holding_sigint
from accelbatch.orphans import end_with_parent, parent_for
from accelbatch.proc_end import Children, end
from accelbatch.proc_errors import (
    SCRIPT_RAN_AGAIN,
    FailureRecord,
    ProcessDied,
    ProcessFailure,
    ProcessRaised,
    ProcessTimeout,
    describe_exit,
    raised_as,
)
from accelbatch.stdout_guard import guarded_stdout

__all__ = ["INTERRUPTED", "STACK_SIGNAL", "Channel", "ChildSpec", "FailureRecord", "ProcessDied", "ProcessFailure",
           "ProcessRaised", "ProcessTimeout", "Supervisor", "describe_exit", "raised_as"]

STACK_SIGNAL = signal.SIGUSR1  # a child started with ChildSpec.stack_dumps writes its Python stacks on it
INTERRUPTED = 130              # exit code of a child that stopped on KeyboardInterrupt (its message was sent)


@dataclasses.dataclass(frozen=True)
class ChildSpec:
    """How a Supervisor's children start. ``label`` names child ``index`` in messages (fields role, index,
    pid, n); ``pipe``: the target is ``target(index, conn, *args)``, else ``target(index, *args)``; ``env`` is
    set while starting (a child takes the parent's environment as it is then) and in the child; ``threads``:
    torch's threads there; :meth:`Supervisor.stop` sends ``stop_request``, then waits ``stop_grace_s`` before
    SIGTERM. ``start_method``: the forkserver where there is one (:mod:`accelbatch.forkserver`), else spawn."""

    role: str
    start_method: str = dataclasses.field(default_factory=forkserver.start_method)
    label: str = "{role} {index} (pid {pid})"
    pipe: bool = False
    ignore_sigint: bool = False
    own_process_group: bool = False
    threads: int | None = 1
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    process_name: str | None = None
    stack_dumps: bool = False
    stop_request: Any = None
    stop_grace_s: float = 3.0
    died_hint: str = ""


class Channel:
    """Both ways between the parent and a child over two one-way pipes (a socket pair is slower)."""

    def __init__(self, reader: Any, writer: Any) -> None:
        self.reader, self.writer = reader, writer
        self.recv, self.recv_bytes, self.poll, self.fileno = reader.recv, reader.recv_bytes, reader.poll, reader.fileno
        self.send, self.send_bytes = writer.send, writer.send_bytes

    def __reduce__(self) -> tuple:
        return Channel, (self.reader, self.writer)

    def close(self) -> None:
        self.reader.close()
        self.writer.close()


class _Report(NamedTuple):
    """From the entry wrapper: "raised" (a FailureRecord), "interrupted" (the message), "result" (pickled)."""

    kind: str
    payload: Any


def _child_main(_: int, index: int, spec: ChildSpec, work: tuple[Callable[..., Any], tuple] | None, conn: Any,
                stack_dir: str | None, parent_pid: int | None, parent: forkserver.ParentState | None) -> None:
    """Every child's entry (under torch's own wrapper): set the process up, run its work (``target`` and
    ``args``: given, or the first message on its pipe), report, exit. ``parent``: what a forkserver's child
    takes from its parent.

    It started with SIGINT blocked (:func:`holding_sigint`): a Ctrl-C that came while it bootstrapped is
    pending. One that ignores SIGINT drops it, and a KeyboardInterrupt there is its code's, reported as an
    exception; another gets it as a KeyboardInterrupt once it runs ``target`` (reported as an interrupt, like
    any later one)."""
    if parent is not None:
        parent.apply()
    end_with_parent(parent_pid)
    if spec.own_process_group:
        os.setpgid(0, 0)
    if spec.ignore_sigint:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # also discards a pending one
    elif isinstance(signal.getsignal(signal.SIGINT), HeldSigint):  # forked while the parent held SIGINT
        signal.signal(signal.SIGINT, signal.getsignal(signal.SIGINT).previous)
    os.environ.update(spec.env)
    if spec.threads:
        torch.set_num_threads(spec.threads)
    if spec.process_name:
        multiprocessing.current_process().name = spec.process_name.format(index=index)
    if stack_dir is not None:
        stack_files.write_on_signal(stack_dir, index, STACK_SIGNAL, f"{spec.role} {index} (pid {os.getpid()}):")
    code, report = 0, None
    try:
        target, args = conn.recv() if work is None else work
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # here: a pending one is an interrupt
        with guarded_stdout():  # a reader that left (| head) or a full disk does not stop the child's work
            result = target(index, conn, *args) if spec.pipe else target(index, *args)
        report = None if result is None else _Report("result", pickle.dumps(result))
    except KeyboardInterrupt as exc:
        if spec.ignore_sigint:  # no Ctrl-C reaches it: its own code raised it, an error like any other
            code, report = 1, _Report("raised", FailureRecord.capture(exc))
        else:
            code, report = INTERRUPTED, _Report("interrupted", str(exc))
    except SystemExit:  # an exit asked for (a SIGTERM handler's sys.exit): its code is the report
        raise
    except BaseException as exc:  # noqa: BLE001 - everything else goes to the parent
        code, report = 1, _Report("raised", FailureRecord.capture(exc))
    with contextlib.suppress(Exception):  # a parent that is gone has nothing to hear
        if report is not None:
            conn.send(report)
        conn.close()
    if spec.start_method in ("spawn", "forkserver"):  # no teardown of an interpreter with torch loaded (and
        # gloo's aborts); a forkserver's child would skip the exit functions, which a spawned one runs
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)
    if code:
        sys.exit(code)


def _torch_errors(context: Any) -> list[Any]:
    """The error files (torch >= 2.1) or error queues (torch 2.0) of a torch ProcessContext."""
    files = getattr(context, "error_files", None)
    return list(files if files is not None else context.error_queues)


def _torch_error_text(where: Any) -> str | None:
    """The traceback torch's wrapper recorded for a child, if any (a pickled file, or a queue)."""
    with contextlib.suppress(Exception):
        if isinstance(where, str):
            if os.path.exists(where):
                with open(where, "rb") as fh:
                    return str(pickle.load(fh))
        elif not where.empty():
            return str(where.get())
    return None


@contextlib.contextmanager
def _starting(spec: ChildSpec) -> Iterator[Callable[[], bool]]:
    """The parent while children start: ``spec.env`` set (the children take it with the environment), SIGINT held
    (:func:`holding_sigint`)."""
    saved = {key: os.environ.get(key) for key in spec.env}
    os.environ.update(spec.env)
    try:
        with holding_sigint(spec.start_method) as interrupted:
            yield interrupted
    finally:
        os.environ.update({key: value for key, value in saved.items() if value is not None})
        for key in (key for key, value in saved.items() if value is None):
            os.environ.pop(key, None)


class Supervisor:
    """``nprocs`` children running ``target`` (see the module docstring and :class:`ChildSpec`).

    ``records``, ``interrupts`` and ``results`` hold what each child reported; ``context`` is the torch
    :class:`~torch.multiprocessing.ProcessContext` of all of them (processes, error files)."""

    def __init__(self, spec: ChildSpec, target: Callable[..., Any], nprocs: int,
                 args: Sequence[Any] = ()) -> None:
        self.spec, self.nprocs = spec, nprocs
        self.records: dict[int, FailureRecord] = {}
        self.interrupts: dict[int, str] = {}
        self.results: list[Any] = [None] * nprocs
        self._inbox: collections.deque[tuple[int, Any]] = collections.deque()
        self._unreadable: dict[int, Exception] = {}  # the first message of each child that could not be read
        self._ended, self._stopped = [False] * nprocs, False
        ctx, pipes = multiprocessing.get_context(spec.start_method), []
        for _ in range(nprocs):
            (up_r, up_w), (down_r, down_w) = ctx.Pipe(duplex=False), ctx.Pipe(duplex=False)
            pipes.append((Channel(up_r, down_w), Channel(down_r, up_w)))
        self._conns, self._open = [parent for parent, _ in pipes], set(range(nprocs))  # open: not at EOF
        stack_dir = stack_files.make_folder(nprocs) if spec.stack_dumps else None
        self._children = Children(spec, self._conns, stack_dir)
        self._finalizer = weakref.finalize(self, end, self._children)
        # a forkserver's child takes its parent's state as it starts, and its work over its pipe: the server
        # takes few descriptors with a start, and a hogwild model's shared tensors are one each
        forked = spec.start_method == "forkserver"
        work, parent_state = (None, forkserver.ParentState()) if forked else ((target, tuple(args)), None)
        try:
            parent_pid = parent_for(spec.start_method)
            with _starting(spec) as interrupted:
                if forked:
                    forkserver.ensure_running()
                for index, (_, child_end) in enumerate(pipes):  # one at a time: a failed start leaks none
                    try:
                        started = tmp.start_processes(
                            _child_main, nprocs=1, join=False, start_method=spec.start_method,
                            args=(index, spec, work, child_end, stack_dir, parent_pid, parent_state))
                    except BrokenPipeError:  # it ended before it read its work: what it printed says why
                        raise self._died_starting(index) from None
                    self._children.processes += started.processes
                    self._children.errors += _torch_errors(started)
                # a Ctrl-C while they started (the forkserver's imports take seconds): its KeyboardInterrupt
                # comes as the SIGINT is let through, and stops children still waiting for their work (quietly:
                # they have set nothing up); a handler that does not raise lets them have it then
                held_back = forked and interrupted()
                if forked and not held_back:
                    self._give_work(target, args)
            if held_back:
                self._give_work(target, args)
        except BaseException:
            self.stop()
            raise
        finally:
            for _, child_end in pipes:  # the children hold theirs: EOF here means the child is gone
                child_end.close()
        self.context = tmp.ProcessContext(self._children.processes, self._children.errors)
        self.pids: list[int] = self.context.pids()
        self._poller = select.poll()  # one poll over every pipe and sentinel: a message or an end wakes it
        self._fds = {conn.fileno(): ("message", i) for i, conn in enumerate(self._conns)}
        self._fds.update({proc.sentinel: ("end", i) for i, proc in enumerate(self._children.processes)})
        for fd in self._fds:
            self._poller.register(fd, select.POLLIN)

    def _give_work(self, target: Callable[..., Any], args: Sequence[Any]) -> None:
        """Send each forked child its work (its first message)."""
        for index, conn in enumerate(self._conns):
            try:
                conn.send((target, tuple(args)))
            except BrokenPipeError:
                raise self._died_starting(index) from None

    def _died_starting(self, index: int) -> ProcessDied:
        """A child that ended before it read its work: what it printed says why."""
        return ProcessDied(f"{self.spec.role} {index} ended while starting (before it read its work; its own "
                           "output above says why)", role=self.spec.role, index=index)

    @property
    def exitcodes(self) -> list[int | None]:
        final = self._children.exitcodes
        return [proc.exitcode for proc in self._children.processes] if final is None else list(final)

    def send(self, index: int, message: Any, raw: bool = False) -> None:
        """Send ``message`` (bytes as they are, with ``raw``) to child ``index``; its failure if gone."""
        if self._stopped:
            raise RuntimeError(f"the {self.spec.role} processes were stopped")
        try:
            (self._conns[index].send_bytes if raw else self._conns[index].send)(message)
        except (OSError, ValueError):  # its end is closed: it ended, or is ending
            raise self.error(index) from None

    def receive(self, timeout: float | None = None) -> tuple[int, Any] | None:
        """The next ``(index, message)`` of any child; None if none came within ``timeout``. Raises the
        ProcessFailure of a child that raised or ended (children that serve messages must not end)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._inbox:
                return self._inbox.popleft()
            if self._stopped:
                raise RuntimeError(f"the {self.spec.role} processes were stopped")
            if self._poll(0):
                continue
            if self.records:  # the one that raised first, else the first that ended or closed its pipe
                raise self.error(min(self.records, key=lambda i: self.records[i].time))
            ended = [i for i in range(self.nprocs) if self._ended[i] or i not in self._open]
            ended += list(self._unreadable)
            if ended:
                raise self.error(ended[0])
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            self._poll(left)

    def wait(self, timeout: float | None = None) -> bool:
        """Collect what the children sent, waiting up to ``timeout`` if nothing had come; True once all have
        ended. Raises nothing (see :meth:`failed`, :meth:`error`)."""
        if not self._stopped and not self._poll(0) and timeout != 0 and not all(self._ended):
            self._poll(timeout)
        return self._stopped or all(self._ended)

    def _poll(self, timeout: float | None) -> bool:
        """Handle what is ready on the pipes and the children's sentinels, waiting up to ``timeout`` for
        something; True if a message came."""
        got = False
        for fd, _ in self._poller.poll(None if timeout is None else math.ceil(timeout * 1000)):
            kind, i = self._fds[fd]
            got |= self._read(i, drain=kind == "end")  # what a child sent before it ended comes first
            if kind == "end":
                self._children.processes[i].join(1.0)  # its exit code (the sentinel may close just before)
                self._ended[i] = True
                self._poller.unregister(fd)
        return got

    def _read(self, i: int, drain: bool) -> bool:
        """Receive one message of child ``i`` (every one that came, with ``drain``); True if one came."""
        got = False
        try:
            while i in self._open and (not got or drain) and (not drain or self._conns[i].poll(0)):
                got, data = True, self._conns[i].recv_bytes()
                try:  # apart from the read: an error here loses this message, not the pipe and what follows
                    message = ForkingPickler.loads(data)
                except Exception as exc:  # noqa: BLE001 - e.g. tensors whose sender has exited: its report follows
                    self._unreadable.setdefault(i, exc)
                    continue
                if not isinstance(message, _Report):
                    self._inbox.append((i, message))
                elif message.kind == "raised":
                    self.records[i] = message.payload
                elif message.kind == "interrupted":
                    self.interrupts[i] = message.payload
                else:
                    try:
                        self.results[i] = pickle.loads(message.payload)
                    except Exception as exc:  # noqa: BLE001 - a result that cannot be rebuilt here is lost
                        self._unreadable.setdefault(i, exc)
        except (EOFError, OSError):
            self._open.discard(i)
            self._poller.unregister(self._conns[i].fileno())
        return got

    def _drain(self, index: int, timeout: float) -> None:
        """Read everything child ``index`` sent up to the end of its pipe, as it has ended or is ending: at
        once once it has exited, else waiting up to ``timeout`` s (a forked sibling may hold the pipe open)."""
        deadline, proc = time.monotonic() + timeout, self._children.processes[index]
        while index in self._open and not self._stopped:
            try:
                exited = proc.exitcode is not None  # then everything it sent is in the pipe
            except ValueError:  # closed by the end under way (a second Ctrl-C): its pipe is closed too
                return
            left = 0.0 if exited else min(0.05, deadline - time.monotonic())
            try:
                ready = self._conns[index].poll(max(0.0, left))
            except (OSError, ValueError):
                return
            if ready:
                self._read(index, drain=True)
            elif exited or time.monotonic() >= deadline:
                return

    def failed(self) -> list[int]:
        """Children that raised, sent what could not be read here, or ended with a non-zero code without a
        KeyboardInterrupt."""
        return [i for i, code in enumerate(self.exitcodes) if i in self.records or i in self._unreadable
                or (self._ended[i] and code != 0 and i not in self.interrupts)]

    def error(self, index: int) -> ProcessFailure:
        """The error for child ``index``'s failure: what it raised, else how it ended."""
        if index not in self.records:
            self._drain(index, 2.0)  # its report comes after what it sent before: read up to it
        pid, record = self.pids[index], self.records.get(index)
        label = self.spec.label.format(role=self.spec.role, index=index, pid=pid, n=self.nprocs)
        text = _torch_error_text(self._children.errors[index]) if record is None else None
        if text:  # it raised before the wrapper could report: torch's record of it
            record = FailureRecord((), text.strip().splitlines()[-1], text)
        if record is not None:
            return record.to_error(self.spec.role, index, pid, name=label)
        if self.exitcodes[index] is None and not self._stopped:
            self._children.processes[index].join(1.0)
        code, lost = self.exitcodes[index], self._unreadable.get(index)
        lost_text = "" if lost is None else f"a message it sent could not be read here ({type(lost).__name__}: {lost})"
        if lost is not None and code in (None, 0):
            return ProcessFailure(f"{label}: {lost_text}", role=self.spec.role, index=index, pid=pid, label=label)
        hint = "" if code == SCRIPT_RAN_AGAIN else self.spec.died_hint
        return ProcessDied(f"{label} {describe_exit(code)}{lost_text and '; ' + lost_text}{hint}",
                           role=self.spec.role, index=index, pid=pid, exitcode=code)

    def timeout_error(self, message: str, indices: Sequence[int] = ()) -> ProcessTimeout:
        """A ProcessTimeout naming the first of ``indices``, with their Python stacks (``stack_dumps``)."""
        role, first = self.spec.role, indices[0] if indices else None
        message += "".join(f"\nWhere {role} {i} is (its Python stack, most recent call first):\n{text}"
                           for i, text in self.dump_stacks(indices).items())
        pid = None if first is None else self.pids[first]
        return ProcessTimeout(message, role=role, index=first, pid=pid)

    def signal(self, signum: int, indices: Sequence[int] | None = None) -> None:
        """Send ``signum`` to the children still running (of ``indices``; default all)."""
        codes = self.exitcodes
        for i in range(self.nprocs) if indices is None else indices:
            if codes[i] is None:
                with contextlib.suppress(OSError):
                    os.kill(self.pids[i], signum)

    def dump_stacks(self, indices: Sequence[int], wait_s: float = 2.0) -> dict[int, str]:
        """The Python stacks of children ``indices`` (those written within ``wait_s``; ``stack_dumps``)."""
        if self._children.stack_dir is None or self._stopped or not indices:
            return {}
        paths = {i: os.path.join(self._children.stack_dir, f"{i}.txt") for i in indices}
        before = {i: os.path.getsize(path) for i, path in paths.items()}
        paths = {i: path for i, path in paths.items() if before[i]}  # one not set up would die of it
        self.signal(STACK_SIGNAL, list(paths))
        deadline = time.monotonic() + wait_s
        while time.monotonic() < deadline and any(os.path.getsize(p) <= before[i] for i, p in paths.items()):
            time.sleep(0.05)
        time.sleep(0.05)  # let the last frames be written
        tails = {i: Path(p).read_bytes()[before[i]:].decode(errors="replace").strip() for i, p in paths.items()}
        return {i: text for i, text in tails.items() if text}

    def stop(self) -> None:
        """Stop every child (see :class:`ChildSpec`) and close the pipes; idempotent. A Ctrl-C meanwhile is
        held until they are stopped, then raised."""
        self._stopped = True
        if threading.current_thread() is not threading.main_thread():
            self._finalizer()
            return
        pending: list[Any] = []
        old = signal.signal(signal.SIGINT, lambda *a: pending.append(a))
        try:
            self._finalizer()
        finally:
            if old is not None:  # None while the interpreter exits (a loader left to its finalizer)
                signal.signal(signal.SIGINT, old)
            if pending:
                raise KeyboardInterrupt

    def __enter__(self) -> "Supervisor":
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
