"""The main-module guard that Python's spawn and forkserver start methods need.

A child process started that way imports the parent's ``__main__`` script before it runs (so that classes
defined there unpickle), and so runs the script's top-level code again: a script that builds a world and
trains outside ``if __name__ == "__main__":`` would train again in every data process, hogwild process or
replica. :func:`check_main_guard` refuses that in the parent, before any process starts, naming the script
and line; :func:`refuse_script_rerun` ends such a child at once should one start anyway. Classes the children
must import (the agent's) but that are defined in a ``__main__`` they do not import (``python -c``, a REPL, a
notebook) are refused there too, rather than failing in each child.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import sys
import types
from collections.abc import Iterable

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


def _in_child(test: ast.expr) -> bool | None:
    """What ``test`` is in a child, where ``__name__`` is ``"__mp_main__"``: True, False, or None (unknown).
    Knows ``__name__ == "__main__"`` and ``!=`` (either way round), ``not``, ``and`` and ``or``."""
    if isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], (ast.Eq, ast.NotEq)):
        sides = {_side(test.left), _side(test.comparators[0])}
        return isinstance(test.ops[0], ast.NotEq) if sides == {"name", "main"} else None
    if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
        inner = _in_child(test.operand)
        return None if inner is None else not inner
    if isinstance(test, ast.BoolOp):
        values = [_in_child(value) for value in test.values]
        settles = isinstance(test.op, ast.Or)  # one operand True settles an `or`, one False an `and`
        if settles in values:
            return settles
        return (not settles) if all(value is (not settles) for value in values) else None
    return None


def _side(node: ast.expr) -> str | None:
    if isinstance(node, ast.Name) and node.id == "__name__":
        return "name"
    return "main" if isinstance(node, ast.Constant) and node.value == "__main__" else None


def _holds(block: list[ast.stmt], line: int) -> ast.stmt | None:
    """The statement of ``block`` that spans ``line``, if any."""
    return next((node for node in block if node.lineno <= line <= (node.end_lineno or node.lineno)), None)


def _guarded(block: list[ast.stmt], line: int) -> bool:
    """Whether ``line`` of ``block`` is in a branch a child skips: an ``if`` (or ``elif``, ``while``) body
    whose test is False there, or its ``else`` where the test is True there; found at any depth (inside
    ``if True:``, ``try``, ``with`` ...)."""
    node = _holds(block, line)
    if node is None:
        return False
    if isinstance(node, (ast.If, ast.While)):
        in_child = _in_child(node.test)
        skipped = node.body if in_child is False else node.orelse if in_child is True else []
        if _holds(skipped, line) is not None:
            return True
    blocks = [getattr(node, field, None) for field in ("body", "orelse", "finalbody")]
    blocks += [part.body for part in getattr(node, "handlers", []) + getattr(node, "cases", [])]
    return any(_guarded(inner, line) for inner in blocks if isinstance(inner, list))


def unguarded_line(main: types.ModuleType | None = None) -> tuple[str, int] | None:
    """(script, line) when this call comes from the top-level code of the ``__main__`` script outside an
    ``if __name__ == "__main__":`` block (or a test False unless ``__name__ == "__main__"``, e.g. ``if
    __name__ == "__main__" and ...:``); None when guarded, or when no script would run again."""
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
    return None if _guarded(tree.body, line) else (path, line)


def children_import_main(main: types.ModuleType | None) -> bool:
    """Whether spawn and forkserver children import the parent's ``__main__`` (as ``__mp_main__``), so that
    what is defined there unpickles: yes for a script file or ``python -m module``; no for ``python -c``, a
    REPL, a notebook or a package's ``__main__.py`` (as :func:`multiprocessing.spawn.get_preparation_data`)."""
    name = getattr(getattr(main, "__spec__", None), "name", None)
    if name is not None:
        return not (name == "__main__" or name.endswith(".__main__"))
    return getattr(main, "__file__", None) is not None


def _defined_in_main(thing: object) -> str | None:
    """The name of ``thing`` (a class or function; an instance's class; a ``-m`` path ``__main__:Name``, also
    after ``torch:``) when it is defined in ``__main__``; else None."""
    if isinstance(thing, str):
        path = thing[len("torch:"):] if thing.startswith("torch:") else thing  # -m torch:module:Model
        module, _, name = path.partition(":")
        return name if module == "__main__" and name else None
    target = thing if isinstance(thing, (type, types.FunctionType)) else type(thing)
    return target.__qualname__ if getattr(target, "__module__", None) == "__main__" else None


def check_main_guard(what: str, needs: Iterable[object] = ()) -> None:
    """Refuse, before any process starts, a run whose ``what`` (e.g. "--dataloader-mode async") starts
    processes that would run the calling script's unguarded top-level code again, or that must import one of
    ``needs`` (classes, functions, instances, ``-m`` paths they unpickle or import by name) from a
    ``__main__`` they do not import (``python -c``, a REPL, a notebook): see :func:`children_import_main`; or a
    script read from standard input (``python - < script.py``), whose file they would look for to start."""
    read_from = getattr(sys.modules.get("__main__"), "__file__", None)
    if isinstance(read_from, str) and read_from.startswith("<") and read_from.endswith(">"):
        raise OptionError(f"{what} starts processes that run the calling script's file to start (Python's spawn "
                          f"and forkserver start methods), but this script was read from {read_from} (python -), "
                          "which they cannot: save the script to a file and run that")
    found = unguarded_line()
    if found is not None:
        path, line = found
        raise OptionError(f"{what} starts processes that import {os.path.basename(path)} to start (Python's spawn "
                          f"and forkserver start methods), and its line {line} runs outside an `if __name__ == "
                          f"\"__main__\":` guard, so it would run again in each of them: put the script's "
                          "top-level code under the guard")
    if children_import_main(sys.modules.get("__main__")):
        return
    for thing in needs:
        name = _defined_in_main(thing)
        if name is not None:
            raise OptionError(f"{what} starts processes that must import {name}, but it is defined in __main__, "
                              "which they do not import (python -c, a REPL, a notebook, a package's __main__.py): "
                              f"define {name} in a module file (e.g. {name.split('.')[0].lower()}.py) and import "
                              "it, or run a script file")


def refuse_script_rerun() -> None:
    """End this process at once when it is a child importing its parent's script to start (Python sets
    ``_inheriting`` while a spawn or forkserver child runs the script as ``__mp_main__``): the parent's
    supervisor names the cause from the exit code; the line here serves a process pool of the user's own."""
    if getattr(multiprocessing.current_process(), "_inheriting", False):
        print(f"accelbatch: error: this child process (pid {os.getpid()}) stopped: {UNGUARDED_SCRIPT}",
              file=sys.stderr, flush=True)
        os._exit(SCRIPT_RAN_AGAIN)  # not SystemExit: a forkserver child would turn it into exit code 1


__all__ = ["check_main_guard", "children_import_main", "refuse_script_rerun", "unguarded_line"]
