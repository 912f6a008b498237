"""An agent built for a run meets its ``-mf`` file: a TorchAgent loads it itself (in ``__init__``, as ParlAI's
TorchAgent does); a plain :class:`~accelbatch.agents.Agent` whose class has its own ``load(path)`` is loaded
here, after construction, unless its ``__init__`` already called ``load`` (ParlAI's convention: an agent loads
``opt['model_file']`` itself when it exists), so training's ``save(path)`` and ``eval -mf`` meet either way."""

from __future__ import annotations

import contextlib
import inspect
import os
from collections.abc import Iterator
from typing import Any

from accelbatch.agent_args import with_agent_defaults
from accelbatch.agents import Agent, TorchAgent
from accelbatch.opts import Opts


def construct(cls: type[Agent], opts: Opts) -> Agent:
    """``cls(opts)``, loaded from an existing ``-mf`` (a plain agent with ``load(path)`` that did not load in
    ``__init__``), with a load note when ``-mf`` has no ``PATH.opt`` beside it; its own options (declared by its
    ``add_cmdline_args``) in ``opts.agent_args``, the given ones and the defaults of the rest."""
    opts = with_agent_defaults(cls, opts)
    path = opts.model_file
    if not (path and os.path.isfile(path) and loads_itself(cls)):
        return noting_unknown_options(cls(opts), opts)
    calls: list[tuple[Any, ...]] = []
    with _recording_loads(cls, calls):
        agent = cls(opts)
    if not calls:  # its __init__ did not load: do what a TorchAgent does, as ParlAI's agents do in __init__
        agent.load(path)  # type: ignore[attr-defined]
    return noting_unknown_options(agent, opts)


def loads_itself(cls: type[Agent]) -> bool:
    """Whether accelbatch loads ``-mf`` into a ``cls`` agent with its ``load(path)``: a plain Agent (not a
    TorchAgent, which loads in ``__init__``) whose class has one (the base Agent has none)."""
    return not issubclass(cls, TorchAgent) and callable(getattr(cls, "load", None))


def saves_itself(agent: Agent) -> bool:
    """Whether -mf can be written: a TorchAgent, or an agent whose class has its own save(path) (the base Agent
    has none), which training calls as ParlAI's does."""
    return isinstance(agent, TorchAgent) or callable(getattr(type(agent), "save", None))


def unread_model_file(agent: Agent, opts: Opts) -> str | None:
    """The note for an existing ``-mf`` that ``agent`` cannot read: a plain Agent without ``load(path)`` runs
    as built (an eval of it would score an empty agent), else None."""
    path = opts.model_file
    if not path or not os.path.isfile(path) or isinstance(agent, TorchAgent) or loads_itself(type(agent)):
        return None
    return (f"-mf {path}: {type(agent).__name__} has no load(path), so it runs as built, without what the file "
            "holds; give it a load(path) (called right after the agent is built)")


@contextlib.contextmanager
def _recording_loads(cls: type[Agent], calls: list[tuple[Any, ...]]) -> Iterator[None]:
    """While constructing: ``cls.load`` records its calls (then runs as written); restored afterwards."""
    own = vars(cls).get("load")  # the class's own attribute (None: inherited), put back as it was
    original = inspect.getattr_static(cls, "load")  # a function, staticmethod or classmethod

    def load(self: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append(args)
        return original.__get__(self, type(self))(*args, **kwargs)

    cls.load = load  # type: ignore[attr-defined]
    try:
        yield
    finally:
        if own is None:
            del cls.load  # type: ignore[attr-defined]
        else:
            cls.load = own  # type: ignore[attr-defined]


def noting_unknown_options(agent: Agent, opts: Opts) -> Agent:
    """``agent``, whose load notes say so when it loaded -mf from a file without the PATH.opt that keeps the
    options the model was trained with (nothing else can tell that it runs with others)."""
    path = opts.model_file
    if path and os.path.isfile(path) and not os.path.exists(f"{path}.opt") and hasattr(agent, "load_notes"):
        agent.load_notes.append(f"-mf {path}: no {path}.opt beside it (the options the model was trained with): "
                                "running with the options given and the defaults; give those it was trained with "
                                "(-m, -t, -esz, -tr, --label-truncate, -histsz, --seed)")
    return agent
