"""The command line's entry point (``accelbatch``, ``python -m accelbatch``): :func:`accelbatch.cli.main`,
imported here with a Ctrl-C or SIGTERM held, so that one sent while torch and the package load ends the
program with one line and exit 130, as one sent during the run does; a SIGTERM while the run starts (its world
built, its data read) is an interrupt as a Ctrl-C is. Its exit is 1 when stdout could not be written (a full
disk), so that ``accelbatch eval ... > scores.txt && use scores.txt`` stops there."""

from __future__ import annotations

import contextlib
import os
import signal
import sys

from accelbatch.stdout_guard import stderr_present, stdout_write_error

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Callable, Iterator, Sequence

INTERRUPTED_EXIT = 130  # 128 + SIGINT, as a shell reports a program that SIGINT ended


def _import_command(noted: list[int]) -> Callable[[Sequence[str] | None], int] | None:
    """:func:`accelbatch.cli.main`, or None when a SIGINT or SIGTERM came while it was imported (appended to
    ``noted``).

    The signal is noted, not raised: a KeyboardInterrupt raised inside torch's or numpy's import is cleared
    (torch's C module imports numpy and goes on without it, so the run would start anyway) or turned into an
    ImportError by their C code."""
    held = [sig for sig in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(sig) != signal.SIG_IGN]
    previous = {sig: signal.signal(sig, lambda signum, frame: noted.append(signum)) for sig in held}
    try:
        from accelbatch.cli import main as run_command
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return None if noted else run_command


def take_sigint() -> None:
    """Give SIGINT its usual meaning (KeyboardInterrupt) where it was inherited ignored (a background job of a
    non-interactive shell: ``accelbatch ... &`` in a script): the run takes it anyway, so it must be taken from
    the start, not lost in the set-up between the import and the run; children then start with it too."""
    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


class _Terminated:
    """SIGTERM's handler until the run takes it (and again after it): a KeyboardInterrupt naming it. A child
    forked meanwhile (a data worker) gets the default back, so that SIGTERM ends it as before."""

    def __call__(self, signum: int, frame: object) -> None:
        raise KeyboardInterrupt("SIGTERM received")


@contextlib.contextmanager
def sigterm_taken() -> Iterator[None]:
    """SIGTERM during the start-up (imports, the world, the data) ends the program as a Ctrl-C does (one line,
    exit 130), not silently (143); the run's own handler saves a checkpoint. Left as it is when inherited
    ignored (nohup-like launchers) or set by the program that called :func:`main`; the default is back after."""
    if signal.getsignal(signal.SIGTERM) != signal.SIG_DFL:
        yield
        return
    taken = _Terminated()
    signal.signal(signal.SIGTERM, taken)
    try:
        yield
    finally:
        if signal.getsignal(signal.SIGTERM) is taken:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _default_sigterm_in_child() -> None:
    if isinstance(signal.getsignal(signal.SIGTERM), _Terminated):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default_sigterm_in_child)


def main(argv: Sequence[str] | None = None) -> int:
    with stderr_present(), sigterm_taken():  # stderr: `2>&-` must not send the lines below to stdout
        try:
            code = _main(argv)
        except SystemExit as exc:  # --help and --version: printed, then argparse's exit 0
            if exc.code not in (0, None):
                raise
            code = 0
        error = stdout_write_error()
        if error is not None:
            print(f"accelbatch: error: the standard output could not be written ({error.strerror or error}): what "
                  "was printed there is incomplete", file=sys.stderr)
            code = code or 1
    return code


def _main(argv: Sequence[str] | None) -> int:
    take_sigint()
    try:
        noted: list[int] = []  # the signals that came while the command was imported
        run_command = _import_command(noted)
        if run_command is None:
            by = " by SIGTERM" if noted[0] == signal.SIGTERM else ""
            print(f"accelbatch: interrupted{by} while starting: nothing was run", file=sys.stderr)
            code = INTERRUPTED_EXIT
        else:
            code = run_command(argv)  # which says itself what a Ctrl-C during the run stopped and saved
    except KeyboardInterrupt as exc:
        print(f"accelbatch: interrupted{': ' + str(exc) if str(exc) else ''}", file=sys.stderr)
        code = INTERRUPTED_EXIT
    # A KeyboardInterrupt that passed through code run by exec() of a string (dataclasses and namedtuples
    # make their methods so) marks the interpreter, which then ends `python -m accelbatch` by SIGINT even
    # though the interrupt was caught; exec() run again clears the mark.
    exec("")
    return code


if __name__ == "__main__":
    sys.exit(main())
