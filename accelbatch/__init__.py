"""accelbatch: ParlAI-style worlds and agents, run unchanged on cpu, cuda and ipu with one execution plan.

    import accelbatch as ab
    opts = ab.Opts(task="babi:1", model="memnn", device="cpu", batchsize=32)
    world = ab.create_world(opts)
    report = ab.run(world, opts)

The names below are imported on first use, so that importing a part of the package (the command line's
entry point, a data worker) does not import torch before it needs it.
"""

from __future__ import annotations

import importlib
import sys
import types

TYPE_CHECKING = False  # typing.TYPE_CHECKING, without importing typing before the entry point runs
if TYPE_CHECKING:
    from typing import Any

    from accelbatch.agents import Agent, TorchAgent
    from accelbatch.build import create_world
    from accelbatch.loader_world import LoaderWorld
    from accelbatch.messages import Message
    from accelbatch.metrics import Metrics
    from accelbatch.model_opts import opts_from_model_file
    from accelbatch.multi_world import MultiWorld
    from accelbatch.opts import Opts
    from accelbatch.report_table import format_report
    from accelbatch.run import evaluate, run
    from accelbatch.teachers import FixedTeacher, Teacher
    from accelbatch.worlds import BatchWorld, DialogPartnerWorld, World

__version__ = "0.1.0"

_WHERE = {
    "Agent": "agents", "TorchAgent": "agents", "create_world": "build", "LoaderWorld": "loader_world",
    "Message": "messages", "Metrics": "metrics", "Opts": "opts", "evaluate": "run", "format_report": "report_table",
    "opts_from_model_file": "model_opts", "run": "run", "FixedTeacher": "teachers", "Teacher": "teachers",
    "BatchWorld": "worlds", "DialogPartnerWorld": "worlds", "MultiWorld": "multi_world", "World": "worlds",
}

__all__ = [
    "Agent", "TorchAgent", "Message", "Metrics", "Opts", "run", "evaluate", "format_report",
    "FixedTeacher", "Teacher", "World", "DialogPartnerWorld", "BatchWorld", "LoaderWorld", "MultiWorld",
    "create_world", "opts_from_model_file",
]


# ParlAI's factories, and what builds the same here
_PARLAI_FACTORIES = {
    "create_agent": "ab.create_world(opts, agent=MyAgent) builds the agent with its world (world.get_model_agent())",
    "create_task": "ab.create_world(opts) builds the task's teacher, the agent and their world",
    "create_agent_from_model_file": "ab.opts_from_model_file(PATH) reads its options; ab.create_world builds them",
}


def __getattr__(name: str) -> Any:
    module = _WHERE.get(name)
    if module is None:
        instead = _PARLAI_FACTORIES.get(name)
        raise AttributeError(f"module 'accelbatch' has no attribute {name!r}"
                             + (f" (ParlAI's; here {instead})" if instead else ""))
    value = getattr(importlib.import_module(f"accelbatch.{module}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])


class _Package(types.ModuleType):
    """The package's module type: importing the module ``accelbatch.run`` sets the package's attribute
    ``run`` to that module, where ``accelbatch.run`` is the function ``run(world, opts)``; the function keeps
    the name (as it did when this file imported it eagerly, after the module)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WHERE and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


class _CheckoutBackends:
    """Imported from a source checkout (the folder holding accelbatch/ and backends/ comes first on sys.path,
    as with ``python -m accelbatch`` there), ``accelbatch.backends`` is the checkout's backends/ folder, which
    an installed package holds inside accelbatch/ (pyproject's package-dir); else the checkout's accelbatch/
    would hide the installed copy and lack its backends."""

    def __init__(self, folder: str) -> None:
        self.folder = folder

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != "accelbatch.backends":
            return None
        from importlib.util import spec_from_file_location

        return spec_from_file_location(name, f"{self.folder}/__init__.py", submodule_search_locations=[self.folder])


def _find_checkout_backends() -> None:
    import os

    here = os.path.dirname(os.path.abspath(__file__))
    folder = os.path.join(os.path.dirname(here), "backends")
    if not os.path.isdir(os.path.join(here, "backends")) and os.path.isfile(os.path.join(folder, "__init__.py")) \
            and not any(isinstance(finder, _CheckoutBackends) for finder in sys.meta_path):
        sys.meta_path.append(_CheckoutBackends(folder))


_find_checkout_backends()
