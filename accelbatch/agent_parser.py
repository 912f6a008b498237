"""The parser an agent's ``add_cmdline_args(parser, partial_opt=None)`` is given: ParlAI's spellings
(``type='bool'``, ``hidden=``, ``recommended=``) over an argparse container, each option's dest prefixed so
that parsing yields the given values alone. It imports nothing of accelbatch's options, so that
``Opts.from_args`` can declare an agent's options too: the caller names the flags and names accelbatch keeps
(:class:`Reserved`)."""

from __future__ import annotations

import argparse
import inspect
from dataclasses import dataclass
from typing import Any, Callable

from accelbatch.option_error import OptionError


@dataclass(frozen=True)
class Reserved:
    """What an agent's options may not take: accelbatch's flags (its own option serves, ``-lr``) and its
    option names (``opts[name]`` reads accelbatch's)."""

    flags: frozenset[str]
    names: frozenset[str]


PREFIX = "agent_args."  # the namespace dest of an agent's option: apart from Opts' fields of the same name


def read_bool(text: str) -> bool:
    """ParlAI's ``type='bool'``: yes/true/t/1 or no/false/f/0."""
    lowered = str(text).lower()
    if lowered in ("yes", "true", "t", "1", "y"):
        return True
    if lowered in ("no", "false", "f", "0", "n"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


class AgentArgParser:
    """What ``add_cmdline_args`` is given: ParlAI's parser surface over an argparse container. Each argument's
    dest is prefixed with :data:`PREFIX` and its default kept aside, so that parsing yields the given values
    alone (the defaults are applied to the agent's options when it is built)."""

    def __init__(self, container: Any, defaults: dict[str, Any], reserved: Reserved, make_group: Callable[[str], Any],
                 helps: list[tuple[argparse.Action, str, str]] | None = None, core: dict[str, Any] | None = None):
        self._container, self._defaults, self._reserved, self._make_group = container, defaults, reserved, make_group
        self.helps = [] if helps is None else helps  # (action, dest, help as declared): see finish_help
        self.core = {} if core is None else core  # set_defaults of accelbatch's own options (see set_defaults)

    def add_argument(self, *flags: str, **kwargs: Any) -> Any:
        if kwargs.pop("hidden", False):  # ParlAI's: left out of --help
            kwargs["help"] = argparse.SUPPRESS
        kwargs.pop("recommended", None)
        if kwargs.get("type") == "bool":
            kwargs["type"] = read_bool
        # both spellings of a long flag, as ParlAI's parser takes them (it declares --a_b as --a-b and reads
        # either spelling from the command line)
        declared, flags = flags, tuple(dict.fromkeys(spelled for flag in flags for spelled in (
            (flag, "--" + flag[2:].replace("_", "-"), "--" + flag[2:].replace("-", "_")) if flag.startswith("--")
            else (flag,))))
        if any(flag in self._reserved.flags for flag in flags) or not any(flag.startswith("-") for flag in flags):
            return None  # accelbatch's own option of that flag serves (positional arguments are not offered)
        dest = kwargs.pop("dest", None) or next(
            (f for f in flags if f.startswith("--")), flags[0]).lstrip("-").replace("-", "_")
        if dest in self._reserved.names:  # opts[dest] would read accelbatch's option, never this one
            raise OptionError(f"add_cmdline_args: {'/'.join(declared)} stores to {dest!r}, the name of an option of "
                              f"accelbatch's own (opts[{dest!r}] reads that one): give it another dest")
        unset = {"store_true": False, "store_false": True}.get(kwargs.get("action"))  # argparse's own defaults
        self._defaults.setdefault(dest, kwargs.pop("default", unset))
        if kwargs.get("action") not in ("store_true", "store_false", "count") and "choices" not in kwargs:
            kwargs.setdefault("metavar", dest.upper())
        try:
            action = self._container.add_argument(*flags, dest=PREFIX + dest, default=argparse.SUPPRESS, **kwargs)
        except argparse.ArgumentError:  # a flag of the verb's own (interactive's --candidates): that one serves
            self._defaults.pop(dest, None)
            return None
        if kwargs.get("help") not in (None, argparse.SUPPRESS):
            self.helps.append((action, dest, kwargs["help"]))
        return action

    def finish_help(self) -> None:
        """Each option's help with its default, once every ``set_defaults`` has been made (argparse is given
        no default, so that parsing yields the given values alone)."""
        for action, dest, text in self.helps:
            default = self._defaults.get(dest)
            action.help = text.replace("%(default)s", str(default)) if "%(default)" in text else \
                f"{text} (default: {default})"

    def add_argument_group(self, title: str | None = None, description: str | None = None,
                           **_: Any) -> "AgentArgParser":
        return AgentArgParser(self._make_group(title or "agent options"), self._defaults, self._reserved,
                              self._make_group, self.helps, self.core)

    def set_defaults(self, **defaults: Any) -> None:
        """Defaults of the agent's options; those of accelbatch's own options (ParlAI's agents set -esz so) are
        kept in ``core``: the command line takes them as its defaults (see :func:`add_agent_arguments`)."""
        self._defaults.update({k: v for k, v in defaults.items() if k not in self._reserved.names})
        self.core.update({k: v for k, v in defaults.items() if k in self._reserved.names})

    def get_default(self, dest: str) -> Any:
        return self._defaults.get(dest)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"add_cmdline_args: the parser accelbatch gives has no {name}() (ParlAI's parser "
                             "has): it offers add_argument, add_argument_group, set_defaults and get_default")


def declare(cls: type, container: Any, make_group: Callable[[str], Any], reserved: Reserved,
            core: dict[str, Any] | None = None) -> dict[str, Any]:
    """Have ``cls.add_cmdline_args`` add its options to ``container``; their defaults (those it sets for
    accelbatch's own options into ``core``)."""
    declare_args = getattr(cls, "add_cmdline_args", None)
    defaults: dict[str, Any] = {}
    if not callable(declare_args):
        return defaults
    parser = AgentArgParser(container, defaults, reserved, make_group, core=core)
    try:
        takes_opt = len(inspect.signature(declare_args).parameters) >= 2
    except (TypeError, ValueError):
        takes_opt = True
    declare_args(parser, None) if takes_opt else declare_args(parser)
    parser.finish_help()
    return defaults


def add_agent_arguments(parser: argparse.ArgumentParser, cls: type, reserved: Reserved) -> None:
    """The options of agent class ``cls`` on a verb's parser (listed by --help under the agent's name); the
    defaults it sets for accelbatch's own options are that parser's (as ParlAI's parser takes an agent's
    ``set_defaults``: an option given, or kept by a model file, wins)."""
    own = f"the own options of -m {cls.__name__} (its add_cmdline_args)"
    core: dict[str, Any] = {}
    declare(cls, parser.add_argument_group(own),
            lambda title: parser.add_argument_group(f"{title} (-m {cls.__name__}'s own options)"), reserved, core)
    if core:
        parser.set_defaults(**core)


def given_agent_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The agent options given on the command line, taken out of ``namespace`` (dest without the prefix)."""
    given = {key[len(PREFIX):]: value for key, value in vars(namespace).items() if key.startswith(PREFIX)}
    for key in list(vars(namespace)):
        if key.startswith(PREFIX):
            delattr(namespace, key)
    return given


__all__ = ["PREFIX", "AgentArgParser", "Reserved", "read_bool", "add_agent_arguments", "declare", "given_agent_args"]
