"""The main-module guard that Python's spawn and forkserver start methods need.

A child process started that way imports the parent's ``__main__`` script before it runs (so that classes
defined there unpickle), and so runs the script's top-level code again: a script that builds a world and
trains outside ``if __name__ == "__main__":`` would train again in every data process, hogwild process or
replica. :func:`check_main_guard` refuses that in the parent, before any process starts, naming the script
and line; :func:`refuse_script_rerun` ends such a child at once should one start anyway.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
import types

from accelbatch.opts import OptionError
from accelbatch.proc_errors import SCRIPT_RAN_AGAIN, UNGUARDED_SCRIPT


def rerun_script(main: types.ModuleType | None) -> str | None:
    """The file a spawn child would run again as its ``__main__``: None for a package's ``__main__`` (run
    with ``python -m``, which children never re-run), an interactive session or ``python -c``."""
    if main is None:
        return None
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None and (name == "__main__" or name.endswith(".__main__")):
        return None
    path = getattr(main, "__file__", None)
    return path if path and path.endswith(".py") else None


def _is_main_test(test: ast.expr) -> bool:
    """``__name__ == "__main__"`` (either way round)."""
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    names = [s for s in sides if isinstance(s, ast.Name) and s.id == "__name__"]
    texts = [s for s in sides if isinstance(s, ast.Constant) and s.value == "__main__"]
    return len(names) == 1 and len(texts) == 1


def unguarded_line(main: types.ModuleType | None = None) -> tuple[str, int] | None:
    """(script, line) when this call comes from the top-level code of the ``__main__`` script outside an
    ``if __name__ == "__main__":`` block; None when guarded, or when no script would run again."""
    main = sys.modules.get("__main__") if main is None else main
    path = rerun_script(main)
    if path is None:
        return None
    frame = sys._getframe(1)
    while frame is not None and not (frame.f_code.co_name == "<module>" and frame.f_globals is vars(main)):
        frame = frame.f_back
    if frame is None:  # called from elsewhere (a thread, a callback): nothing to say
        return None
    line = frame.f_lineno
    try:
        with open(path, encoding="utf-8") as handle:
            tree = ast.parse(handle.read(), path)
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None
    guarded = any(isinstance(node, ast.If) and _is_main_test(node.test)
                  and node.lineno <= line <= (node.end_lineno or node.lineno) for node in tree.body)
    return None if guarded else (path, line)


def check_main_guard(what: str) -> None:
    """Refuse, before any process starts, a run whose ``what`` (e.g. "--dataloader-mode async") starts
    processes that would run the calling script's unguarded top-level code again."""
    found = unguarded_line()
    if found is not None:
        path, line = found
        raise OptionError(f"{what} starts processes that import {os.path.basename(path)} to start (Python's spawn "
                          f"and forkserver start methods), and its line {line} runs outside an `if __name__ == "
                          f"\"__main__\":` guard, so it would run again in each of them: put the script's "
                          "top-level code under the guard")


def refuse_script_rerun() -> None:
    """End this process at once when it is a child importing its parent's script to start (Python sets
    ``_inheriting`` while a spawn or forkserver child runs the script as ``__mp_main__``): the parent's
    supervisor names the cause from the exit code; the line here serves a process pool of the user's own."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"accelbatch: error: this child process (pid {os.getpid()}) stopped: {UNGUARDED_SCRIPT}",
              file=sys.stderr, flush=True)
        os._exit(SCRIPT_RAN_AGAIN)  # not SystemExit: a forkserver child would turn it into exit code 1


__all__ = ["check_main_guard", "refuse_script_rerun", "unguarded_line"]
