"""Each option's default in --help, read from the value the parser will use when the help is printed."""

from __future__ import annotations

import argparse
import re
from typing import Any

_SHOWN = "_accelbatch_shows_default"
# a help text that already says its default ("(default: ...)", "by default ...", "'x' (the default)")
_STATES_DEFAULT = re.compile(r"\(default[: ]|\bby default\b|\(the default\)")


def show_default(action: argparse.Action) -> argparse.Action:
    """Mark ``action`` so that :class:`DefaultsShown` adds its default to its help."""
    setattr(action, _SHOWN, True)
    return action


def shown_value(value: Any) -> str:
    """A default as --help writes it: on/off for a switch, 5 for 5.0, anything else as str() writes it."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() else repr(value)
    return str(value)


class DefaultsShown(argparse.HelpFormatter):
    """Adds "(default: X)" to the help of each marked option whose default is set, X read when the help is
    printed: a verb's ``set_defaults`` (eval's -dt valid) is the default shown."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text, default = action.help, action.default
        if not getattr(action, _SHOWN, False) or text is None or text == argparse.SUPPRESS \
                or default is None or default == argparse.SUPPRESS or default == "" or _STATES_DEFAULT.search(text):
            return text
        return f"{text} (default: {shown_value(default).replace('%', '%%')})"  # help is a %-format string
