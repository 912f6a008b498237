"""An ordered training pass (``-dt train:ordered``, no dynamic batching) ends with partial steps when its
episodes do not fill every row of every step: some rows have served their part while others go on. Which
rows are real at each step follows from the data and the plan alone, so what the device and the replicas
cannot train is refused before the first step (it failed at the end of the pass, or, with replica processes,
a replica that ran out of rows started the next pass early and trained other weights than one process).
Only steps the run's limits reach are checked (``-tstep``, ``-ne``: a run that stops before its pass's tail
needs none); a run that ``-ttim`` may stop earlier is checked only for replica processes, whose failure is
silent (elsewhere such a step fails when it comes)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch

from accelbatch.data.episodes import EpisodeTable
from accelbatch.data.orders import make_order
from accelbatch.data.schedule import RowSchedule
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import ExecutionPlan, PlanError


def partial_steps(table: EpisodeTable, rows: int, seed: int) -> list[tuple[int, np.ndarray]]:
    """(step, the laid-out rows that still serve at it) for each step of an ordered pass over ``table`` with
    ``rows`` rows at which some row has already served its part."""
    turns = np.diff(RowSchedule(table, rows, make_order(table, False, seed), loop=False, pad=-1).runs(0)[1])
    return [(step, np.flatnonzero(turns > step)) for step in range(int(turns.min()), int(turns.max()))]


def reached(opts: Opts, steps: list[tuple[int, np.ndarray]], rows: int, examples: int
            ) -> list[tuple[int, np.ndarray]]:
    """The partial ``steps`` of the first pass that the run's step and epoch limits let it train: step ``s`` runs
    when ``-tstep`` is above ``s`` and fewer than ``-ne`` x the pass's ``examples`` trained before it."""
    out: list[tuple[int, np.ndarray]] = []
    trained = steps[0][0] * rows if steps else 0  # the full steps before the first partial one
    for step, real in steps:
        if 0 < opts.max_train_steps <= step or 0 < opts.num_epochs * examples <= trained:
            break
        out.append((step, real))
        trained += len(real)
    return out


def _plan_shares(plan: ExecutionPlan, rows: int, replicas: int) -> list[int]:
    """The rows one process's call of ``rows`` rows gives each replica."""
    return [len(plan.shard({"row": torch.arange(rows)}, r)["row"]) for r in range(replicas)]


def check_ordered_pass(opts: Opts, plan: ExecutionPlan, table: EpisodeTable, runs_partial_tails: bool,
                       replica_rows: Sequence[Sequence[int]] | None = None) -> None:
    """Refuse in one line an ordered pass whose partial steps this run cannot train as one process would:
    a step the plan cannot lay out (``--drop-last`` keeps no tail of an ordered pass: its steps are its data),
    a partial tail on a device of static shapes, or replica processes holding other rows of a step than the
    plan's layout gives them, or none (``replica_rows``: each replica's laid-out rows)."""
    if replica_rows is None and opts.max_train_time > 0:
        return  # -ttim may end the run before its tail: such a step is refused when it comes
    pass_of = (f"-dt {opts.datatype}: a pass of {table.num_episodes} episodes over {plan.combined_batch} rows "
               f"(-bs x -di x -rf x -ga)")
    whole = "train shuffled (-dt train: every step is full), or choose -bs so that the episodes fill every step"
    steps = partial_steps(table, plan.combined_batch, opts.seed)
    for step, real in reached(opts, steps, plan.combined_batch, table.num_examples):
        rows = len(real)
        if plan.drop_last and rows % plan.factor:
            fix = "add --no-drop-last to train it as a partial tail, or " \
                if runs_partial_tails and replica_rows is None else ""
            raise OptionError(f"{pass_of} has a step of {rows} rows (step {step + 1}), which micro-batches of "
                              f"D x R x G = {plan.factor} cannot lay out: {fix}{whole}")
        if not runs_partial_tails and rows % plan.factor:
            raise OptionError(f"{pass_of} ends with a partial step of {rows} rows (step {step + 1}); --device "
                              f"{opts.device} runs graphs of static shapes, which cannot train it: {whole}")
        if replica_rows is None:
            continue
        held = [int(np.isin(real, mine).sum()) for mine in replica_rows]
        try:
            shares = _plan_shares(plan, rows, len(replica_rows))
        except PlanError:
            shares = []
        if held != shares:
            raise OptionError(f"{pass_of} has a step of {rows} rows (step {step + 1}) that the {len(held)} replica "
                              f"processes hold as {held} where one process lays them out as {shares or 'none'}: "
                              f"{whole}")
        if 0 in held:
            raise OptionError(f"{pass_of} has a step of {rows} rows (step {step + 1}) of which replica "
                              f"{held.index(0)} holds none: a replica process runs every step with rows of its "
                              f"own: {whole}")
