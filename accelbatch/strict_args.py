"""argparse that reads each option only as it is written.

``allow_abbrev=False`` stops argparse from completing ``--num-ep`` to ``--num-epochs``, but before Python 3.12
it still completes a single-dash prefix (``-es 16`` ran as ``-esz 16``) and reads an unknown single-dash
token as a known short option with its value glued on (ParlAI's ``-mtw 1,3`` as ``-m tw``). A
:class:`StrictParser` refuses both in one line before argparse reads them. A glued value is refused only for
the options marked by :func:`refuse_glued_values` (accelbatch's own, whose short forms are ParlAI's): a
script's own ``-k`` still reads ``-k5`` as argparse does. A token that is an option's value is never read as
an option here (``--report-json -my.json`` is argparse's to judge). An unknown token that begins with a switch
(``-histsz`` before accelbatch took it: argparse named ``-h``) is refused naming the token. A parser's
``refusals`` (flag -> what to give instead) answer another program's options that it does not declare (an
agent's or a script's own option of that name is read, not refused); :class:`OnOff` is ``--flag``/``--no-flag``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any, NoReturn

from accelbatch.help_texts import DefaultsShown


def _is_number(token: str) -> bool:
    try:
        float(token)
    except ValueError:
        return False
    return True


_GLUED_REFUSED = "_accelbatch_refuses_glued_values"
_BOOL_WORDS = ("true", "false", "yes", "no", "t", "f", "1", "0", "y", "n")  # ParlAI's: each true word, then its false


def refuse_glued_values(action: argparse.Action) -> argparse.Action:
    """Mark ``action`` so that a value glued to its short flag (``-bs32``) is refused, not read."""
    setattr(action, _GLUED_REFUSED, True)
    return action


def _values_taken(action: argparse.Action | None) -> int:
    """How many of the following tokens ``action`` reads as its values (at least; 0 for a switch)."""
    if action is None or action.nargs == 0:
        return 0
    if action.nargs is None or action.nargs == "?":
        return 1
    return action.nargs if isinstance(action.nargs, int) else 0


def misread_option(parser: argparse.ArgumentParser, argv: Sequence[str]) -> str | None:
    """What is wrong with the first single-dash token of ``argv`` that ``parser`` does not define but would
    read as one of its options (a prefix of a longer one, or a short one with a glued value); None if none."""
    known = parser._option_string_actions
    values_ahead = 0
    for i, token in enumerate(argv):
        if token == "--" or not token.startswith("-") and parser._subparsers is not None:
            break  # what follows is positional, or the subcommand's own (its parser judges it)
        if values_ahead:
            values_ahead -= 1
            continue
        if token in known:
            values_ahead = _values_taken(known[token])
            following = argv[i + 1] if i + 1 < len(argv) else None
            if known[token].nargs is None and following is not None and following.startswith("-") \
                    and following not in ("-", "--") and following.split("=", 1)[0] not in known \
                    and not _is_number(following):  # a lone "-" is a value (stdout), as argparse reads it
                return (f"{token}: expected one argument; a value that begins with '-' is written "
                        f"{token}={following}")
            continue
        flag = token.split("=", 1)[0]
        if flag not in known and flag in getattr(parser, "refusals", {}):  # another program's, not declared here
            return f"{flag}: {parser.refusals[flag]}"  # type: ignore[attr-defined]
        if not token.startswith("-") or token.startswith("--") or len(token) < 2 or "=" in token \
                or _is_number(token):
            continue
        longer = [flag for flag, action in known.items() if flag.startswith(token) and not flag.startswith("--")
                  and action.help is not argparse.SUPPRESS]
        if longer:
            return f"unrecognized option {token} (options are not abbreviated; {token} begins {', '.join(longer)})"
        glued = max((flag for flag, action in known.items() if not flag.startswith("--")  # -tstep5: -tstep's
                     and token.startswith(flag) and getattr(action, _GLUED_REFUSED, False)), key=len, default=None)
        switch = next((flag for flag, action in known.items() if not flag.startswith("--") and action.nargs == 0
                       and token.startswith(flag)), None)  # argparse reads -histsz as -h with 'istsz' glued on
        if glued is None and switch is not None and any(f"-{c}" not in known for c in token[len(switch):]):
            return f"unrecognized option {token}: no option is named so (see --help)"
        if glued is not None:
            rest = token[len(glued):]
            return (f"unrecognized option {token}: no option is named so (see --help); a value is not read glued "
                    f"to {glued}: if {glued} {rest} is meant, write `{glued} {rest}`")
        if any(flag.startswith(token) for flag in known):
            return f"unrecognized arguments: {token}"  # only a hidden option starts so: argparse's own words
    return None


class StrictParser(argparse.ArgumentParser):
    """An ArgumentParser (abbreviations off) that refuses a misread single-dash option (see the module); its
    --help shows the defaults of the options marked by :func:`accelbatch.help_texts.show_default`, and a bad
    option ends in one line and a pointer to --help, not the whole usage (a hundred options long)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs["allow_abbrev"] = False
        kwargs.setdefault("formatter_class", DefaultsShown)
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_known_args(self, args: Sequence[str] | None = None, namespace: Any = None) -> Any:
        import sys

        argv = _switch_values_read(self, list(sys.argv[1:] if args is None else args))
        problem = misread_option(self, argv)
        if problem is not None:
            self.error(problem)
        return super().parse_known_args(_negatives_joined(self, argv), namespace)


def _switch_values_read(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """ParlAI's ``--flag true`` / ``--flag false`` (its type='bool' flags take a value) as this parser's switch
    ``--flag`` / ``--no-flag``; a value after a switch is otherwise an unrecognized argument."""
    if parser._subparsers is not None or any(not action.option_strings for action in parser._actions):
        return argv  # the word may be a positional (report's RUN_DIR, a script's own): argparse's to read
    known, out, i = parser._option_string_actions, [], 0
    while i < len(argv):
        token, following = argv[i], argv[i + 1] if i + 1 < len(argv) else ""
        if token == "--":
            return out + argv[i:]
        if token.startswith("--") and token in known and known[token].nargs == 0 and following.lower() in _BOOL_WORDS:
            name = token[len("--no-"):] if token.startswith("--no-") else token[2:]
            on = (following.lower() in _BOOL_WORDS[::2]) != token.startswith("--no-")
            switch = f"--{name}" if on else f"--no-{name}"
            if switch in known:
                out.append(switch)
                i += 2
                continue
        out.append(token)
        i += 1
    return out


def _negatives_joined(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """``-lr -1e-3`` as ``-lr=-1e-3``: argparse takes only ``-5`` and ``-.5`` for negative numbers, and reads
    ``-1e-3`` or ``-inf`` as an option, leaving the value out ("expected one argument")."""
    known, out, i = parser._option_string_actions, [], 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            return out + argv[i:]
        if token in known and _values_taken(known[token]) == 1 and i + 1 < len(argv) \
                and argv[i + 1].startswith("-") and argv[i + 1] not in known and _is_number(argv[i + 1]):
            out.append(f"{token}={argv[i + 1]}")
            i += 2
            continue
        out.append(token)
        i += 1
    return out


class OnOff(argparse.Action):
    """``--flag`` / ``--no-flag``: argparse.BooleanOptionalAction for Python 3.8 (the Poplar SDK's)."""

    def __init__(self, option_strings: Sequence[str], dest: str, default: Any = None, help: str | None = None,
                 **_: Any) -> None:
        strings = [s for flag in option_strings for s in (flag, "--no-" + flag[2:]) if flag.startswith("--")]
        super().__init__(strings, dest, nargs=0, default=default, help=help)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        setattr(namespace, self.dest, not (option_string or "").startswith("--no-"))
