"""An agent's own command-line options, declared as ParlAI declares them: a classmethod
``add_cmdline_args(parser, partial_opt=None)`` (or the older ``add_cmdline_args(parser)``) that adds
arguments to the parser, in argument groups or not. accelbatch offers it an :class:`AgentArgParser`, which
takes ParlAI's spellings (``type='bool'``, ``hidden=``, ``recommended=``) and leaves out any flag accelbatch
has itself (``-esz``, ``-lr``: the run's own option serves, read as ``opts["embedding_size"]``). The values
live in ``Opts.agent_args`` (given ones from the command line or ``PATH.opt``; each agent built gets the
defaults of the rest), and ``opts["hidden"]`` reads them as ParlAI's ``opt["hidden"]`` does."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Sequence

from accelbatch import agent_parser
from accelbatch.agent_parser import PREFIX, given_agent_args, read_bool
from accelbatch.model_opts import read_model_opts
from accelbatch.names import resolve_agent_class
from accelbatch.opts import OptionError, Opts, reserved_options


def declare(cls: type, container: Any, make_group: Callable[[str], Any]) -> dict[str, Any]:
    """Have ``cls.add_cmdline_args`` add its options to ``container``; their defaults."""
    return agent_parser.declare(cls, container, make_group, reserved_options())


def add_agent_arguments(parser: argparse.ArgumentParser, cls: type) -> None:
    """The options of agent class ``cls`` on a verb's parser (listed by --help under the agent's name)."""
    agent_parser.add_agent_arguments(parser, cls, reserved_options())


def with_agent_defaults(cls: type, opts: Opts) -> Opts:
    """``opts`` whose ``agent_args`` hold every option ``cls`` declares: the given value (read as the command
    line reads it: a text through the declared type, then checked against the choices), else its default."""
    scratch = argparse.ArgumentParser(add_help=False)
    defaults = declare(cls, scratch, lambda title: scratch)
    unknown = sorted(set(opts.agent_args) - set(defaults))
    if unknown:
        declared = f"its add_cmdline_args declares {', '.join(sorted(defaults))}" if defaults else \
            "it has no add_cmdline_args of its own"
        raise OptionError(f"agent_args: {cls.__name__} declares no option {unknown[0]!r} ({declared})"
                          f"{_kept_hint(cls, opts, unknown[0])}")
    if not defaults:
        return opts
    actions = {action.dest[len(PREFIX):]: action for action in scratch._actions if action.dest.startswith(PREFIX)}
    given = {key: _read_as_declared(cls, key, value, actions.get(key)) for key, value in opts.agent_args.items()}
    return opts.replace(agent_args={**defaults, **given})


def _kept_hint(cls: type, opts: Opts, key: str) -> str:
    """What to do about an undeclared agent option ``key`` that ``PATH.opt`` keeps ("" when it keeps none): the
    file of an agent whose class it could not record (defined in ``__main__``) built -m's default instead."""
    saved = _saved(opts)
    if key not in saved.get("agent_args", {}):
        return ""
    if "model" in saved or not _named(cls, opts):
        return f"; remove it from {opts.model_file}.opt, which keeps it"
    return (f"; {opts.model_file}.opt keeps it for an agent whose class it could not record (one defined in "
            "__main__): give -m module:Class naming an importable copy of that class")


def _named(cls: type, opts: Opts) -> bool:
    """Whether ``cls`` is the agent ``-m`` names (not one given as a class to ``create_world``)."""
    try:
        return resolve_agent_class(opts.model) is cls
    except Exception:  # noqa: BLE001 - an -m that does not resolve names no class
        return False


def _saved(opts: Opts) -> dict[str, Any]:
    """What ``PATH.opt`` of ``opts.model_file`` keeps (empty when there is none to read: a malformed file is
    refused where it is read for the run)."""
    try:
        return read_model_opts(opts.model_file) if opts.model_file else {}
    except ValueError:  # CheckpointError, OptionError
        return {}


_TEXT_READERS = (int, float, str, read_bool)  # the types whose reading of a text is plain and repeatable


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
    elif kind is read_bool and not isinstance(value, bool):
        raise OptionError(f"{said}, not true or false: give a bool")
    if action.choices is not None and value not in action.choices:
        raise OptionError(f"{said}: choose from {', '.join(map(repr, action.choices))}")
    return value


def _type_name(kind: Any) -> str:
    return {int: "an integer", float: "a number", str: "a text", read_bool: "true or false"}[kind]


_NAMING = {"-m": "model", "--model": "model", "-mf": "model_file", "--model-file": "model_file",
           "-im": "init_model", "--init-model": "init_model"}


def agent_named_in(argv: Sequence[str], saved_model: Callable[[str], str | None]) -> str | None:
    """The agent an argv names: its ``-m``/``--model``, else the model ``-mf PATH`` (its PATH.opt or
    checkpoint) or ``--init-model FILE`` records (``saved_model(path)``: None when none); None when neither
    (the default model declares no options).

    Tokens are matched as written (the last one given wins, as argparse's): argparse before Python 3.12 reads
    ParlAI's ``-mcs`` as ``-m cs``, and an option without its value is the command's parser's to refuse."""
    named: dict[str, str] = {}
    tokens = list(argv)
    for i, token in enumerate(tokens):
        if token == "--":
            break
        flag, glued, value = token.partition("=")
        if glued and flag in _NAMING:
            named[_NAMING[flag]] = value
        elif token in _NAMING and i + 1 < len(tokens) and not tokens[i + 1].startswith("-"):
            named[_NAMING[token]] = tokens[i + 1]
    if named.get("model"):
        return named["model"]
    return next((saved_model(path) for path in (named.get("model_file"), named.get("init_model"))
                 if path and saved_model(path)), None)


__all__ = ["PREFIX", "add_agent_arguments", "agent_named_in", "declare", "given_agent_args",
           "with_agent_defaults"]
