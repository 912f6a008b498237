"""The one error family of accelbatch's child processes (hogwild processes, replicas, data processes): what a
child raised, how it died, or that it hung; the record a child sends of its failure, which travels by pickle
and rebuilds the exception with its traceback text; and :func:`raised_as`, what a script catches for it."""

from __future__ import annotations

import contextlib
import dataclasses
import pickle
import signal
import time
import traceback
from collections.abc import Sequence
from typing import Any


class ProcessFailure(RuntimeError):
    """A child process failed. ``role`` ("replica", "hogwild process", ...), ``index`` and ``pid`` name it,
    ``label`` says it in words; when it raised: ``error_types`` (its exception's classes, ``module.QualName``,
    most derived first), ``error_message``, ``child_traceback``, and ``child_exception`` when it survived
    pickling."""

    def __init__(self, message: str = "", *, role: str = "process", index: int | None = None,
                 pid: int | None = None, child_traceback: str = "", error_types: Sequence[str] = (),
                 error_message: str | None = None, child_exception: BaseException | None = None,
                 label: str | None = None) -> None:
        super().__init__(message)
        self.role, self.index, self.pid = role, index, pid
        self.label = label or process_label(role, index, pid)
        self.child_traceback, self.child_exception = child_traceback, child_exception
        self.error_types, self.error_message = tuple(error_types), error_message

    def __reduce__(self) -> tuple:
        portable = self.child_exception if _pickled(self.child_exception) is not None else None
        return _rebuild, (type(self), self.args, dict(self.__dict__, child_exception=portable))


def process_label(role: str, index: int | None = None, pid: int | None = None) -> str:
    """A process in words: "hogwild process 1 (pid 123)"."""
    return " ".join(str(p) for p in (role, index, pid and f"(pid {pid})") if p is not None)


class ProcessRaised(ProcessFailure):
    """The child raised an exception; the message holds its traceback."""


class ProcessDied(ProcessFailure):
    """The child ended without a Python traceback (``exitcode``: negative for a signal)."""

    def __init__(self, message: str = "", *, exitcode: int | None = None, **names: Any) -> None:
        super().__init__(message, **names)
        self.exitcode = exitcode


class ProcessTimeout(ProcessFailure, TimeoutError):
    """The child gave no answer in time (it hangs, or is stuck in a collective)."""


def _rebuild(cls: type, args: tuple, state: dict) -> ProcessFailure:
    error = cls(*args)
    error.__dict__.update(state)
    return error


def _pickled(obj: Any) -> bytes | None:
    """``obj`` pickled, or None when it does not survive the round trip."""
    try:
        data = pickle.dumps(obj)
        pickle.loads(data)
        return data
    except Exception:  # noqa: BLE001 - any failure means: send the text only
        return None


# exit code of a child process that found itself running the parent's script (main_guard.refuse_script_rerun)
SCRIPT_RAN_AGAIN = 86
UNGUARDED_SCRIPT = ("the script that started it has no `if __name__ == \"__main__\":` guard: a child process "
                    "imports the script to start (Python's spawn and forkserver start methods) and would run its "
                    "top-level code (create_world, run) again; put that code under the guard")


def describe_exit(exitcode: int | None) -> str:
    """How a process ended: "exited with code 3", "was killed by signal 9 (SIGKILL)"."""
    if exitcode == SCRIPT_RAN_AGAIN:
        return f"could not start: {UNGUARDED_SCRIPT}"
    if exitcode is None or exitcode >= 0:
        return "stopped answering (its pipe closed)" if exitcode is None else f"exited with code {exitcode}"
    name = signal.Signals(-exitcode).name if -exitcode in signal.valid_signals() else "?"
    return f"was killed by signal {-exitcode} ({name})"


@dataclasses.dataclass(frozen=True)
class FailureRecord:
    """An exception in a child in a picklable form: sent to the parent, which raises :meth:`to_error`."""

    error_types: tuple[str, ...]
    error_message: str
    traceback: str
    exception: bytes | None = None  # the pickled exception; None when it does not survive pickling
    time: float = dataclasses.field(default_factory=time.time)  # which of several failures came first

    @classmethod
    def capture(cls, exc: BaseException, traceback_text: str | None = None) -> FailureRecord:
        """The record of ``exc``; a ProcessFailure passed on keeps its own child's types and traceback, and so
        does a child's exception re-raised here by :func:`raised_as` (its failure is passed on)."""
        cause = exc.__cause__
        if isinstance(cause, ProcessRaised) and cause.child_exception is exc:
            exc = cause
        if isinstance(exc, ProcessFailure) and exc.error_types:
            types, message, text = exc.error_types, exc.error_message or "", exc.child_traceback
        else:
            types = tuple(f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__ if c is not object)
            message, text = str(exc), "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        return cls(types, message, traceback_text or text, _pickled(exc))

    @property
    def summary(self) -> str:
        """``Type: message``."""
        kind = self.error_types[0].rsplit(".", 1)[-1] if self.error_types else ""
        return f"{kind}: {self.error_message}" if kind and self.error_message else kind or self.error_message

    def load_exception(self) -> BaseException | None:
        with contextlib.suppress(Exception):  # e.g. its class cannot be imported here
            exc = None if self.exception is None else pickle.loads(self.exception)
            return exc if isinstance(exc, BaseException) else None
        return None

    def to_error(self, role: str, index: int | None = None, pid: int | None = None, *,
                 name: str | None = None, message: str | None = None, chain: bool = True) -> ProcessRaised:
        """The ProcessRaised to raise here: ``name`` names the process in the message (default "role index
        (pid P)"), ``message`` replaces the whole text; ``chain`` sets the exception as ``__cause__``."""
        child, label = self.load_exception(), name or process_label(role, index, pid)
        if message is None:
            message = f"{label} raised {self.summary}\n\nIts traceback:\n{self.traceback.rstrip()}"
        error = ProcessRaised(message, role=role, index=index, pid=pid, child_traceback=self.traceback,
                              error_types=self.error_types, error_message=self.error_message,
                              child_exception=child, label=label)
        if chain and child is not None:
            error.__cause__ = child
        return error


def raised_as(failure: ProcessFailure, where: str | None = None) -> BaseException:
    """What to raise for a child's ``failure``, so that a script catches what it would in one process: the
    exception the child raised, its own type, with the child's traceback as a note (``where`` names the
    process there; default ``failure.label``) and ``failure`` as its cause. A ProcessFailure the child passed
    on (its own child's) is resolved the same way. ``failure`` itself when the exception did not survive
    pickling, or is not an Exception: a KeyboardInterrupt from a child, which ignores SIGINT, was raised by
    its code, and raised here it would be taken for a Ctrl-C."""
    exc = failure.child_exception
    if isinstance(exc, ProcessFailure):
        return raised_as(exc)
    if not isinstance(failure, ProcessRaised) or not isinstance(exc, Exception):
        return failure
    notes = getattr(exc, "__notes__", [])
    tb = failure.child_traceback.rstrip()
    if tb and not any(tb in note for note in notes):  # not twice: a process on the way re-raised it so
        note = f"(raised in {where or failure.label}; its traceback:)\n{tb}"
        if hasattr(exc, "add_note"):
            exc.add_note(note)
        else:  # Python < 3.11 (the Poplar SDK's 3.8): the notes are kept, tracebacks do not print them
            exc.__notes__ = [*notes, note]
    failure.__cause__ = None  # it is the cause now: no cycle
    exc.__cause__ = failure
    return exc


__all__ = ["SCRIPT_RAN_AGAIN", "FailureRecord", "ProcessDied", "ProcessFailure", "ProcessRaised", "ProcessTimeout",
           "UNGUARDED_SCRIPT", "describe_exit", "process_label", "raised_as"]
