"""accelbatch: ParlAI-style worlds and agents, run unchanged on cpu, cuda and ipu with one execution plan.

    import accelbatch as ab
    opts = ab.Opts(task="babi:1", model="memnn", device="cpu", batchsize=32)
    world = ab.create_world(opts)
    report = ab.run(world, opts)
"""

from __future__ import annotations

# numpy before torch: torch's C module imports numpy while it initialises and clears any error raised there,
# a KeyboardInterrupt included, so a Ctrl-C landing in that import would be lost and the run would go on.
import numpy  # noqa: F401

from accelbatch.agents import Agent, TorchAgent
from accelbatch.build import create_world
from accelbatch.loader_world import LoaderWorld
from accelbatch.messages import Message
from accelbatch.metrics import Metrics
from accelbatch.opts import Opts
from accelbatch.run import evaluate, format_report, run
from accelbatch.teachers import FixedTeacher, Teacher
from accelbatch.worlds import BatchWorld, DialogPartnerWorld, MultiWorld, World

__version__ = "0.1.0"

__all__ = [
    "Agent", "TorchAgent", "Message", "Metrics", "Opts", "run", "evaluate", "format_report",
    "FixedTeacher", "Teacher", "World", "DialogPartnerWorld", "BatchWorld", "LoaderWorld", "MultiWorld",
    "create_world",
]
