"""Standard output and error for the command line: what cannot be written there never stops the work.

A reader that stops reading (``accelbatch train ... | head -1``) makes the next write a BrokenPipeError, and a
full disk (``> /dev/full``, ``> log 2>&1``) an OSError: raised inside a training step, either ended the run
unsaved with a traceback. While :func:`guarded_stdout` holds, such an output is dropped (stdout's full disk
said once on stderr) and the run goes on to save its model and write its report files. Text stdout's
encoding cannot hold (é or 中文 under a Latin-1 or C locale) is printed as escapes."""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any, Iterator, TextIO


class _DroppedWhenUnwritable:
    """A text stream that forwards to ``stream`` until a write fails, then drops what follows."""

    def __init__(self, stream: TextIO, said: bool):
        self._stream, self.lost, self._said = stream, False, said

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

    def _lose(self, exc: OSError) -> None:
        self.lost = True
        if self._said and not isinstance(exc, BrokenPipeError):  # a reader that left wants nothing more
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
def guarded_stdout() -> Iterator[None]:
    """``sys.stdout`` printable, it and ``sys.stderr`` (notes, the progress bar: ``> log 2>&1`` on a full disk)
    dropped once unwritable (see the module), while the block runs; a closed one (``>&-``) is None, which
    print() already skips."""
    originals = sys.stdout, sys.stderr
    if sys.stdout is not None:
        _printable(sys.stdout)
        sys.stdout = _DroppedWhenUnwritable(sys.stdout, said=True)  # type: ignore[assignment]
    if sys.stderr is not None:
        sys.stderr = _DroppedWhenUnwritable(sys.stderr, said=False)  # type: ignore[assignment]
    guards = sys.stdout, sys.stderr
    try:
        yield
    finally:
        if (sys.stdout, sys.stderr) == guards:
            sys.stdout, sys.stderr = originals
