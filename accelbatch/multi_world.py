"""MultiWorld: several tasks whose teachers are not all FixedTeachers (those are combined into one
:class:`~accelbatch.teachers.MultiTaskTeacher`) sharing one model agent; training picks a task per episode,
evaluation runs them in turn."""

from __future__ import annotations

import random
from typing import Any, Sequence

from accelbatch.agents import Agent
from accelbatch.messages import Message
from accelbatch.metrics import merge_reports
from accelbatch.opts import Opts
from accelbatch.task_weights import STOCHASTIC, task_weights
from accelbatch.teachers import is_training
from accelbatch.worlds import DialogPartnerWorld, World, with_model_report

__all__ = ["MultiWorld"]


class MultiWorld(World):
    """Several task worlds sharing one model agent (tasks whose teachers are not all FixedTeachers).

    Training picks a task at random for each new episode (uniformly, or by -mtw); evaluation runs each task to
    its end, in the order given. The report has each task's metrics prefixed by its name and their macro average.
    """

    def __init__(self, opts: Opts, worlds: Sequence[World], names: Sequence[str]):
        super().__init__(opts, worlds[0].get_agents())
        self.worlds = list(worlds)
        self.names = list(names)
        self.training = is_training(opts.datatype)
        self.rng = random.Random(opts.seed)
        self.current = 0
        spec = opts.multitask_weights  # ParlAI's -mtw; 'stochastic' weighs each task by its episodes
        counts = [w.num_episodes() for w in self.worlds] if spec.strip() == STOCHASTIC else [1] * len(self.worlds)
        self.weights = task_weights(spec, counts) if self.training else ()

    def task_worlds(self) -> list[World]:
        return list(self.worlds)

    def get_agents(self) -> list[Agent]:
        return self.worlds[self.current].get_agents()

    def get_acts(self) -> list[Message | None]:
        return self.worlds[self.current].get_acts()

    def clone(self) -> "MultiWorld":
        model = self.worlds[0].get_model_agent().clone()
        worlds = [DialogPartnerWorld(w.opts, [w.get_task_agent().clone(), model]) for w in self.worlds]
        return MultiWorld(self.opts, worlds, self.names)

    def parley_init(self) -> None:
        last = self.worlds[self.current].get_acts()[0]
        if last and not last.get("episode_done", True):
            return  # finish the episode on the task it started on
        if self.training and self.weights:
            self.current = self.rng.choices(range(len(self.worlds)), weights=self.weights)[0]
        elif self.training:
            self.current = self.rng.randrange(len(self.worlds))
        else:
            while self.current < len(self.worlds) - 1 and self.worlds[self.current].epoch_done():
                self.current += 1

    def parley(self) -> None:
        self.parley_init()
        world = self.worlds[self.current]
        before = world.get_total_exs()
        self.total_parleys += 1
        world.parley()
        self.total_exs += world.get_total_exs() - before

    def epoch_done(self) -> bool:
        return all(w.epoch_done() for w in self.worlds)

    @property
    def data_time_s(self) -> float:  # type: ignore[override]
        return sum(w.data_time_s for w in self.worlds)

    @data_time_s.setter
    def data_time_s(self, value: float) -> None:
        pass  # the task worlds keep their own

    def num_examples(self) -> int:
        return sum(w.num_examples() for w in self.worlds)

    def num_episodes(self) -> int:
        return sum(w.num_episodes() for w in self.worlds)

    def report(self) -> dict[str, float]:
        merged = merge_reports((name, w.task_report()) for name, w in zip(self.names, self.worlds))
        return with_model_report(merged, self.worlds[0].get_model_agent())

    def reset_metrics(self) -> None:
        for w in self.worlds:
            w.reset_metrics()

    def reset(self) -> None:
        for w in self.worlds:
            w.reset()
        self.current = 0
        self.total_exs = self.total_parleys = 0

    def state_dict(self) -> dict[str, Any]:
        last = self.worlds[self.current].get_acts()[0]
        return {"total_exs": self.total_exs, "current": self.current, "rng": list(self.rng.getstate()[1]),
                "in_episode": bool(last and not last.get("episode_done", True)),
                "worlds": [w.state_dict() for w in self.worlds]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for w, saved in zip(self.worlds, state["worlds"]):
            w.load_state_dict(saved)
        self.current = int(state["current"])
        self.rng.setstate((3, tuple(int(x) for x in state["rng"]), None))
        if state["in_episode"]:  # parley_init keeps the task while the last teacher act has episode_done False
            self.worlds[self.current].get_acts()[0] = Message(episode_done=False)
        self.total_exs = int(state["total_exs"])

    def shutdown(self) -> None:
        for w in self.worlds:
            w.shutdown()
