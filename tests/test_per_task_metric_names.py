"""A multitask run's per-task metric names (``-vmt TASK/name``, ``--metrics TASK/name``) are checked before the
run against what each task's own row holds: its teacher's scores (exs, accuracy, f1), not the model's loss,
which covers all tasks (a ``TASK/loss`` validation metric failed only at the first validation, an epoch on)."""

from __future__ import annotations

import pytest

import accelbatch as ab
from accelbatch.metric_names import metric_names_problem

BASE = dict(task="babi:1,babi:2", model="bag", batchsize=4, progress=False)


@pytest.mark.parametrize("feed", [dict(), dict(num_workers=2)], ids=["batch-world", "loader"])
@pytest.mark.parametrize("option, name, refused", [
    ("validation_metric", "babi:2/loss", True), ("validation_metric", "babi:2/accuracy", False),
    ("validation_metric", "babi:2/f1", False), ("validation_metric", "babi:9/accuracy", True),
    ("metrics", "babi:2/loss", True), ("metrics", "babi:1/exs", False), ("metrics", "loss", False)])
def test_per_task_names_are_what_a_task_row_holds(feed, option, name, refused):
    opts = ab.Opts(**BASE, **feed, **{option: name})
    world = ab.create_world(opts)
    try:
        problem = metric_names_problem(world, opts)
    finally:
        world.shutdown()
    assert (problem is not None) == refused, problem
    if refused:
        assert name in problem and "\n" not in problem
