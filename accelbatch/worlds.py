"""Worlds: where agents take turns. They know agents and messages, never devices.

- :class:`DialogPartnerWorld`: a teacher and a model; one parley is ParlAI's four steps
  (teacher act, model observe, model act, teacher observe).
- :class:`BatchWorld`: ``rows`` copies of a world stepped together; the original model agent's
  ``batch_act`` answers all rows at once (unless it has none or sets ``use_batch_act = False``).
- :class:`MultiWorld`: several tasks; training picks a task per episode, evaluation runs them in turn.
- :func:`create_world`: the world for a set of options.
"""

from __future__ import annotations

import random
import time
from typing import Sequence

from accelbatch.agents import Agent, resolve_agent_class
from accelbatch.messages import Message, is_padding
from accelbatch.metrics import merge_reports
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan
from accelbatch.teacher_rows import RowBlock
from accelbatch.data.sharding import ShardSpec
from accelbatch.teachers import FixedTeacher, Teacher, create_teachers, is_training


class World:
    """Base world: a list of agents taking turns."""

    def __init__(self, opts: Opts, agents: Sequence[Agent] = ()):
        self.opts = opts
        self.agents = list(agents)
        self.acts: list[Message | None] = [None] * len(self.agents)
        self.total_exs = 0  # examples (non-padding teacher turns) parleyed so far
        self.data_time_s = 0.0  # seconds spent producing the model's inputs (the device waits meanwhile)

    def get_total_exs(self) -> int:
        """Examples parleyed since the world was made (padding rows excluded)."""
        return self.total_exs

    def parley(self) -> None:
        raise NotImplementedError

    def parley_init(self) -> None:
        """Called by BatchWorld before each batched parley."""

    def get_agents(self) -> list[Agent]:
        return self.agents

    def get_acts(self) -> list[Message | None]:
        return self.acts

    def get_task_agent(self) -> Teacher:
        return self.get_agents()[0]  # type: ignore[return-value]

    def get_model_agent(self) -> Agent:
        return self.get_agents()[-1]

    def clone(self) -> "World":
        return type(self)(self.opts, [a.clone() for a in self.agents])

    def epoch_done(self) -> bool:
        return any(getattr(a, "epoch_done", lambda: False)() for a in self.agents)

    def num_examples(self) -> int:
        return self.get_task_agent().num_examples()

    def num_episodes(self) -> int:
        return self.get_task_agent().num_episodes()

    def task_report(self) -> dict[str, float]:
        """The teacher's metrics (examples, accuracy, f1)."""
        return dict(self.get_task_agent().report())

    def report(self) -> dict[str, float]:
        rep = self.task_report()
        rep.update(self.get_model_agent().report())
        return rep

    def reset_metrics(self) -> None:
        for agent in self.agents:
            agent.reset_metrics()

    def reset(self) -> None:
        for agent in self.agents:
            agent.reset()
        self.acts = [None] * len(self.agents)

    def shutdown(self) -> None:
        for agent in self.agents:
            agent.shutdown()


class DialogPartnerWorld(World):
    """A teacher and a model agent: ParlAI's four-step parley."""

    def parley(self) -> None:
        teacher, model = self.agents
        self.acts[0] = teacher.act()
        if not is_padding(self.acts[0]):
            self.total_exs += 1
        model.observe(self.acts[0])
        self.acts[1] = model.act()
        teacher.observe(self.acts[1])
        if self.opts.display_examples:
            print(display(self.acts))


def _act_on(agent: Agent, observation: Message, observed: bool) -> Message:
    """``agent.act()`` on ``observation`` (which it observes first unless it already has)."""
    if not observed:
        agent.observe(observation)
    return agent.act()


def display(acts: Sequence[Message | None]) -> str:
    lines = []
    for act in acts:
        if act:
            lines.append(f"[{act.get('id', '?')}]: {act.get('text', '')}"
                         + (f"  (labels: {'|'.join(act.get('labels') or act.get('eval_labels') or [])})"
                            if act.get("labels") or act.get("eval_labels") else ""))
    return "\n".join(lines)


class BatchWorld(World):
    """``rows`` clones of a world stepped together, the model answering them in one batch_act.

    When the rows are a plain FixedTeacher and a model agent (the usual case), the teachers' clones move as
    one :class:`~accelbatch.teacher_rows.RowBlock` and their replies are scored in one
    :meth:`~accelbatch.metrics.Metrics.add_replies`: the same examples in the same order as each clone acting
    and observing in turn, the per-row loops in :mod:`accelbatch.row_kernels`. A model agent that keeps the
    base ``observe`` then gets the examples straight in ``batch_act`` (its clones do not store them as
    ``observation``).
    """

    def __init__(self, opts: Opts, world: World, rows: int):
        super().__init__(opts, world.get_agents())
        self.world = world
        self.rows = rows
        self.worlds = [world.clone() for _ in range(rows)]
        # hooks that do nothing are not called once per row (checked once, the row worlds never change type)
        self._parley_init = any(type(w).parley_init is not World.parley_init for w in self.worlds)
        self._block = self._teacher_block()
        model = world.get_model_agent()
        self._model_rows = [w.get_model_agent() for w in self.worlds]
        self._model_observes = type(model).observe is not Agent.observe
        self._model_self_observes = type(model).self_observe is not Agent.self_observe
        self._model_batch_acts = hasattr(model, "batch_act")

    def _teacher_block(self) -> RowBlock | None:
        """The teachers' clones as one block, when the rows are plain teacher + model worlds."""
        if type(self.world) is not DialogPartnerWorld or self._parley_init or self.opts.display_examples:
            return None
        teacher = self.world.get_task_agent()
        row_block = getattr(teacher, "row_block", None)
        return None if row_block is None else row_block([w.get_task_agent() for w in self.worlds])

    def get_agents(self) -> list[Agent]:
        return self.world.get_agents()

    def parley(self) -> None:
        block = self._block
        if block is not None:  # the teachers' side for all rows at once (ParlAI's four steps per row)
            start = time.perf_counter()
            examples, answers, real_rows = block.act()
            self.total_exs += real_rows
            if self._model_observes:  # else its clones would only store the example, which batch_act gets
                examples = [agent.observe(example) for agent, example in zip(self._model_rows, examples)]
            self.data_time_s += time.perf_counter() - start
            block.score(self._model_replies(examples), answers, real_rows)
            return
        if self._parley_init:
            for w in self.worlds:
                w.parley_init()
        num_agents = len(self.world.get_agents())
        observations: list[list[Message | None]] = [[] for _ in range(num_agents)]
        for index in range(num_agents):
            start = time.perf_counter() if index == 0 else 0.0
            acts = self.batch_act(index, observations[index])
            for other in range(num_agents):
                if other != index:
                    observations[other] = self.batch_observe(other, acts, index)
            if index == 0:  # the teacher's acts and the model clones' observe (vectorize): data work
                self.data_time_s += time.perf_counter() - start

    def _model_replies(self, examples: list[Message]) -> list[Message]:
        """The model's replies to one example per row: one batch_act, else each row's clone acts."""
        model = self.world.agents[-1]
        if self._model_batch_acts and getattr(model, "use_batch_act", True):
            replies = model.batch_act(examples)
            if self._model_self_observes:
                for agent, reply in zip(self._model_rows, replies):
                    agent.self_observe(reply)
            return replies
        return [_act_on(agent, example, observed=self._model_observes)
                for agent, example in zip(self._model_rows, examples)]

    def _row_agents(self, index: int) -> list[Agent]:
        return [w.get_agents()[index] for w in self.worlds]

    def batch_act(self, index: int, observations: list[Message | None]) -> list[Message]:
        original = self.world.get_agents()[index]
        if observations and hasattr(original, "batch_act") and getattr(original, "use_batch_act", True):
            acts = original.batch_act(observations)
            agents = self._row_agents(index)
            for w, act in zip(self.worlds, acts):
                w.get_acts()[index] = act
            if any(type(a).self_observe is not Agent.self_observe for a in agents):
                for agent, act in zip(agents, acts):
                    agent.self_observe(act)
            return acts
        hook = getattr(original, "batch_act_rows", None)
        agents = self._row_agents(index)
        acts = hook(agents) if hook is not None else [agent.act() for agent in agents]
        for w, act in zip(self.worlds, acts):
            w.get_acts()[index] = act
        return acts

    def batch_observe(self, index: int, acts: list[Message], source: int) -> list[Message | None]:
        """Each row's agent ``index`` observes its act; an agent with ``batch_observe_rows(agents, acts)``
        (e.g. a FixedTeacher scoring a whole batch in one pass) does it for all rows at once."""
        if source == 0:
            self.total_exs += sum(1 for act in acts if not is_padding(act))
        agents = self._row_agents(index)
        hook = getattr(self.world.get_agents()[index], "batch_observe_rows", None)
        if hook is not None:
            return hook(agents, acts)
        return [agent.observe(act) for agent, act in zip(agents, acts)]

    def epoch_done(self) -> bool:
        if self._block is not None and not hasattr(self.world.get_model_agent(), "epoch_done"):
            return not self._block.loop and self._block.epoch_done()
        return all(w.epoch_done() for w in self.worlds)

    def num_examples(self) -> int:
        return self.world.num_examples()

    def num_episodes(self) -> int:
        return self.world.num_episodes()

    def report(self) -> dict[str, float]:
        return self.world.report()

    def reset_metrics(self) -> None:
        self.world.reset_metrics()

    def reset(self) -> None:
        for w in self.worlds:
            w.reset()
        self.world.reset()

    def shutdown(self) -> None:
        self.world.shutdown()


class MultiWorld(World):
    """Several task worlds sharing one model agent.

    Training picks a task at random for each new episode; evaluation runs each task to its end, in
    the order given. The report has each task's metrics prefixed by its name and their macro average.
    """

    def __init__(self, opts: Opts, worlds: Sequence[World], names: Sequence[str]):
        super().__init__(opts, worlds[0].get_agents())
        self.worlds = list(worlds)
        self.names = list(names)
        self.training = is_training(opts.datatype)
        self.rng = random.Random(opts.seed)
        self.current = 0

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
        if self.training:
            self.current = self.rng.randrange(len(self.worlds))
        else:
            while self.current < len(self.worlds) - 1 and self.worlds[self.current].epoch_done():
                self.current += 1

    def parley(self) -> None:
        self.parley_init()
        world = self.worlds[self.current]
        before = world.get_total_exs()
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
        merged.update(self.worlds[0].get_model_agent().report())
        return merged

    def reset_metrics(self) -> None:
        for w in self.worlds:
            w.reset_metrics()

    def reset(self) -> None:
        for w in self.worlds:
            w.reset()
        self.current = 0

    def shutdown(self) -> None:
        for w in self.worlds:
            w.shutdown()


def world_rows(opts: Opts) -> int:
    """Rows per world step: the execution plan's combined batch (micro batch x D x R x G)."""
    return ExecutionPlan.from_opts(opts, training=is_training(opts.datatype)).combined_batch


def replica_shard() -> ShardSpec:
    """This process's data shard: its rank among the replicas of torch.distributed (or torchrun's
    RANK/WORLD_SIZE when the backend joins the group later, as accelerate does)."""
    import os

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        rank, size = dist.get_rank(), dist.get_world_size()
    else:
        rank, size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return ShardSpec(num_replicas=size, replica_index=rank) if size > 1 else ShardSpec()


def make_agent(opts: Opts, agent: Agent | type[Agent] | None) -> Agent:
    """The model agent: built from -m, from a class, or a fork of an existing agent (same model)."""
    if agent is None:
        return resolve_agent_class(opts.model)(opts)
    if isinstance(agent, type):
        return agent(opts)
    return agent.fork()


def create_world(opts: Opts, agent: Agent | type[Agent] | None = None, rows: int | None = None) -> World:
    """The world for ``opts``: one task or several (MultiWorld), batched when rows > 1.

    ``agent`` may be None (use ``opts.model``), an Agent class, or an agent instance whose model the
    new world shares (e.g. the training agent, for a validation world). Under torch.distributed with
    several replicas, each process's world holds its replica's share of the rows and of the data.
    With the data loader options (see :func:`accelbatch.loader_world.uses_loader`) the world is fed
    by the loader; otherwise it is ParlAI's BatchWorld of teacher and agent clones. With
    ``--numthreads N`` > 1 it is a HogwildWorld: N processes, one model in shared memory.
    """
    if opts.numthreads > 1:
        from accelbatch.hogwild import create_hogwild_world  # hogwild's children call back with numthreads=1

        return create_hogwild_world(opts, agent=agent, rows=rows)
    from accelbatch.loader_world import make_loader_worlds, uses_loader

    shard = replica_shard()
    model = make_agent(opts, agent)
    plan = ExecutionPlan.from_opts(opts, training=is_training(opts.datatype))
    tasks = [t.strip() for t in opts.task.split(",") if t.strip()]
    if uses_loader(opts):
        worlds: list[World] = list(make_loader_worlds(opts, model, plan, shard))
        return worlds[0] if len(worlds) == 1 else MultiWorld(opts, worlds, tasks)
    teachers = create_teachers(opts)
    for teacher in teachers:
        if isinstance(teacher, FixedTeacher):
            teacher.keep_shard(shard.rank, shard.world_size)
    if len(teachers) == 1:
        world: World = DialogPartnerWorld(opts, [teachers[0], model])
    else:
        world = MultiWorld(opts, [DialogPartnerWorld(opts, [t, model]) for t in teachers], tasks)
    rows = plan.combined_batch // shard.world_size if rows is None else rows
    return BatchWorld(opts, world, rows) if rows > 1 else world
