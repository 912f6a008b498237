"""The batched front end's steps, pass by pass: which flat indices each step of this process serves, from the
schedule's RowSchedule (fixed rows) or BatchPlan (``--dynamic-batching``)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Iterator, Sequence

import numpy as np
from torch.utils.data import Sampler

from accelbatch.data.batching import Batch, BatchingConfig, default_max_tokens, plan_buckets, token_cache_size
from accelbatch.data.config import LoaderConfig
from accelbatch.data.datasets import Store
from accelbatch.data.orders import PassOrder, make_order, mixes_tasks
from accelbatch.data.schedule import BatchPlan, RowSchedule

__all__ = ["PassSteps", "Step", "batching_config"]


@dataclass(frozen=True)
class Step:
    """What a data worker builds: step ``index`` of ``pass_`` serves flat indices ``ids`` (real rows) in a
    batch of ``rows`` rows padded to ``padded_len`` (0: the collate's own padding)."""

    pass_: int
    index: int
    ids: tuple[int, ...]
    rows: int
    padded_len: int


class PassSteps(Sampler):
    """This process's steps, pass by pass: the rows of a RowSchedule or the batches of a BatchPlan."""

    def __init__(self, store: Store, config: LoaderConfig, training: bool, shard: tuple[int, int], rows: int,
                 lengths: np.ndarray | None, batching: BatchingConfig | None, serve: Sequence[int] | None = None,
                 cut: Callable[[int], Sequence[Sequence[int]]] | None = None):
        index, count = shard
        self.shard, self.cut = shard, cut
        self.training, self.pad, self.static_rows = training, store.pad, config.static_rows
        self.table = store.table.shard(index, count, whole_small_tasks=training and config.shuffle and serve is None
                                       and cut is None)  # a hogwild process's multitask draws: see shard
        self.pass_, self.skip = 0, 0
        self._current: tuple[int, int] | None = None  # (pass, first index) of the pass under way
        # a hogwild process's share of the episodes (it steps on its own: no replica's rows, no cut of them)
        # (multitask draws are not each episode once: such a share runs on as one process's rows do)
        self.own_share = training and shard[1] > 1 and serve is None and cut is None and \
            not mixes_tasks(self.table, config.shuffle)
        if batching is None:
            # shuffled training data cycles: a row's episodes run on into the next pass. Ordered data (ParlAI's
            # train:ordered) does not, its pass ends padded as an evaluation's does; nor does a hogwild
            # process's share, each pass in its epoch's order, so that it trains every example once a pass
            self.loop = training and config.shuffle and not self.own_share
            self._order = make_order(self.table, training and config.shuffle, config.seed,
                                     balance_tasks=not training and config.validation_max_exs > 0)
            self._layout = (rows, store.pad, serve)
            self.rows = self._schedule(0)
            self.plan, self.lengths = None, None
            self.per_pass = math.ceil(self.table.num_examples / rows) if self.loop else 0
        else:
            # with `cut` (every replica's rows of an n-row call) each replica plans the combined batches of all
            # the data and runs its rows of each; a tail that leaves a replica no row is left out. Without it
            # (hogwild processes, which step on their own) each plans its own share of the episodes
            self.plan = BatchPlan(store.table if cut else self.table, 0 if cut else index, lengths, batching, training,
                                  training and config.shuffle, config.seed, config.drop_last,
                                  partial(_every_replica_runs, cut) if cut else None, config.validation_max_exs)
            self.rows, self.lengths, self.per_pass = None, lengths, 0

    def _schedule(self, pass_: int) -> RowSchedule:
        """The rows' schedule: one for every pass when it loops, else pass ``pass_``'s own (its steps are its
        longest row's turns, which vary with the pass's order)."""
        rows, pad, serve = self._layout
        order = self._order if self.loop else PassOrder(self._order, pass_)
        return RowSchedule(self.table, rows, order, loop=self.loop, pad=pad, serve=serve)

    def _pass_rows(self, pass_: int) -> RowSchedule:
        if not self.rows.loop and self.rows.order.first != pass_:  # type: ignore[attr-defined]
            self.rows = self._schedule(pass_)
        return self.rows

    def steps_in(self, pass_: int) -> int:
        if self.plan is not None:
            return self.plan.count(pass_)[0]
        return self.per_pass if self.rows.loop else self._pass_rows(pass_).steps or 0

    def dropped(self, pass_: int) -> int:
        """This process's share of the examples ``pass_`` leaves out (the replicas' add up to the plan's)."""
        dropped = 0 if self.plan is None else self.plan.count(pass_)[1]
        if self.cut is None:
            return dropped
        index, count = self.shard
        return dropped // count + int(index < dropped % count)

    def begin_pass(self) -> None:
        """A new pass: called once per pass by the DataLoader (torch may iterate a sampler twice per pass)."""
        self._current = (self.pass_, self.skip)
        self.pass_, self.skip = self.pass_ + 1, 0

    def __len__(self) -> int:
        return self.steps_in(self.pass_ if self._current is None else self._current[0])

    def __iter__(self) -> Iterator[Step]:
        if self._current is None:
            self.begin_pass()
        pass_, first = self._current  # type: ignore[misc]
        if self.plan is not None:
            return (self._plan_step(pass_, i, b) for i, b in enumerate(self.plan.batches(pass_, first), first))
        return self._row_steps(pass_, first)

    def _plan_step(self, pass_: int, index: int, batch: Batch[int]) -> Step:
        """A batch of the plan, or with ``cut`` this replica's rows of it (padding rows left out in training)."""
        if self.cut is None:
            return Step(pass_, index, tuple(batch.items), batch.rows, batch.padded_len)
        rows = list(self.cut(batch.num_real if self.training else batch.rows)[self.shard[0]])
        ids = tuple(batch.items[r] for r in rows if r < batch.num_real)
        return Step(pass_, index, ids, len(rows), batch.padded_len)

    def _row_steps(self, pass_: int, first: int) -> Iterator[Step]:
        steps = self.steps_in(pass_)
        rows = self.rows if self.rows.loop else self._pass_rows(pass_)
        start = (pass_ * steps if rows.loop else 0) + first  # not cycling: each pass is its schedule's one pass
        if rows.next_step != start:
            rows.seek(start)
        index = first
        while index < steps:
            block = rows.block(min(steps - index, max(16, 65536 // rows.rows)))
            for row in block.tolist():
                ids = tuple(i for i in row if i != self.pad)
                yield Step(pass_, index, ids, rows.rows if self.static_rows else len(ids), 0)
                index += 1

    def digest(self, pass_: int) -> str:
        """What decides the steps (data, shard, rows or plan, order): a position of other ones is refused."""
        key = (f"{self.table.digest()}:{self.rows.layout_rows}:{self.rows.serve.tolist()}:{self.rows.order!r}"
               if self.plan is None else self.plan.key() + (f":{self.shard}" if self.cut else ""))
        return hashlib.sha256(key.encode()).hexdigest()[:16]


def _every_replica_runs(cut: Callable[[int], Sequence[Sequence[int]]], rows: int) -> bool:
    """True when each replica gets a row of an ``rows``-row call (a replica cannot step on none)."""
    return all(cut(rows))


def batching_config(config: LoaderConfig, lengths: np.ndarray,
                    shards: int = 1) -> tuple[BatchingConfig, list | None]:
    """The BatchingConfig of ``config``'s dynamic batching over examples of ``lengths``, and its bucket shapes."""
    strategy, bs = config.dynamic_batching, config.batch_size
    max_tokens, shapes = config.max_batch_tokens, None
    if strategy in ("full", "buckets") and max_tokens < 1:
        max_tokens = default_max_tokens(bs, config.text_truncate, config.label_truncate, lengths.tolist())
    if strategy == "buckets":
        shapes = plan_buckets(lengths.tolist(), config.num_buckets, bs, max_tokens, config.row_multiple,
                              shards=shards)
    cache = config.batch_sort_cache_size
    if strategy == "full":
        cache = token_cache_size(cache, max_tokens, lengths)
    batching = BatchingConfig(strategy, bs, max_tokens=max_tokens, cache_size=cache,
                              count=config.token_count, row_multiple=config.row_multiple,
                              pad_rows=config.static_rows, shapes=tuple(shapes) if shapes else None)
    return batching, shapes

