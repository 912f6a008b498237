"""Standard output and error for the command line: what cannot be written there never stops the work.

A reader that stops reading (``accelbatch train ... | head -1``) makes the next write a BrokenPipeError, and a
full disk (``> /dev/full``, ``> log 2>&1``) an OSError: raised inside a training step, either ended the run
unsaved with a traceback. While :func:`guarded_stdout` holds, such an output is dropped (stdout's full disk
said once on stderr; ``sys.stdout.lost`` says it, so a listing can stop) and the run goes on to save its model
and write its report files; :func:`stdout_write_error` then tells the command line to exit 1 (a reader that
left is no error: ``| head`` exits 0). A closed stderr (``2>&-``) is os.devnull while it holds. Text stdout's
encoding cannot hold (é or 中文 under a Latin-1 or C locale) is printed as escapes."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any, Iterator, TextIO

_failed: list[OSError] = []  # stdout's write error (not a reader that left) under the last guarded_stdout


def stdout_write_error() -> OSError | None:
    """The error that made stdout unwritable under the last :func:`guarded_stdout` (a full disk, an I/O
    error), or None: written whole, or only cut short by a reader that left (a broken pipe)."""
    return _failed[-1] if _failed else None


class _DroppedWhenUnwritable:
    """A text stream that forwards to ``stream`` until a write fails, then drops what follows; stdout's
    failure (``is_stdout``) is said on stderr and kept for :func:`stdout_write_error`."""

    def __init__(self, stream: TextIO, is_stdout: bool):
        self._stream, self.lost, self._is_stdout, self._say = stream, False, is_stdout, is_stdout

    def write(self, text: str) -> int:
        if not self.lost:
            try:
                return self._stream.write(text)
            except OSError as exc:
                self._lose(exc)
        return len(text)

    def flush(self) -> None:
        if not self.lost:
            try:
                self._stream.flush()
            except OSError as exc:
                self._lose(exc)

    def __getattr__(self, name: str) -> Any:  # isatty, fileno, encoding, ... of the stream
        return getattr(self._stream, name)

    def finish(self) -> None:
        """Write out what the stream buffers, saying nothing more if that fails (the caller says it)."""
        self._say = False
        self.flush()

    def _lose(self, exc: OSError) -> None:
        self.lost = True
        if self._is_stdout and not isinstance(exc, BrokenPipeError):  # a reader that left wants nothing more
            _failed.append(exc)
        if self._say and not isinstance(exc, BrokenPipeError):
            print(f"accelbatch: the standard output cannot be written ({exc.strerror or exc}); the run goes on "
                  "without it", file=sys.stderr)
        try:  # what the stream still buffers goes nowhere at exit, instead of failing there again
            null = os.open(os.devnull, os.O_WRONLY)
            os.dup2(null, self._stream.fileno())
            os.close(null)
        except (OSError, ValueError, AttributeError, io.UnsupportedOperation):  # no file under it (a test's)
            pass


def _printable(stream: TextIO) -> None:
    """Text the stream's encoding cannot hold shows as escapes (as stderr's does) instead of failing."""
    if getattr(stream, "errors", None) in ("strict", "surrogateescape") and hasattr(stream, "reconfigure"):
        stream.reconfigure(errors="backslashreplace")


@contextlib.contextmanager
def stderr_present() -> Iterator[None]:
    """A closed stderr (``2>&-``: ``sys.stderr`` is None, and print(file=None) would write to stdout) is
    os.devnull while the block runs, also as file descriptor 2 (which a file opened next would otherwise
    take, and what C code says would be written into it)."""
    if sys.stderr is not None:
        yield
        return
    null = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115 - closed below
    try:
        if null.fileno() != 2 and not _is_open(2):
            os.dup2(null.fileno(), 2)
        sys.stderr = null
        yield
    finally:
        if sys.stderr is null:
            sys.stderr = None  # type: ignore[assignment]
        null.close()


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@contextlib.contextmanager
def guarded_stdout() -> Iterator[None]:
    """``sys.stdout`` printable, it and ``sys.stderr`` (notes, the progress bar: ``> log 2>&1`` on a full disk)
    dropped once unwritable (see the module), while the block runs, and stdout written out at its end. A
    closed stdout (``>&-``) is None, which print() skips; a closed stderr is os.devnull (:func:`stderr_present`)."""
    _failed.clear()
    with stderr_present():
        originals = sys.stdout, sys.stderr
        if sys.stdout is not None:
            _printable(sys.stdout)
            sys.stdout = _DroppedWhenUnwritable(sys.stdout, is_stdout=True)  # type: ignore[assignment]
        sys.stderr = _DroppedWhenUnwritable(sys.stderr, is_stdout=False)  # type: ignore[assignment]
        guards = sys.stdout, sys.stderr
        try:
            yield
        finally:
            if isinstance(guards[0], _DroppedWhenUnwritable):
                guards[0].finish()  # a full disk met only by the last buffered text is met here, not at exit
            if (sys.stdout, sys.stderr) == guards:
                sys.stdout, sys.stderr = originals
