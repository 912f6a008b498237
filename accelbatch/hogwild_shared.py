"""What hogwild's processes share besides the model: the episode cursor in shared memory, and the metric sums
each process sends back (merged into one report by the main process).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from accelbatch.agents import Agent, TorchAgent
from accelbatch.metrics import Metrics, merge_reports
from accelbatch.teachers import EpisodeCursor, epoch_order
from accelbatch.worlds import BatchWorld, MultiWorld, World


# --------------------------------------------------------------------------------------------------------
# the process-shared episode cursor
# --------------------------------------------------------------------------------------------------------
class SharedEpisodeCursor:
    """:class:`~accelbatch.teachers.EpisodeCursor` for processes: position and epoch in shared memory.

    ``take``/``exhausted``/``rewind`` behave as EpisodeCursor's do, and the order of an epoch is the same
    (:func:`~accelbatch.teachers.epoch_order` of the epoch), computed in each
    process from the shared epoch number. Made in the main process and handed to children at spawn.
    """

    def __init__(self, num_episodes: int, shuffle: bool, seed: int, ctx: Any):
        self.num_episodes = num_episodes
        self.shuffle = shuffle
        self.seed = seed
        self._next = ctx.RawValue("q", 0)
        self._epoch = ctx.RawValue("q", 0)
        self._lock = ctx.Lock()
        self._order_epoch = -1
        self._order: list[int] = []

    @classmethod
    def like(cls, cursor: EpisodeCursor, ctx: Any) -> "SharedEpisodeCursor":
        return cls(cursor.num_episodes, cursor.shuffle, cursor.seed, ctx)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_order_epoch"], state["_order"] = -1, []
        return state

    @property
    def lock(self) -> Any:
        return self._lock

    @property
    def next_index(self) -> int:
        return self._next.value

    @property
    def epoch(self) -> int:
        return self._epoch.value

    @property
    def order(self) -> list[int]:
        return list(self._order_for(self._epoch.value))

    def _order_for(self, epoch: int) -> list[int]:
        if epoch != self._order_epoch:
            self._order = epoch_order(self.num_episodes, self.shuffle, self.seed, epoch)
            self._order_epoch = epoch
        return self._order

    def take(self, loop: bool) -> int | None:
        """The next episode index, or None when the epoch is over and ``loop`` is False."""
        with self._lock:
            position = self._next.value
            if position >= self.num_episodes:
                if not loop:
                    return None
                self._epoch.value += 1
                position = 0
            self._next.value = position + 1
            epoch = self._epoch.value
        return self._order_for(epoch)[position]

    def exhausted(self) -> bool:
        return self._next.value >= self.num_episodes

    def rewind(self) -> None:
        with self._lock:
            self._next.value = 0
            self._epoch.value = 0


# --------------------------------------------------------------------------------------------------------
# walking worlds
# --------------------------------------------------------------------------------------------------------
def task_teachers(world: World) -> list[list[Agent]]:
    """The teacher agents of ``world`` grouped by task (group i: every clone of task i's teacher)."""
    if isinstance(world, BatchWorld):
        groups = task_teachers(world.world)
        for clone in world.worlds:
            for i, teachers in enumerate(task_teachers(clone)):
                groups[i].extend(teachers)
    elif isinstance(world, MultiWorld):
        groups = [[w.get_task_agent()] for w in world.worlds]
    else:
        groups = [[world.get_task_agent()]]
    out = []
    for group in groups:
        seen: dict[int, Agent] = {}
        for teacher in group:
            seen.setdefault(id(teacher), teacher)
        out.append(list(seen.values()))
    return out


def multi_worlds(world: World) -> list[MultiWorld]:
    if isinstance(world, BatchWorld):
        return multi_worlds(world.world) + [m for w in world.worlds for m in multi_worlds(w)]
    return [world] if isinstance(world, MultiWorld) else []


def _base_world(world: World) -> World:
    return world.world if isinstance(world, BatchWorld) else world


def model_module(agent: Agent) -> torch.nn.Module | None:
    model = getattr(agent, "model", None)
    return model if isinstance(model, torch.nn.Module) else None


def _agent_metrics(agent: Agent) -> tuple[str, Any]:
    metrics = getattr(agent, "metrics", None)
    if isinstance(metrics, Metrics):
        return ("metrics", metrics.state())
    return ("report", dict(agent.report()))


def _task_metrics(world: World) -> tuple[str, Any]:
    teacher = world.get_task_agent()
    if teacher is None:  # a loader-fed world scores the replies itself
        metrics = getattr(world, "metrics", None)
        if isinstance(metrics, Metrics):
            return ("metrics", metrics.state())
        rep = dict(world.report())
        return ("report", {k: v for k, v in rep.items() if k in ("exs", "accuracy", "f1")})
    return _agent_metrics(teacher)


def world_metric_states(world: World) -> dict[str, Any]:
    """What :meth:`HogwildWorld.report` needs from one process: each task's and the model's metric sums."""
    base = _base_world(world)
    if isinstance(base, MultiWorld):
        tasks = [(name, _task_metrics(w)) for name, w in zip(base.names, base.worlds)]
        model = base.worlds[0].get_model_agent()
    else:
        tasks = [(None, _task_metrics(base))]
        model = base.get_model_agent()
    return {"tasks": tasks, "model": _agent_metrics(model), "model_is_torch": isinstance(model, TorchAgent)}


def _merge_kind(parts: Sequence[tuple[str, Any]]) -> dict[str, float]:
    """One agent's (or world's) metrics from every process, merged into one report."""
    if all(kind == "metrics" for kind, _ in parts):
        total = Metrics()
        for _, state in parts:
            total.merge_state(state)
        return total.report()
    # agents without a Metrics object: examples summed, the rest averaged weighted by examples
    reports = [rep if kind == "report" else _state_report(rep) for kind, rep in parts]
    exs = sum(float(r.get("exs", 0)) for r in reports)
    merged: dict[str, float] = {}
    if any("exs" in r for r in reports):
        merged["exs"] = exs
    keys = {k for r in reports for k in r if k != "exs"}
    for key in sorted(keys):
        have = [r for r in reports if key in r]
        weights = [float(r.get("exs", 1)) for r in have]
        if sum(weights) > 0:
            merged[key] = sum(w * r[key] for w, r in zip(weights, have)) / sum(weights)
        else:
            merged[key] = sum(r[key] for r in have) / len(have)
    return merged


def _state_report(state: dict) -> dict[str, float]:
    metrics = Metrics()
    metrics.merge_state(state)
    return metrics.report()


def merge_world_states(states: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One report from every process's :func:`world_metric_states`, keyed as World.report keys it."""
    if not states:
        return {}
    names = [name for name, _ in states[0]["tasks"]]
    task_reports = []
    for i, name in enumerate(names):
        task_reports.append((name, _merge_kind([s["tasks"][i][1] for s in states])))
    model_rep = _merge_kind([s["model"] for s in states])
    if states[0]["model_is_torch"]:
        model_rep.pop("exs", None)  # TorchAgent.report leaves examples to the teacher
    if len(names) == 1 and names[0] is None:
        report = dict(task_reports[0][1])
    else:
        report = merge_reports(task_reports)
    report.update(model_rep)
    return report
