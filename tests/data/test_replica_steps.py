"""With ``cut`` (dynamic batching across replica processes) every replica plans the batches of all the data
for the combined batch and takes its rows of each; a tail that leaves a replica no row is left out."""

from __future__ import annotations

import pytest

from accelbatch.data import make_loader
from accelbatch.messages import Message


def _halves(rows: int) -> list[list[int]]:
    """A 2-replica layout of micro batch 4 (plan.shard's): replica 0 takes the first 4 rows of a tail."""
    return [list(range(min(rows, 4))), list(range(4, rows))]


def _steps(count: int, shard: tuple[int, int], **kw) -> tuple[list, int]:
    data = [Message(text=" ".join(["w"] * (1 + i % 5)), labels=["a"]) for i in range(count)]
    loader = make_loader(data, training=True, shard=shard, batch_size=8, dynamic_batching="batchsort",
                         drop_last=False, seed=3, **kw)
    return [(s.ids, s.rows) for s in loader.steps], loader.steps.dropped(0)


@pytest.mark.parametrize("count, tail_dropped", [(21, 0), (19, 3)])
def test_replicas_take_their_rows_of_the_one_process_plan(count, tail_dropped):
    whole, whole_dropped = _steps(count, (0, 1))
    assert whole_dropped == 0 and sorted(rows for _, rows in whole) == sorted([8, 8, count - 16])
    parts = [_steps(count, (r, 2), cut=_halves) for r in range(2)]
    kept = [step for step in whole if step[1] > 4]  # a 3-row tail gives replica 1 no row: left out
    for rank, (steps, _) in enumerate(parts):
        assert steps == [(tuple(ids[i] for i in _halves(len(ids))[rank]), len(_halves(len(ids))[rank]))
                         for ids, _ in kept]
    assert [dropped for _, dropped in parts] == [tail_dropped - tail_dropped // 2, tail_dropped // 2]
