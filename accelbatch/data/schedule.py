"""The schedule: which example each batch row serves at each step. Both front ends read it.

Examples live in a store (:mod:`accelbatch.data.datasets`) under flat indices ``0 .. N-1`` (the turns of
every episode, in data order); :class:`EpisodeTable` names the episodes a process serves (its shard) by the
flat index of each episode's first turn and its number of turns. A schedule is a function of the table,
the seed and the epoch only, so it is the same whether the batch is built in this process (ParlAI's
BatchWorld of teacher and agent clones) or by data workers, and a data position is a count of steps.

:class:`RowSchedule` (no dynamic batching): ``rows`` rows, each serving whole episodes turn by turn. The
episodes of epoch ``e`` come in ``order(e)`` (:mod:`accelbatch.data.orders`: a seeded permutation in training,
data order in evaluation);
the stream of all epochs, ``order(0) ++ order(1) ++ ...`` (one epoch without ``loop``), is dealt to the rows
in turn: row ``r`` serves stream positions ``r, r + rows, r + 2 rows, ...``. In training a row goes on into
the next epoch when its part of this one ends, so no row ever idles; in evaluation a row that has served
its part serves padding (``pad``) and the schedule ends with the longest row.

:class:`BatchPlan` (``--dynamic-batching``): per epoch, the shard's examples (squashed turns) in a seeded
order (multitask: drawn by task, :func:`~accelbatch.data.orders.mixed_examples`) are cut into batches by a
strategy of :mod:`accelbatch.data.batching` (rows vary, padded lengths too).
"""

from __future__ import annotations

import random
from itertools import islice
from typing import Any, Callable, Iterator, Sequence, Tuple

import numpy as np

from accelbatch.data.batching import Batch, BatchingConfig
from accelbatch.data.episodes import EpisodeTable
from accelbatch.data.orders import Order, TaskBalancedOrder, make_order, mixed_examples, mixes_tasks, permutation

BLOCK_ELEMENTS = 1 << 16  # flat indices a RowFeed lays out at once (steps x rows)
BLOCK_BYTES = 8 << 20  # and of a file read on demand, at most about this much of its text


class RowSchedule:
    """``rows`` rows serving whole episodes (see the module docstring).

    Each epoch is laid out once for all rows: its episodes grouped by row (row ``r`` takes the stream
    positions congruent to ``r``), every turn's flat index in that order, and where each row's run starts.
    A row then serves its runs epoch after epoch, one turn per step, so :meth:`block` copies one slice per
    row and epoch: no Python work per step or per example.
    """

    def __init__(self, table: EpisodeTable, rows: int, order: Order, loop: bool, pad: int,
                 serve: Sequence[int] | None = None):
        if rows < 1:
            raise ValueError(f"RowSchedule: rows must be at least 1, got {rows}")
        if loop and table.num_examples == 0:  # a loop over nothing (or over empty episodes) would never end
            raise ValueError("RowSchedule: no examples to serve")
        serve_ = np.arange(rows, dtype=np.int64) if serve is None else np.asarray(serve, dtype=np.int64)
        if len(serve_) == 0 or serve_.min() < 0 or serve_.max() >= rows:
            raise ValueError(f"RowSchedule: rows to serve must lie in 0..{rows - 1}, got {list(serve_)}")
        self.table, self.order, self.loop, self.pad = table, order, loop, pad
        # the layout has `layout_rows` rows; this schedule serves rows `serve` of it (a replica's share of the
        # combined batch: each replica reads the rows a single process would give it)
        self.layout_rows, self.serve, self.rows = rows, serve_, len(serve_)
        self._runs: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        self._prune_at = 16
        self._epoch = np.zeros(self.rows, dtype=np.int64)  # per served row: the epoch it serves from
        self._offset = np.zeros(self.rows, dtype=np.int64)  # per served row: turns of that epoch's run served
        self._next_step = 0
        # evaluation: the steps each served row has examples for (the pass ends with the longest); None in training
        self.row_totals = None if loop else np.diff(self.runs(0)[1])[serve_].tolist()

    @property
    def steps(self) -> int | None:
        """Steps of the one pass (evaluation); None in training."""
        return None if self.row_totals is None else max(self.row_totals)

    @property
    def next_step(self) -> int:
        return self._next_step

    def runs(self, epoch: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices of ``epoch``'s turns grouped by row, where each row's run starts: ``rows + 1``)."""
        got = self._runs.get(epoch)
        if got is None:
            if len(self._runs) >= self._prune_at:  # epochs no row will read again go (amortised: not per call)
                oldest = int(self._epoch.min())
                self._runs = {e: r for e, r in self._runs.items() if e >= oldest}
                self._prune_at = max(16, 2 * len(self._runs))
            order, size, rows = np.asarray(self.order(epoch)), self.table.num_episodes, self.layout_rows
            # stream position epoch * size + i belongs to row (epoch * size + i) % rows: laid out `rows` wide from
            # that offset, each column holds one row's episodes, in order
            shift = epoch * size % rows
            grid = np.full(-(-(size + shift) // rows) * rows, -1, dtype=order.dtype)
            grid[shift:shift + size] = order
            grid = grid.reshape(-1, rows)
            turns = np.where(grid >= 0, self.table.turns[np.maximum(grid, 0)], 0)
            starts = np.zeros(rows + 1, dtype=np.int64)
            np.cumsum(turns.sum(axis=0), out=starts[1:])
            by_row = grid.T.ravel()
            got = self._runs[epoch] = (self.table.flat(by_row[by_row >= 0]), starts)
        return got

    def block(self, count: int) -> np.ndarray:
        """The next ``count`` steps, ``[count, rows]`` flat indices (``pad`` where a row has nothing)."""
        out = np.empty((self.rows, count), dtype=np.int64)
        for row, laid in enumerate(self.serve.tolist()):
            epoch, offset, filled = int(self._epoch[row]), int(self._offset[row]), 0
            while filled < count:
                if not self.loop and epoch > 0:
                    out[row, filled:] = self.pad
                    break
                flat, starts = self.runs(epoch)
                at, end = int(starts[laid]) + offset, int(starts[laid + 1])
                take = min(end - at, count - filled)
                out[row, filled:filled + take] = flat[at:at + take]
                filled, offset = filled + take, offset + take
                if at + take >= end:
                    epoch, offset = epoch + 1, 0
            self._epoch[row], self._offset[row] = epoch, offset
        self._next_step += count
        return out.T

    def seek(self, step: int) -> None:
        """Lay out from ``step`` on: each row's epochs skipped by the length of its runs."""
        self._next_step = step
        self._epoch[:] = 0
        self._offset[:] = 0
        left = np.full(self.rows, step, dtype=np.int64)
        while (left > 0).any():
            epoch = int(self._epoch[left > 0].min())
            if not self.loop and epoch > 0:
                break
            lengths = np.diff(self.runs(epoch)[1])[self.serve]
            here = (left > 0) & (self._epoch == epoch)
            whole = here & (left >= lengths)
            inside = here & ~whole
            self._offset[inside] = left[inside]
            left[inside] = 0
            left[whole] -= lengths[whole]
            self._epoch[whole] += 1


Gather = Callable[[np.ndarray], Tuple[np.ndarray, ...]]


def _indices(block: np.ndarray) -> tuple[np.ndarray, ...]:
    return (block,)


class RowFeed:
    """A RowSchedule read row by row (a teacher clone per row) or all rows at once (a BatchWorld's step).

    ``gather`` maps a laid-out block of flat indices to columns of the same shape (e.g. the examples and
    their answers, as object arrays: one C gather per block rather than a Python lookup per row); each step
    reads one row of each column. ``example_bytes``: what gathering one example reads from a file on
    average (0: the examples are in memory); a block then holds about :data:`BLOCK_BYTES` of a file's text,
    so a streamed file of large examples is parsed a few megabytes at a time. The rows stand at step
    ``base`` plus their own count of steps taken alone (``ahead``: clones acting one by one stay within a
    step of each other). ``state_dict`` is the rows' steps with the table's digest, so that a position taken
    on other data (or shard, or rows per step) is refused.
    """

    def __init__(self, schedule: RowSchedule, gather: Gather = _indices, example_bytes: float = 0.0):
        self.schedule, self.gather, self.example_bytes = schedule, gather, example_bytes
        self._base = 0
        self._ahead: list[int] | None = None  # per row, steps taken beyond base (None: all rows at base)
        self._columns: list[Any] = []
        self._real: list[int] = []  # per laid-out step: rows that are not padding
        self._start = 0  # the step of the first laid-out row; schedule.next_step == _start + len(_real)

    @property
    def rows(self) -> int:
        return self.schedule.rows

    @property
    def row_steps(self) -> list[int]:
        return [self._base + a for a in self._ahead] if self._ahead else [self._base] * self.rows

    def _extend(self) -> None:
        keep = self._base - self._start
        # a block of many steps amortises the per-block work; on data smaller than the rows (each row waits
        # epochs for an example) a block spans few epochs' worth of examples instead
        examples = self.schedule.table.num_examples
        steps = max(16, min(4096, BLOCK_ELEMENTS // self.rows, 4 * -(-examples // self.rows)))
        if self.example_bytes:
            steps = max(1, min(steps, int(BLOCK_BYTES / (self.example_bytes * self.rows))))
        block = self.schedule.block(steps)
        # an object column becomes one flat list (step after step: a step is one slice, no Python object made
        # per row), a numeric one stays an array (a step is a row view: no int object per row either)
        columns: list[Any] = [c.ravel().tolist() if c.dtype == object else c for c in self.gather(block)]
        real = (block != self.schedule.pad).sum(axis=1).tolist()
        if keep < len(self._real):
            columns = [old[keep * self.rows:] + new if isinstance(new, list) else np.concatenate([old[keep:], new])
                       for old, new in zip(self._columns, columns)]
            real = self._real[keep:] + real
        self._columns, self._real, self._start = columns, real, self._base

    def step(self) -> tuple[Any, ...]:
        """Every row's next example: one list per gathered column (padding rows hold the padding entry),
        then the number of rows that are not padding. All rows move one step."""
        if self._ahead:
            raise RuntimeError("RowFeed.step: the rows stand at different steps (some clones acted alone)")
        offset = self._base - self._start
        if offset >= len(self._real):
            self._extend()
            offset = 0
        self._base += 1
        rows = self.schedule.rows
        start = offset * rows
        stop = start + rows
        return (*[c[start:stop] if c.__class__ is list else c[offset] for c in self._columns], self._real[offset])

    def take(self, row: int) -> tuple[Any, ...]:
        """Row ``row``'s next entry of each gathered column."""
        ahead = self._ahead or [0] * self.rows
        offset = self._base + ahead[row] - self._start
        while offset >= len(self._real):
            self._extend()
            offset = self._base + ahead[row] - self._start
        out = tuple(c[offset * self.rows + row] if isinstance(c, list) else c[offset, row] for c in self._columns)
        ahead[row] += 1
        lowest = min(ahead)
        if lowest:
            self._base += lowest
            ahead = [a - lowest for a in ahead]
        self._ahead = ahead if any(ahead) else None
        return out

    def done(self, row: int | None = None) -> bool:
        """Evaluation: the row (every row when None) has served its whole part; never in training."""
        totals = self.schedule.row_totals
        if totals is None:
            return False
        if row is not None:
            return self.row_steps[row] >= totals[row]
        return all(s >= t for s, t in zip(self.row_steps, totals))

    def seek(self, row_steps: Sequence[int]) -> None:
        """Put the rows at these steps (a restore, or a rewind to the start)."""
        base = min(int(s) for s in row_steps)
        ahead = [int(s) - base for s in row_steps]
        self._base, self._ahead = base, (ahead if any(ahead) else None)
        self._start, self._columns, self._real = base, [], []
        self.schedule.seek(base)

    def rewind(self) -> None:
        if self._base or self._ahead or self._start:  # every clone rewinds the shared feed: once is enough
            self.seek([0] * self.rows)

    def _key(self) -> dict[str, Any]:
        schedule = self.schedule
        return {"table": schedule.table.digest(), "rows": self.rows, "order": repr(schedule.order),
                "layout": (None if schedule.rows == schedule.layout_rows  # every row, else a replica's share
                           else [schedule.layout_rows, *schedule.serve.tolist()])}

    def state_dict(self) -> dict[str, Any]:
        return {"row_steps": self.row_steps, **self._key()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        key = self._key()
        differs = next((k for k in key if state.get(k) != key[k]), None)
        if differs is not None:
            raise ValueError(f"the data position was taken on {_DIFFERS[differs]}; resume with the data, --seed, "
                             "-bs, -di, -ga, -rf and -nt it was saved with")
        self.seek(state["row_steps"])


class BatchPlan:
    """Dynamic batching: per epoch, one shard's examples in a seeded order cut into batches by a strategy.

    Training with ``drop_last`` leaves out every partial batch (fewer rows than ``batch_size`` in the fixed-row
    strategies, or completed with padding rows: a bucket's tail); ``runs(rows)`` (training) may refuse a batch
    too (a tail some replica process would get no row of); the examples left out are counted with their epoch.
    ``rank`` seeds the shard's order (hogwild processes each plan their own share of the episodes). Evaluation
    keeps every example; of several tasks capped at ``cap`` examples (-vme), the first ``cap`` of a task-balanced
    order (to the end of an episode) are batched first, apart, so a capped evaluation scores every task about
    equally (as ParlAI's capped world per task), not the tasks whose examples sort first. Batches are made
    lazily, as they are read (a streamed file's epoch is never held as batches), so knowing an epoch's count
    costs a pass of the batcher, done once.
    """

    def __init__(self, table: EpisodeTable, rank: int, lengths: np.ndarray, batching: BatchingConfig,
                 training: bool, shuffle: bool, seed: int, drop_last: bool,
                 runs: Callable[[int], bool] | None = None, cap: int = 0):
        self.table, self.rank, self.lengths = table, rank, lengths
        self.batching, self.training, self.shuffle = batching, training, shuffle
        self.seed, self.drop_last, self.runs = seed, drop_last, runs
        self.cap = cap if cap > 0 and not training and len(table.tasks) > 1 else 0
        self._counts: dict[int, tuple[int, int]] = {}

    def _parts(self, epoch: int) -> list[np.ndarray]:
        """The epoch's examples (flat indices), in the parts that are batched one after another."""
        if mixes_tasks(self.table, self.shuffle):  # multitask training: ParlAI's draw of tasks
            return [mixed_examples(self.table, self.seed, epoch, self.rank)]
        if self.cap:  # the capped share first, batched apart (an uncapped evaluation goes on to the others)
            order = TaskBalancedOrder(self.table.turns, self.table.tasks)(epoch)
            head = int(np.searchsorted(np.cumsum(self.table.turns[order]), self.cap)) + 1
            return [self.table.flat(order[:head]), self.table.flat(order[head:])]
        # data order (several tasks: one episode of each in turn, as ParlAI serves them)
        return [self.table.flat(make_order(self.table, False, self.seed)(epoch))]

    def _batches(self, epoch: int) -> Iterator[Batch[int]]:
        parts, rng = self._parts(epoch), None
        if self.shuffle:  # training: one part
            parts = [part[permutation(len(part), self.seed, epoch, self.rank)] for part in parts]
            rng = random.Random(hash((self.seed, epoch, self.rank)))
        drop = self.training and self.drop_last
        full = self.batching.batch_size if self.batching.strategy in ("none", "batchsort") else 0
        for part in parts:
            for batch in self.batching.batcher(rng).run(_pairs(part, self.lengths)):
                if (not drop or batch.num_real >= max(full, batch.rows)) and (
                        self.runs is None or not self.training or self.runs(batch.num_real)):
                    yield batch

    def count(self, epoch: int) -> tuple[int, int]:
        """(the batches, the examples left out) in ``epoch``."""
        got = self._counts.get(epoch)
        if got is None:
            batches = real = 0
            for batch in self._batches(epoch):
                batches, real = batches + 1, real + batch.num_real
            got = self._counts[epoch] = (batches, self.table.num_examples - real)
        return got

    def batches(self, epoch: int, start: int = 0) -> Iterator[Batch[int]]:
        """The batches of ``epoch`` from batch ``start`` on (the ones before it made, not kept)."""
        return islice(self._batches(epoch), start, self.count(epoch)[0])

    def key(self) -> str:
        """What decides every epoch's batches (the data, the shard, the strategy and the seed)."""
        return (f"{self.table.digest()}:{self.rank}/1:{self.batching}:{self.seed}:"
                f"{self.shuffle}:{self.training and self.drop_last}" + ":mixed" * mixes_tasks(self.table, self.shuffle)
                + (f":cap{self.cap}" if self.cap else ""))


# what a feed's position was taken on that differs, by its key (RowFeed._key)
_DIFFERS = {"table": "other data: other episodes or turns (a data file changed since the checkpoint, or -t)",
            "rows": "another number of rows per step (-bs, -di, -ga, -rf, -nt)",
            "order": "another order of the episodes (--seed, or a version of accelbatch that orders them otherwise)",
            "layout": "another share of the rows (-rf)"}


def _pairs(examples: np.ndarray, lengths: np.ndarray, chunk: int = 8192) -> Iterator[tuple[int, int]]:
    """(flat index, length) of each example, converted a chunk at a time."""
    for at in range(0, len(examples), chunk):
        part = examples[at:at + chunk]
        yield from zip(part.tolist(), lengths[part].tolist())


__all__ = ["BatchPlan", "EpisodeTable", "RowFeed", "RowSchedule"]
