"""What a hogwild process trains on without a batch plan: its shard of the episodes, pass after pass.

A training feed's rows run on into the next epoch where their part of this one ends (no row idles), which
over a whole run is fair but leaves no point where a process has trained its shard exactly once. In a
hogwild process :class:`ShardPasses` serves the shard in whole passes instead: pass ``p`` in the order's
epoch ``p`` (a fresh seeded permutation, or data order with ``:ordered``), its last step padded (padding rows
are not trained nor counted). Its :meth:`~ShardPasses.position` is what a batch plan's ``plan_position``
gives, so the main process holds a process that ended its pass until the others have (``-ne N`` exact) and
counts the rows trained.
"""

from __future__ import annotations

from typing import Any, Callable

from accelbatch.data.orders import Order, PassOrder, make_order, mixes_tasks
from accelbatch.data.schedule import EpisodeTable, Gather, RowSchedule
from accelbatch.loader_world import LoaderWorld
from accelbatch.multi_world import MultiWorld
from accelbatch.teachers import FixedTeacher, PassFeed, shuffles
from accelbatch.worlds import BatchWorld, World

__all__ = ["ShardPasses", "pass_share", "serve_passes", "shard_passes"]


class ShardPasses(PassFeed):
    """A shard's episodes in ``rows`` rows, one pass at a time (see the module docstring)."""

    def __init__(self, table: EpisodeTable, rows: int, order: Order, pad: int, gather: Gather):
        self._layout = (table, rows, order, pad)
        self.pass_no = 0
        super().__init__(self._schedule(0), gather)

    def _schedule(self, pass_no: int) -> RowSchedule:
        table, rows, order, pad = self._layout
        return RowSchedule(table, rows, PassOrder(order, pass_no), loop=False, pad=pad)

    def _begin_pass(self, pass_no: int) -> None:
        if pass_no != self.pass_no:
            self.pass_no, self.schedule = pass_no, self._schedule(pass_no)
        self.seek([0] * self.rows)

    def _next_pass(self) -> None:
        if min(self.row_steps) >= (self.schedule.steps or 0):
            self._begin_pass(self.pass_no + 1)

    def rewind(self) -> None:
        if self.pass_no:
            self._begin_pass(0)
        else:
            super().rewind()

    def position(self) -> tuple[int, int, int, int, tuple[int, ...]]:
        """(pass, its steps served, its steps, the shard's examples), as ``plan_position``: a pass served is
        the next one's step 0 (whose steps may differ: episodes of several turns); then the steps each row has
        examples for, which measure a part of the pass in examples (:func:`pass_share`)."""
        self._next_pass()
        schedule = self.schedule
        return (self.pass_no, min(self.row_steps), schedule.steps or 0, schedule.table.num_examples,
                tuple(schedule.row_totals or ()))

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "pass": self.pass_no}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._begin_pass(int(state.get("pass", 0)))
        super().load_state_dict(state)


Position = Callable[[], "tuple[Any, ...] | None"]


def pass_share(at: tuple[Any, ...], steps_on: int = 0) -> float:
    """The passes of a position ``at`` with ``steps_on`` more steps: whole passes, then the current one's share
    in examples where the position says how many each row serves (a row serves one example a step, so the
    last steps, where rows have run out, hold fewer), else in steps."""
    pass_no, done, steps, _, *totals = at
    step = done + steps_on
    if totals and totals[0] and step < steps:
        return pass_no + sum(min(t, step) for t in totals[0]) / max(1, sum(totals[0]))
    return pass_no + step / max(1, steps)


def serve_passes(world: World) -> Position:
    """Training: have the FixedTeacher of a hogwild process's world (its rows teacher clones) serve its shard
    in passes. Returns where the process is in its shard's passes: the feed's position, a LoaderWorld's
    ``plan_position`` (a batch plan's), or None (not known: several worlds, teachers of other kinds; multitask
    training draws episodes by task, so that a pass of draws is not each example once)."""
    base = world.world if isinstance(world, BatchWorld) else world
    teacher = None if isinstance(base, (LoaderWorld, MultiWorld)) else base.get_task_agent()
    if not isinstance(teacher, FixedTeacher) or not teacher.training or teacher.serving.layout:
        return getattr(world, "plan_position", lambda: None)
    if mixes_tasks(teacher.store.table, shuffles(teacher.datatype)):
        return lambda: None  # multitask draws: the examples trained measure the passes, as in one process
    return shard_passes(teacher).position


def shard_passes(teacher: FixedTeacher) -> ShardPasses:
    """Have a training ``teacher`` (its rows and shard set, not a replica's layout) and its clones serve its
    shard in passes; the feed."""
    serving, store = teacher.serving, teacher.store
    table = store.table.shard(*serving.shard)
    order = make_order(table, shuffles(teacher.datatype), teacher.opts.seed)
    serving.feed = ShardPasses(table, serving.rows, order, store.pad, store.gather)
    return serving.feed
