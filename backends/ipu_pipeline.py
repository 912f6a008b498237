"""``--pipeline NAME,...`` on ``--device ipu``: the model split over IPUs at named submodules.

Each NAME is a submodule of the agent's model (a dotted path, as ``model.named_modules()`` lists it) where a
new stage starts: the model's forward up to the first NAME is stage 0 on IPU 0, and from the k-th NAME on
(until the next) stage k on IPU k, by ``poptorch.BeginBlock(submodule, user_id="stage<k>", ipu_id=k)``, so
K names give K + 1 stages. ``--ipu-execution-strategy`` picks how the stages run:

- ``pipelined`` (default, ``poptorch.PipelinedExecution``): the stages work on successive micro-batches at
  once, one IPU each. PopTorch counts 2S - 1 stages when a model of S stages trains, so training needs
  ``-ga`` >= 2S - 1, and an inference graph ``-di`` >= S (the eval graphs have the plan's D).
- ``sharded`` (``poptorch.ShardedExecution``): one IPU per stage, run one after the other (no rule on G, D).
- ``phased`` (``poptorch.SerialPhasedExecution``): stage k is phase k, every phase on IPU 0 in turn, so a
  replica takes one IPU and the weights stream in from off-chip memory.

The split changes where the model runs, never its numbers: the weights after training equal the unsplit
model's (on the emulator exactly). A replica takes S IPUs (1 when phased), and -rf x that must be a number
of IPUs an IPU system can reserve (a power of 2 or a multiple of 64). All of this is checked when the model
is compiled, before any step, with one-line PlanErrors naming the option.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from accelbatch.opts import IPU_STRATEGIES
from accelbatch.plan import ExecutionPlan, PlanError, reserved_ipus
from accelbatch.split_points import parse_split_points

# set on a submodule the backend made a stage start at: (stage index) so a second compile keeps it
_STAGE_MARK = "_accelbatch_pipeline_stage"


@dataclass(frozen=True)
class PipelineSettings:
    """The split points (submodule names) and the execution strategy of ``--pipeline``."""

    split_points: tuple[str, ...] = ()
    strategy: str = "pipelined"

    @classmethod
    def from_opts(cls, opts: Any) -> "PipelineSettings":
        try:
            points = parse_split_points(getattr(opts, "pipeline", None))
        except ValueError as exc:
            raise PlanError(f"--pipeline: {exc}") from None
        strategy = getattr(opts, "ipu_execution_strategy", None) or "pipelined"
        if strategy not in IPU_STRATEGIES:
            raise PlanError(f"--ipu-execution-strategy {strategy}: use one of {', '.join(IPU_STRATEGIES)}")
        return cls(points, strategy)

    @property
    def stages(self) -> int:
        return len(self.split_points) + 1

    @property
    def ipus_per_replica(self) -> int:
        return 1 if self.strategy == "phased" else self.stages

    def check_replicas(self, replicas: int) -> None:
        """PlanError unless ``replicas`` x the IPUs of a replica is a count an IPU system reserves."""
        if self.stages == 1:
            return
        n = replicas * self.ipus_per_replica
        if reserved_ipus(n) != n:
            raise PlanError(
                f"--pipeline: {self.stages} stages x -rf {replicas} = {n} IPUs, but an IPU system reserves a power "
                f"of 2 or a multiple of 64 IPUs ({reserved_ipus(n)} would be held, {reserved_ipus(n) - n} idle): "
                "change the number of split points or -rf, or use --ipu-execution-strategy phased (1 IPU a replica)")

    def check_plan(self, plan: ExecutionPlan) -> None:
        """PopTorch's pipeline depth rule for ``plan`` (and for its eval graphs, which have its D)."""
        if self.stages == 1 or self.strategy != "pipelined":
            return
        s = self.stages
        if plan.training and plan.gradient_accumulation < 2 * s - 1:
            raise PlanError(
                f"--pipeline: {s} pipelined stages train as {2 * s - 1} (PopTorch adds {s - 1} backward stages), "
                f"so -ga/--gradient-accumulation must be at least {2 * s - 1}, got {plan.gradient_accumulation} "
                "(or use --ipu-execution-strategy sharded)")
        if plan.device_iterations < s:
            raise PlanError(
                f"--pipeline: an inference pipeline of {s} stages needs -di/--device-iterations >= {s} "
                f"(evaluation runs with the plan's D), got {plan.device_iterations} "
                "(or use --ipu-execution-strategy sharded)")

    def check_names(self, model: torch.nn.Module) -> list[torch.nn.Module]:
        """The submodules of ``model`` at the split points; PlanError naming the first unknown one. Run it
        before :meth:`check_plan`: a misspelt name is the error to report, not the stage count it implies."""
        modules = dict(model.named_modules())
        for name in self.split_points:
            if name not in modules or name == "":
                children = ", ".join(n for n, _ in model.named_children()) or "none"
                raise PlanError(f"--pipeline: the model ({type(model).__name__}) has no submodule {name!r}; its "
                                f"top-level submodules are: {children} (dotted paths reach deeper ones)")
        return [modules[name] for name in self.split_points]

    def annotate(self, poptorch: Any, model: torch.nn.Module) -> None:
        """``BeginBlock`` at each split point of ``model`` (kept when already there); every name is checked
        (:meth:`check_names`) before any is marked."""
        for k, (name, sub) in enumerate(zip(self.split_points, self.check_names(model)), start=1):
            mark = sub.__dict__.get(_STAGE_MARK)
            if mark == k:
                continue
            if mark is not None:
                raise PlanError(f"--pipeline: submodule {name!r} already starts stage {mark} of this model")
            poptorch.BeginBlock(sub, user_id=f"stage{k}", ipu_id=k)
            sub.__dict__[_STAGE_MARK] = k

    def execution_strategy(self, poptorch: Any) -> Any:
        """The ``poptorch`` execution strategy object for these stages (None for an unsplit model)."""
        if self.stages == 1:
            return None
        if self.strategy == "sharded":
            return poptorch.ShardedExecution()
        if self.strategy == "phased":
            strategy = poptorch.SerialPhasedExecution(*[[f"stage{k}"] for k in range(self.stages)])
            for k in range(self.stages):
                strategy.phase(k).ipus(0)
            return strategy
        return poptorch.PipelinedExecution()


__all__ = ["PipelineSettings"]
