"""An agent's own command-line options, declared as ParlAI declares them: a classmethod
``add_cmdline_args(parser, partial_opt=None)`` (or the older ``add_cmdline_args(parser)``) that adds
arguments to the parser, in argument groups or not. accelbatch offers it an :class:`AgentArgParser`, which
takes ParlAI's spellings (``type='bool'``, ``hidden=``, ``recommended=``) and leaves out any flag accelbatch
has itself (``-esz``, ``-lr``: the run's own option serves, read as ``opts["embedding_size"]``). The values
live in ``Opts.agent_args`` (given ones from the command line or ``PATH.opt``; each agent built gets the
defaults of the rest), and ``opts["hidden"]`` reads them as ParlAI's ``opt["hidden"]`` does."""

from __future__ import annotations

import argparse
import inspect
from typing import Any, Callable, Sequence

from accelbatch.model_opts import read_model_opts
from accelbatch.opts import OptionError, Opts, command_line_flags

PREFIX = "agent_args."  # the namespace dest of an agent's option: apart from Opts' fields of the same name


def _to_bool(text: str) -> bool:
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

    def __init__(self, container: Any, defaults: dict[str, Any], own: set[str], make_group: Callable[[str], Any],
                 helps: list[tuple[argparse.Action, str, str]] | None = None):
        self._container, self._defaults, self._own, self._make_group = container, defaults, own, make_group
        self.helps = [] if helps is None else helps  # (action, dest, help as declared): see finish_help

    def add_argument(self, *flags: str, **kwargs: Any) -> Any:
        if kwargs.pop("hidden", False):  # ParlAI's: left out of --help
            kwargs["help"] = argparse.SUPPRESS
        kwargs.pop("recommended", None)
        if kwargs.get("type") == "bool":
            kwargs["type"] = _to_bool
        if any(flag in self._own for flag in flags) or not any(flag.startswith("-") for flag in flags):
            return None  # accelbatch's own option of that flag serves (positional arguments are not offered)
        dest = kwargs.pop("dest", None) or next(
            (f for f in flags if f.startswith("--")), flags[0]).lstrip("-").replace("-", "_")
        if dest in Opts.__dataclass_fields__:  # opts[dest] would read accelbatch's option, never this one
            raise OptionError(f"add_cmdline_args: {'/'.join(flags)} stores to {dest!r}, the name of an option of "
                              f"accelbatch's own (opts[{dest!r}] reads that one): give it another dest")
        unset = {"store_true": False, "store_false": True}.get(kwargs.get("action"))  # argparse's own defaults
        self._defaults.setdefault(dest, kwargs.pop("default", unset))
        if kwargs.get("action") not in ("store_true", "store_false", "count"):
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
        return AgentArgParser(self._make_group(title or "agent options"), self._defaults, self._own,
                              self._make_group, self.helps)

    def set_defaults(self, **defaults: Any) -> None:
        """Defaults of the agent's options (those named as accelbatch's own options keep accelbatch's)."""
        self._defaults.update({k: v for k, v in defaults.items() if k not in Opts.__dataclass_fields__})

    def get_default(self, dest: str) -> Any:
        return self._defaults.get(dest)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(f"add_cmdline_args: the parser accelbatch gives has no {name}() (ParlAI's parser "
                             "has): it offers add_argument, add_argument_group, set_defaults and get_default")


def declare(cls: type, container: Any, make_group: Callable[[str], Any]) -> dict[str, Any]:
    """Have ``cls.add_cmdline_args`` add its options to ``container``; their defaults."""
    declare_args = getattr(cls, "add_cmdline_args", None)
    defaults: dict[str, Any] = {}
    if not callable(declare_args):
        return defaults
    parser = AgentArgParser(container, defaults, command_line_flags(), make_group)
    try:
        takes_opt = len(inspect.signature(declare_args).parameters) >= 2
    except (TypeError, ValueError):
        takes_opt = True
    declare_args(parser, None) if takes_opt else declare_args(parser)
    parser.finish_help()
    return defaults


def add_agent_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """The options of agent class ``cls`` on a verb's parser (listed by --help under the agent's name)."""
    own = f"the own options of -m {cls.__name__} (its add_cmdline_args)"
    declare(cls, parser.add_argument_group(own),
            lambda title: parser.add_argument_group(f"{title} (-m {cls.__name__}'s own options)"))


def given_agent_args(namespace: argparse.Namespace) -> dict[str, Any]:
    """The agent options given on the command line, taken out of ``namespace`` (dest without the prefix)."""
    given = {key[len(PREFIX):]: value for key, value in vars(namespace).items() if key.startswith(PREFIX)}
    for key in list(vars(namespace)):
        if key.startswith(PREFIX):
            delattr(namespace, key)
    return given


def with_agent_defaults(cls: type, opts: Opts) -> Opts:
    """``opts`` whose ``agent_args`` hold every option ``cls`` declares: the given value (read as the command
    line reads it: a text through the declared type, then checked against the choices), else its default."""
    scratch = argparse.ArgumentParser(add_help=False)
    defaults = declare(cls, scratch, lambda title: scratch)
    unknown = sorted(set(opts.agent_args) - set(defaults))
    if unknown:
        declared = f"its add_cmdline_args declares {', '.join(sorted(defaults))}" if defaults else \
            "it has no add_cmdline_args of its own"
        kept = f"; remove it from {opts.model_file}.opt, which keeps it" if unknown[0] in _kept(opts) else ""
        raise OptionError(f"agent_args: {cls.__name__} declares no option {unknown[0]!r} ({declared}){kept}")
    if not defaults:
        return opts
    actions = {action.dest[len(PREFIX):]: action for action in scratch._actions if action.dest.startswith(PREFIX)}
    given = {key: _read_as_declared(cls, key, value, actions.get(key)) for key, value in opts.agent_args.items()}
    return opts.replace(agent_args={**defaults, **given})


def _kept(opts: Opts) -> dict[str, Any]:
    """The agent options ``PATH.opt`` of ``opts.model_file`` keeps (empty when there is none to read: a
    malformed file is refused where it is read for the run)."""
    try:
        return read_model_opts(opts.model_file).get("agent_args", {}) if opts.model_file else {}
    except ValueError:  # CheckpointError, OptionError
        return {}


_TEXT_READERS = (int, float, str, _to_bool)  # the types whose reading of a text is plain and repeatable


def _read_as_declared(cls: type, key: str, value: Any, action: argparse.Action | None) -> Any:
    """``value`` of agent option ``key`` as the command line would have read it: a text through its declared
    type (int, float, 'bool'), a number where a number is declared, one of its choices; else OptionError."""
    if action is None or action.nargs not in (None, "?") or isinstance(action, argparse._AppendAction):
        return value  # a list of values (nargs, append): taken as given
    kind, said = action.type, f"agent_args: {cls.__name__}'s option {key!r} is {value!r}"
    if isinstance(value, str) and kind in _TEXT_READERS:
        try:
            value = kind(value)
        except (ValueError, argparse.ArgumentTypeError):
            raise OptionError(f"{said}, not {_type_name(kind)}: give {_type_name(kind)}") from None
    elif kind in (int, float) and (isinstance(value, bool) or not isinstance(value, (int, float)) or
                                   kind is int and isinstance(value, float) and not value.is_integer()):
        raise OptionError(f"{said}, not {_type_name(kind)}: give {_type_name(kind)}")
    elif kind is int and isinstance(value, float):
        value = int(value)
    elif kind is _to_bool and not isinstance(value, bool):
        raise OptionError(f"{said}, not true or false: give a bool")
    if action.choices is not None and value not in action.choices:
        raise OptionError(f"{said}: choose from {', '.join(map(repr, action.choices))}")
    return value


def _type_name(kind: Any) -> str:
    return {int: "an integer", float: "a number", str: "a text", _to_bool: "true or false"}[kind]


def agent_named_in(argv: Sequence[str], saved_model: Callable[[str], str | None]) -> str | None:
    """The agent an argv names: its ``-m``/``--model``, else the model ``-mf PATH`` (its PATH.opt or
    checkpoint) or ``--init-model FILE`` records (``saved_model(path)``: None when none); None when neither
    (the default model declares no options)."""
    scan = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    scan.add_argument("-m", "--model")
    scan.add_argument("-mf", "--model-file")
    scan.add_argument("-im", "--init-model")
    try:
        known, _ = scan.parse_known_args([a for a in argv if a not in ("-h", "--help")])
    except SystemExit:
        return None
    if known.model:
        return known.model
    return next((saved_model(path) for path in (known.model_file, known.init_model) if path and saved_model(path)),
                None)


__all__ = ["AgentArgParser", "add_agent_arguments", "agent_named_in", "declare", "given_agent_args",
           "with_agent_defaults"]
