"""The command line's entry point (``accelbatch``, ``python -m accelbatch``): :func:`accelbatch.cli.main`,
imported here with a Ctrl-C held, so that one pressed while torch and the package load ends the program
with one line and exit 130, as one pressed during the run does."""

from __future__ import annotations

import signal
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Sequence

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a program that SIGINT ended


def _import_command() -> Callable[[Sequence[str] | None], int] | None:
    """:func:`accelbatch.cli.main`, or None when a SIGINT came while it was imported.

    The signal is noted, not raised: a KeyboardInterrupt raised inside torch's or numpy's import is cleared
    (torch's C module imports numpy and goes on without it, so the run would start anyway) or turned into an
    ImportError by their C code."""
    noted: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: noted.append(signum))
    try:
        from accelbatch.cli import main as run_command
    finally:
        signal.signal(signal.SIGINT, previous)
    return None if noted else run_command


def take_sigint() -> None:
    """Give SIGINT its usual meaning (KeyboardInterrupt) where it was inherited ignored (a background job of a
    non-interactive shell: ``accelbatch ... &`` in a script): the run takes it anyway, so it must be taken from
    the start, not lost in the set-up between the import and the run; children then start with it too."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def main(argv: Sequence[str] | None = None) -> int:
    take_sigint()
    try:
        run_command = _import_command()
        if run_command is None:
            print("accelbatch: interrupted while starting: nothing was run", file=sys.stderr)
            code = INTERRUPTED_EXIT
        else:
            code = run_command(argv)  # which says itself what a Ctrl-C during the run stopped and saved
    except KeyboardInterrupt:
        print("accelbatch: interrupted", file=sys.stderr)
        code = INTERRUPTED_EXIT
    # A KeyboardInterrupt that passed through code run by exec() of a string (dataclasses and namedtuples
    # make their methods so) marks the interpreter, which then ends `python -m accelbatch` by SIGINT even
    # though the interrupt was caught; exec() run again clears the mark.
    exec("")
    return code


if __name__ == "__main__":
    sys.exit(main())
