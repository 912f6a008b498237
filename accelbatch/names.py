"""How a name given to ``-m`` (or ``-t``) becomes a class: the registered agents, ``module:Class`` paths, and
the error that lists the known names."""

from __future__ import annotations

import difflib
import importlib
import inspect
import os
import pkgutil
import sys
from typing import TYPE_CHECKING, Any, Sequence

if TYPE_CHECKING:
    from accelbatch.agents import Agent

# name -> "module:Class"; anything else given to -m is read as "module:Class".
AGENT_PATHS: dict[str, str] = {
    "memnn": "accelbatch.models.memnn:MemNNAgent",
    "bag": "accelbatch.models.bag:BagAgent",
    "conv": "accelbatch.models.conv:ConvAgent",
    "trivial": "accelbatch.models.trivial:TrivialAgent",
    "repeat_label": "accelbatch.models.utility:RepeatLabelAgent",
    "random_candidate": "accelbatch.models.utility:RandomCandidateAgent",
    "transformer/generator": "accelbatch.models.generator:TransformerGeneratorAgent",
}


class UnknownNameError(ValueError):
    """A task, model or device name that is not registered; the message lists the known ones."""


def import_path(path: str, kind: str, known: Sequence[str]) -> Any:
    """The agent or teacher class (or factory) at ``module:Attr``; a clear error listing the registered names
    when it cannot be found or is neither."""
    found = import_object(path, kind, known)
    if isinstance(found, type) and hasattr(found, "act") or not isinstance(found, type) and callable(found):
        return found  # a class with act(), or a function that makes one
    what = "a class without act()" if isinstance(found, type) else f"a {type(found).__name__}"
    raise UnknownNameError(f"{kind} {path!r} is {what}, not a {kind}: give a class with observe()/act() (e.g. "
                           f"a subclass of accelbatch's {'Agent' if kind == 'model' else 'Teacher'}) or a function "
                           "returning one")


def import_object(path: str, kind: str, known: Sequence[str]) -> Any:
    """Import ``module:Attr`` (any object); a clear error listing the registered names when it cannot be found."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise UnknownNameError(f"unknown {kind} {path!r}; known {kind}s: {', '.join(known)} "
                               f"(or give a path as module:Class)")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
            listed = f"; known {kind}s: {', '.join(known)}" if known else ""
            raise UnknownNameError(f"{kind} {path!r}: no module named {exc.name!r}{_missing(exc.name)}{listed}"
                                   ) from None
        raise  # a module the user's module imports is missing: its own error says which
    try:
        return getattr(module, attr)
    except AttributeError:
        raise UnknownNameError(f"{kind} {path!r}: module {module_name!r} has no {attr!r}{_close_names(module, attr)}"
                               ) from None


def _close_names(module: Any, attr: str) -> str:
    """In parentheses, the module's public classes and functions closest to ``attr`` (did you mean), else those
    it defines itself; "" when it has none."""
    names = sorted(name for name, value in vars(module).items()
                   if not name.startswith("_") and (isinstance(value, type) or inspect.isroutine(value)))
    lowered = {name.lower(): name for name in names}  # MyAgent for myagent too
    close = [lowered[c] for c in difflib.get_close_matches(attr.lower(), list(lowered), n=3)]
    if close:
        return f" (did you mean {' or '.join(map(repr, close))}?)"
    own = [name for name in names if getattr(vars(module)[name], "__module__", None) == module.__name__]
    return f" (its classes and functions: {', '.join(own[:8])}{', ...' if len(own) > 8 else ''})" if own else ""


def _missing(name: str) -> str:
    """Why module ``name`` was not found, in parentheses: the top package is not importable (the current folder
    is not searched by the accelbatch command, said when it is there), or a package has no such submodule."""
    parent, _, child = name.rpartition(".")
    if not parent:  # the top package itself: importable only from where Python looks
        here = os.path.isdir(name) or os.path.isfile(f"{name}.py")
        return (f" ({name} is in the current folder, which the accelbatch command does not search: run "
                "`PYTHONPATH=. accelbatch ...` or `python -m accelbatch ...`)") if here else ""
    folders = list(getattr(sys.modules.get(parent), "__path__", []))  # imported just now: the import got past it
    if not folders:
        return f" ({parent} is a module, not a package: it has no submodules; give {parent}:Name)"
    there = sorted(m.name for m in pkgutil.iter_modules(folders))
    close = difflib.get_close_matches(child, there, n=3)
    if close:
        hint = f"did you mean {' or '.join(repr(f'{parent}.{c}') for c in close)}?"
    else:
        hint = f"its modules: {', '.join(there[:8])}{', ...' if len(there) > 8 else ''}" if there else "it has none"
    at = f", in {folders[0]}," if len(folders) == 1 else ""
    return f" (the package {parent}{at} has no module {child!r}; {hint})"


TORCH_MODEL_AGENT = "accelbatch.tasks.torch_data:TorchModelAgent"  # -m torch:pkg.mod:Model


def resolve_agent_class(name: str) -> type["Agent"]:
    if name.startswith("torch:"):  # the user's nn.Module, PopTorch-style
        return import_path(TORCH_MODEL_AGENT, "model", list(AGENT_PATHS))
    return import_path(AGENT_PATHS.get(name, name), "model", list(AGENT_PATHS))


def say_unused_model(model: str, agent: Any, default: str) -> None:
    """One line on stderr when an agent class given to create_world replaces a -m naming another agent (a
    script that builds its own agent takes every option of `accelbatch train`, -m too, which it would ignore
    silently)."""
    if not isinstance(agent, type) or model == default:
        return
    try:
        named: type | None = resolve_agent_class(model)
    except Exception:  # noqa: BLE001 - a name that is no agent is all the more unused
        named = None
    if named is None or not issubclass(agent, named):
        print(f"accelbatch: -m/--model {model!r} is not used: create_world(agent={agent.__name__}) builds the "
              "agent given", file=sys.stderr)
