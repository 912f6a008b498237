"""An ordered training pass (``-dt train:ordered``, no dynamic batching) ends with partial steps when its
episodes do not fill every row of every step: some rows have served their part while others go on. Which
rows are real at each step follows from the data and the plan alone, so what the device and the replicas
cannot train is refused before the first step (it failed at the end of the pass, or, with replica processes,
a replica that ran out of rows started the next pass early and trained other weights than one process).
Only steps the run's step and epoch limits reach are checked (``-tstep``, ``-ne``: a run that stops before its
pass's tail needs none; ``-ttim``, a time, is taken as not stopping it earlier)."""

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


def _plan_rows(plan: ExecutionPlan, real: np.ndarray, replicas: int) -> list[list[int]]:
    """The laid-out rows ``real`` of a step as one process's call gives them to each replica, in order."""
    rows = torch.arange(len(real))
    return [real[plan.shard({"row": rows}, r)["row"].numpy()].tolist() for r in range(replicas)]


def check_ordered_pass(opts: Opts, plan: ExecutionPlan, table: EpisodeTable, layout_rows: int,
                       runs_partial_tails: bool, replica_rows: Sequence[Sequence[int]] | None = None) -> None:
    """Refuse in one line an ordered pass whose partial steps this run cannot train as one process would:
    a step the plan cannot lay out (``--drop-last`` keeps no tail of an ordered pass: its steps are its data),
    a partial tail on a device of static shapes, or replica processes holding other rows of a step than the
    plan's layout gives them, or none (``replica_rows``: each replica's rows of the ``layout_rows`` laid out)."""
    pass_of = (f"-dt {opts.datatype}: a pass of {table.num_episodes} episodes over {layout_rows} rows "
               f"(-bs x -di x -rf x -ga)")
    whole = "train shuffled (-dt train: every step is full), or choose -bs so that the episodes fill every step"
    steps = partial_steps(table, layout_rows, opts.seed)
    for step, real in reached(opts, steps, layout_rows, table.num_examples):
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
        serving = set(real.tolist())
        held = [[row for row in mine if row in serving] for mine in replica_rows]
        try:
            given = _plan_rows(plan, real, len(replica_rows))
        except PlanError:
            given = []
        if held != given:
            differ = next((r for r in range(len(held)) if not given or held[r] != given[r]), 0)
            raise OptionError(f"{pass_of} has a step of {rows} rows (step {step + 1}) of which replica process "
                              f"{differ} holds rows {held[differ]} where one process gives it "
                              f"{given[differ] if given else 'none'}: {whole}")
        if any(not mine for mine in held):
            raise OptionError(f"{pass_of} has a step of {rows} rows (step {step + 1}) of which replica "
                              f"{[len(m) for m in held].index(0)} holds none: a replica process runs every step "
                              f"with rows of its own: {whole}")
        if len({len(mine) for mine in held}) > 1:  # each counts the pass's examples by its own rows
            raise OptionError(f"{pass_of} has a step of {rows} rows (step {step + 1}) that the replica processes "
                              f"hold unevenly ({' and '.join(str(len(m)) for m in held)} rows): each counts the pass "
                              f"by its own rows, so they would end it at other steps: {whole}")
