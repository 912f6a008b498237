"""``Options.loadFromFile``: options read from a file of setter calls, one a line.

The format is PopTorch's: each line is a call as it would be written on an ``Options`` object without the
``options.`` prefix (``deviceIterations(4)``, ``Training.gradientAccumulation(2)``); surrounding whitespace is
stripped, blank lines and lines starting with ``#`` are skipped, and an inline ``# comment`` is Python's.
The calls run in order on the given options with ``poptorch`` (this emulator) in scope, so a later file
overrides only the options it sets. A line that is not Python raises :class:`ConfigFileError` naming the
file, the line number (counting only the calls kept) and the offending call.
"""

from __future__ import annotations

import importlib
import os
from typing import Any


class ConfigFileError(Exception):
    """A line of an options file is not a valid call."""


def _syntax_detail(err: SyntaxError) -> str:
    """Python's message for a call left open; Python 3.10+ words it differently, PopTorch's SDK
    (Python 3.8) said "unexpected EOF while parsing": keep the latter, as PopTorch's error does."""
    detail = str(err.args[0]) if err.args else "invalid syntax"
    if detail.endswith("was never closed"):
        return "unexpected EOF while parsing"
    return detail


def load_options_file(options: Any, filepath: str) -> None:
    """Run the setter calls of ``filepath`` on ``options``."""
    with open(filepath, encoding="utf-8") as handle:
        calls = [line.strip() for line in handle]
    calls = ["options." + call for call in calls if call and not call.startswith("#")]
    code = "\n".join(calls)
    filename = os.path.basename(filepath)
    try:
        compiled = compile(code, filename, "exec")
    except SyntaxError as err:
        lineno = err.lineno or 0
        text = err.text if err.text is not None else (calls[lineno - 1] if 0 < lineno <= len(calls) else "")
        raise ConfigFileError(f"{type(err).__name__} at line {lineno} of {filename}: {_syntax_detail(err)}\n"
                              f"> {text.rstrip()}") from None
    poptorch = importlib.import_module(__package__)
    exec(compiled, {}, {"poptorch": poptorch, "options": options})  # noqa: S102 - PopTorch's file format


__all__ = ["ConfigFileError", "load_options_file"]
