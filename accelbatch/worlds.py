"""Worlds: where agents take turns. They know agents and messages, never devices.

- :class:`DialogPartnerWorld`: a teacher and a model; one parley is ParlAI's four steps
  (teacher act, model observe, model act, teacher observe).
- :class:`BatchWorld`: ``rows`` copies of a world stepped together; the original model agent's
  ``batch_act`` answers all rows at once (unless it has none or sets ``use_batch_act = False``).
- :class:`~accelbatch.loader_world.LoaderWorld` (its own module): the batched front end.
- :class:`~accelbatch.multi_world.MultiWorld` (its own module): several tasks whose teachers are not all
  FixedTeachers.

Every world has ``state_dict()`` / ``load_state_dict()``: its data position (the teacher's feed, the agents'
conversations, the loader's step), taken between parleys.
"""

from __future__ import annotations

from collections import deque
from functools import partial
from itertools import repeat
from time import perf_counter
from typing import Any, Sequence

from accelbatch.agent_checks import from_shared, shared_of
from accelbatch.agents import Agent
from accelbatch.data.datasets import checked_teacher_act
from accelbatch.messages import (
    TEXT,
    Message,
    ReplyError,
    checked_batch_act,
    is_padding,
    refuse_non_messages,
    refuse_unobserved,
)
from accelbatch.opts import Opts
from accelbatch.report_merge import drop_full_scored, with_loss_count
from accelbatch.teachers import FixedTeacher, Teacher
from accelbatch.world_display import display, display_parley, display_rows, show

_consume = partial(deque, maxlen=0)  # runs an iterator to its end in C


class World:
    """Base world: a list of agents taking turns."""

    def __init__(self, opts: Opts, agents: Sequence[Agent] | None = (), shared: dict[str, Any] | None = None):
        """ParlAI's signature: without ``agents``, ``shared`` (another world's :meth:`share`) gives their clones."""
        self.opts = opts
        self.agents = list(agents or ()) or [from_shared(s) for s in (shared or {}).get("agents", ())]
        self.acts: list[Message | None] = [None] * len(self.agents)
        self.total_exs = 0  # examples (non-padding teacher turns) parleyed so far
        self.total_parleys = 0  # parley() calls so far
        self.data_time_s = 0.0  # seconds spent producing the model's inputs (the device waits meanwhile)
        self.runtime: Any = None  # what the build attached (backend, plan): run() reads it, the world never does

    def get_total_exs(self) -> int:
        """Examples parleyed since the world was made (padding rows excluded)."""
        return self.total_exs

    def get_total_parleys(self) -> int:
        """ParlAI's: parley() calls since the world was made (or reset)."""
        return self.total_parleys

    def get_total_epochs(self) -> float:
        """Epochs parleyed (ParlAI's): examples so far over the examples of one epoch. In a data-parallel run
        each replica's world counts its own examples; the train report's ``epochs`` adds the replicas'."""
        per_epoch = self.num_examples()
        return self.get_total_exs() / per_epoch if per_epoch > 0 else 0.0

    def display(self) -> str:
        """The last parley's messages as text (ParlAI's display): the teacher's, then the model's reply."""
        return display_parley(self.get_acts())

    def parley(self) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement parley()")

    def update_counters(self) -> None:
        """ParlAI's: count a parley of a world of yours and the examples its first agent's act served (one, or a
        wrapped BatchWorld's batch; padding aside); call it at the end of parley(), as ParlAI's worlds do, so that
        a training run can count epochs."""
        self.total_parleys += 1
        first = self.acts[0] if self.acts else None  # one example, or a wrapped BatchWorld's batch of them
        self.total_exs += sum(1 for act in (first if isinstance(first, list) else [first])
                              if act is not None and not is_padding(act))

    def parley_init(self) -> None:
        """Called by BatchWorld before each batched parley."""

    def finish_parleys(self) -> None:
        """Return once every parley started so far has ended (its updates made): a world whose parleys run
        elsewhere (hogwild processes) waits for them; one that parleys in the caller has nothing to wait for."""

    def get_agents(self) -> list[Agent]:
        return self.agents

    def get_acts(self) -> list[Message | None]:
        return self.acts

    def episode_done(self) -> bool:
        """ParlAI's: whether the last parley ended an episode (a plain world cannot tell: False)."""
        return False

    def getID(self) -> str:  # noqa: N802 - ParlAI's name
        """ParlAI's: the world's name, its class's."""
        return type(self).__name__

    def __enter__(self) -> "World":
        """``with world:`` shuts the world down at the block's end (ParlAI's)."""
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.shutdown()

    def task_worlds(self) -> list["World"]:
        """The worlds of one task each that this world parleys: itself (a MultiWorld: one per task)."""
        return [self]

    def get_task_agent(self) -> Teacher:
        return self.get_agents()[0]  # type: ignore[return-value]

    def get_model_agent(self) -> Agent:
        return self.get_agents()[-1]

    def clone(self) -> "World":
        return type(self)(self.opts, [a.clone() for a in self.agents])

    def share(self) -> dict[str, Any]:
        """ParlAI's: what ``World(opts, None, shared)`` builds a copy from (each agent's share())."""
        return {"world_class": type(self), "opts": self.opts, "agents": [shared_of(a) for a in self.agents]}

    def epoch_done(self) -> bool:
        return any(getattr(a, "epoch_done", lambda: False)() for a in self.agents)

    def num_examples(self) -> int:
        return self.get_task_agent().num_examples()

    def passes(self) -> float | None:
        """Passes over the training data parleyed, where the examples trained do not measure them (a batch
        plan that leaves examples out); None: get_total_exs() / num_examples() does."""
        return None

    def num_episodes(self) -> int:
        return self.get_task_agent().num_episodes()

    def task_report(self) -> dict[str, float]:
        """The teacher's metrics (examples, accuracy, f1)."""
        return dict(self.get_task_agent().report())

    def report(self) -> dict[str, float]:
        return with_model_report(self.task_report(), self.get_model_agent())

    def reset_metrics(self) -> None:
        for agent in self.agents:
            agent.reset_metrics()

    def reset(self) -> None:
        for agent in self.agents:
            agent.reset()
        self.acts = [None] * len(self.agents)
        self.total_exs = self.total_parleys = 0  # ParlAI's World.reset: the counts (exs, epochs, parleys) restart

    def state_dict(self) -> dict[str, Any]:
        """The data position: the teacher's, the model agent's conversation, the examples count."""
        teacher, model = self.get_task_agent(), self.get_model_agent()
        return {"total_exs": self.total_exs, "teacher": teacher.state_dict(), "agents": [model.state_dict()]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.get_task_agent().load_state_dict(state["teacher"])
        _restore_agents([self.get_model_agent()], state["agents"])
        self.total_exs = int(state["total_exs"])

    def shutdown(self) -> None:
        for agent in self.agents:
            agent.shutdown()


def _restore_agents(agents: Sequence[Any], states: Sequence[Any]) -> None:
    """Agent clones (or row worlds) from their states, which must be as many."""
    if len(agents) != len(states):
        raise ValueError(f"the checkpoint holds {len(states)} agent clones, this world has {len(agents)}; "
                         "resume with the same -bs, -di, -ga, -rf and -nt")
    for agent, state in zip(agents, states):
        agent.load_state_dict(state)


class DialogPartnerWorld(World):
    """A teacher and a model agent: ParlAI's four-step parley."""

    def parley(self) -> None:
        teacher, model = self.agents
        self.total_parleys += 1
        self.acts[0] = _own_acts([teacher], [teacher.act()])[0]
        if not is_padding(self.acts[0]):
            self.total_exs += 1
        model.observe(self.acts[0])
        self.acts[1] = reply = model.act()
        refuse_non_messages(model, "act()", [reply])
        teacher.observe(reply)
        if self.opts.display_examples:
            show(display_parley(self.acts))

    def episode_done(self) -> bool:
        """ParlAI's: whether the teacher's last act ended its episode."""
        return self.acts[0] is not None and bool(self.acts[0].get("episode_done", False))


def with_model_report(task_report: dict[str, float], model: Agent) -> dict[str, float]:
    """The teacher's report with the model agent's metrics added; a metric both report is the teacher's (as in
    ParlAI, the first agent's), so a model cannot report its own accuracy or F1, nor ``exs`` (the teacher's
    count of the examples served)."""
    rep = dict(task_report)
    rep.update((name, value) for name, value in with_loss_count(model.report()).items() if name not in rep)
    return drop_full_scored(rep)


def _own_acts(teachers: Sequence[Any], acts: list) -> list:
    """Each row's act, checked (:func:`checked_teacher_act`) where its teacher is one of yours that acts itself
    (rows of a MultiWorld may each be on another task); a FixedTeacher's are its store's, checked already."""
    return [checked_teacher_act(t, act) if isinstance(t, Teacher) and type(t).act is not FixedTeacher.act else act
            for t, act in zip(teachers, acts)]


def _fixed_teachers(world: World) -> list[FixedTeacher]:
    return [w.get_task_agent() for w in world.task_worlds() if isinstance(w.get_task_agent(), FixedTeacher)]


class BatchWorld(World):
    """``rows`` clones of a world stepped together, the model answering them in one batch_act.

    The teachers' clones are the rows of their teacher's feed. When the rows are a plain FixedTeacher and a
    model agent (the usual case), the world reads the feed for all rows at once and the teacher scores the
    whole batch in one call: the same examples in the same order as each clone acting and observing in turn.
    A model agent that keeps the base ``observe`` then gets the examples straight in ``batch_act``.
    """

    def __init__(self, opts: Opts, world: World, rows: int):
        super().__init__(opts, world.get_agents())
        self.world = world
        self.rows = rows
        for teacher in _fixed_teachers(world):
            teacher.serve_rows(rows)
        self.worlds = [world.clone() for _ in range(rows)]
        for row, clone in enumerate(self.worlds):
            for teacher in _fixed_teachers(clone):
                teacher.row = row
        # hooks that do nothing are not called once per row (checked once, the row worlds never change type)
        self._parley_init = any(type(w).parley_init is not World.parley_init for w in self.worlds)
        model = world.get_model_agent()
        self._model_rows = [w.get_model_agent() for w in self.worlds]
        self._model_observes = type(model).observe is not Agent.observe
        self._model_self_observes = type(model).self_observe is not Agent.self_observe
        self._model_batch_acts = hasattr(model, "batch_act")
        teacher = world.get_task_agent()
        plain = (type(world) is DialogPartnerWorld and isinstance(teacher, FixedTeacher)
                 and type(teacher).act is FixedTeacher.act and type(teacher).observe is FixedTeacher.observe
                 and not self._parley_init and not opts.display_examples)
        self._teacher: FixedTeacher | None = teacher if plain else None  # type: ignore[assignment]

    def clone(self) -> "BatchWorld":
        """Another BatchWorld of as many rows over a clone of the world it batches (the same model agent's
        clones, the teacher's data from its start)."""
        return BatchWorld(self.opts, self.world.clone(), self.rows)
    def get_agents(self) -> list[Agent]:
        return self.world.get_agents()

    def parley(self) -> None:
        """One step of every row; then get_acts() is [the rows' teacher acts, the model's replies], one per row
        (a padding row: the teacher's padding act and the model's reply to it), as ParlAI's BatchWorld."""
        self.total_parleys += 1
        teacher = self._teacher
        if teacher is not None:  # the teachers' side for all rows at once (ParlAI's four steps per row)
            start = perf_counter()
            step = teacher.feed.step()
            examples, answers, real = step[0], step[1], step[-1]
            # the step's examples sit far apart in memory (a shuffled order): one tight C loop over them has
            # their cache misses overlap, where the agent would meet them one by one between its own work
            _consume(map(dict.__contains__, examples, repeat(TEXT, len(examples))))
            self.total_exs += real
            if self._model_observes:  # else its clones would only store the example, which batch_act gets
                examples = [agent.observe(example) for agent, example in zip(self._model_rows, examples)]
            self.data_time_s += perf_counter() - start
            replies = self._model_replies(examples)
            self.acts = [step[0], replies]
            for w, example, reply in zip(self.worlds, step[0], replies):  # each row world's get_acts() too
                w.acts[0], w.acts[1] = example, reply
            teacher.score(replies, answers, real, step[2] if len(step) > 3 else None)
            return
        if self._parley_init:
            for w in self.worlds:
                w.parley_init()
        num_agents = len(self.world.get_agents())
        observations: list[list[Message | None]] = [[] for _ in range(num_agents)]
        for index in range(num_agents):
            start = perf_counter() if index == 0 else 0.0
            acts = self.batch_act(index, observations[index])
            for other in range(num_agents):
                if other != index:
                    observations[other] = self.batch_observe(other, acts, index)
            if index == 0:  # the teacher's acts and the model clones' observe (vectorize): data work
                self.data_time_s += perf_counter() - start
        shown = display_rows([w.get_acts() for w in self.worlds]) if self.opts.display_examples else ""
        if shown:  # nothing when every row is padding (a hogwild process past its share)
            show(shown)

    def _model_replies(self, examples: list[Message]) -> list[Message]:
        """The model's replies to one example per row: one batch_act, else each row's clone acts."""
        model = self.world.agents[-1]
        if self._model_batch_acts and getattr(model, "use_batch_act", True):
            if self._model_observes:  # else the examples are the teacher's own
                refuse_unobserved(self._model_rows, examples)
            replies = checked_batch_act(model, examples)
            refuse_non_messages(model, "batch_act()", replies)
            if self._model_self_observes:
                for agent, reply in zip(self._model_rows, replies):
                    agent.self_observe(reply)
            return replies
        out = []
        for agent, example in zip(self._model_rows, examples):
            if not self._model_observes:
                agent.observe(example)
            out.append(agent.act())
        refuse_non_messages(model, "act()", out)
        return out

    def _row_agents(self, index: int) -> list[Agent]:
        return [w.get_agents()[index] for w in self.worlds]

    def batch_act(self, index: int, observations: list[Message | None]) -> list[Message]:
        original = self.world.get_agents()[index]
        agents = self._row_agents(index)
        batched = bool(observations) and hasattr(original, "batch_act") and getattr(original, "use_batch_act", True)
        if batched:
            refuse_unobserved(agents, observations)
            acts = checked_batch_act(original, observations)
            if any(type(a).self_observe is not Agent.self_observe for a in agents):
                for agent, act in zip(agents, acts):
                    agent.self_observe(act)
        else:
            acts = [agent.act() for agent in agents]
        if index:  # a model's replies (a teacher's None is a padding row)
            refuse_non_messages(original, "batch_act()" if batched else "act()", acts)
        acts = _own_acts(agents, acts) if not index else acts
        for w, act in zip(self.worlds, acts):
            w.get_acts()[index] = act
        self.acts[index] = acts
        return acts

    def batch_observe(self, index: int, acts: list[Message], source: int) -> list[Message | None]:
        """Each row's agent ``index`` observes its act."""
        if source == 0:
            self.total_exs += sum(1 for act in acts if not is_padding(act))
        return [agent.observe(act) for agent, act in zip(self._row_agents(index), acts)]

    def display(self) -> str:
        """The last parley's rows: each row's example, then the model's reply to it."""
        if self._teacher is not None:
            return display_rows(list(zip(*self.acts))) if self.acts[0] is not None else ""
        return display_rows([w.get_acts() for w in self.worlds])

    def epoch_done(self) -> bool:
        if self._teacher is not None:
            return not self._teacher.cycles and self._teacher.feed.done()
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
        self.acts = [None] * len(self.acts)
        self.total_exs = self.total_parleys = 0

    def state_dict(self) -> dict[str, Any]:
        """The teacher's feed once and each row's conversation; rows that act one by one (custom worlds,
        several tasks of other teachers) each keep their whole world's state."""
        state: dict[str, Any] = {"total_exs": self.total_exs, "world": self.world.state_dict()}
        if self._teacher is not None:
            state["agents"] = [agent.state_dict() for agent in self._model_rows]
        else:
            state["rows"] = [w.state_dict() for w in self.worlds]
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.world.load_state_dict(state["world"])
        if self._teacher is not None:
            _restore_agents(self._model_rows, state["agents"])
        else:
            _restore_agents(self.worlds, state["rows"])  # type: ignore[arg-type]
        self.total_exs = int(state["total_exs"])

    def shutdown(self) -> None:
        self.world.shutdown()


__all__ = ["BatchWorld", "DialogPartnerWorld", "ReplyError", "World", "display"]
