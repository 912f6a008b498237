"""Episode orders: which episode comes at each position of an epoch (data order, a seeded permutation,
ParlAI's multitask draw, task-balanced for capped evaluations), and a dynamic-batching epoch's multitask
examples. Each is a function of the seed and the epoch only."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np

from accelbatch.data.episodes import EpisodeTable, index_dtype

Order = Callable[[int], np.ndarray]


def permutation(size: int, seed: int, *key: int) -> np.ndarray:
    """A seeded permutation of ``range(size)`` (numpy's generator: fast and the same on every machine), as
    int32 when that holds it (an epoch's order of a big streamed file: 4 bytes per example)."""
    return np.random.default_rng([abs(seed), *key]).permutation(np.arange(size, dtype=index_dtype(size)))


@dataclass(frozen=True)
class DataOrder:
    """Every epoch in data order (evaluation, ``:ordered``)."""

    size: int

    def __call__(self, epoch: int) -> np.ndarray:
        return np.arange(self.size, dtype=np.int64)


@dataclass(frozen=True)
class ShuffledOrder:
    """A seeded permutation per epoch (training)."""

    size: int
    seed: int

    def __call__(self, epoch: int) -> np.ndarray:
        return permutation(self.size, self.seed, epoch)


@dataclass(frozen=True)
class PassOrder:
    """``order``'s epoch ``first`` as the one epoch of a schedule that does not loop (a pass of several)."""

    order: Order
    first: int

    def __call__(self, epoch: int) -> np.ndarray:
        return self.order(self.first + epoch)

    def __repr__(self) -> str:
        return repr(self.order)  # a position's key; the pass is kept beside it


@dataclass(frozen=True)
class AlternatingOrder:
    """Several tasks in data order, one episode of each in turn (a task whose episodes are done is passed
    over), as ParlAI's MultiTaskTeacher serves ordered data."""

    tasks: tuple[int, ...]

    def __call__(self, epoch: int) -> np.ndarray:
        task = np.repeat(np.arange(len(self.tasks)), self.tasks)
        starts = np.concatenate([[0], np.cumsum(self.tasks)[:-1]]).astype(np.int64)
        return np.lexsort((task, np.arange(len(task)) - np.repeat(starts, self.tasks))).astype(np.int64)


@dataclass(frozen=True, eq=False)
class TaskBalancedOrder:
    """Several tasks evaluated under a cap on examples (``-vme``): each task's episodes in data order, the
    next episode always from the task that has served the fewest examples so far (ties: the first task), so
    a capped evaluation scores every task about equally, as ParlAI's one capped world per task does."""

    turns: np.ndarray
    tasks: tuple[int, ...]

    def __call__(self, epoch: int) -> np.ndarray:
        task = np.repeat(np.arange(len(self.tasks)), self.tasks)
        bounds = np.concatenate([[0], np.cumsum(self.tasks)])
        served = np.cumsum(self.turns) - self.turns  # examples before each episode: per task below
        served -= np.repeat(served[bounds[:-1]], self.tasks)
        return np.lexsort((task, served)).astype(np.int64)

    def __repr__(self) -> str:  # a data position's key (beside the table's digest)
        return f"TaskBalancedOrder(tasks={list(self.tasks)})"


def make_order(table: EpisodeTable, shuffle: bool, seed: int, balance_tasks: bool = False) -> Order:
    """The episode order of each epoch: data order, a seeded permutation, or for several tasks ParlAI's
    multitask rules (in training each new episode from a task drawn uniformly, :class:`MixedOrder`; in order
    one episode of each task in turn, :class:`AlternatingOrder`); with ``balance_tasks`` (a capped evaluation)
    several tasks' episodes interleave by examples served (:class:`TaskBalancedOrder`)."""
    if not shuffle:
        if len(table.tasks) > 1:
            return TaskBalancedOrder(table.turns, table.tasks) if balance_tasks else AlternatingOrder(table.tasks)
        return DataOrder(table.num_episodes)
    if mixes_tasks(table, shuffle):
        return MixedOrder(table.tasks, seed, table.weights)
    return ShuffledOrder(table.num_episodes, seed)


def mixes_tasks(table: EpisodeTable, shuffle: bool) -> bool:
    """Whether ``table``'s epochs are multitask draws (:class:`MixedOrder`), not each episode once."""
    return shuffle and len(table.tasks) > 1


class MixedOrder:
    """Multitask training: each position of an epoch (as many as there are episodes) draws a task at random,
    uniformly or by ``weights`` (of those with episodes: a process's share may have none of a small task), and
    takes that task's next episode; each task goes through its own seeded permutations."""

    def __init__(self, sizes: Sequence[int], seed: int, weights: Sequence[float] = ()):
        self.sizes = [int(s) for s in sizes]
        self.starts = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)
        self.seed, self.weights = seed, tuple(weights)
        self._offsets: dict[int, np.ndarray] = {0: np.zeros(len(self.sizes), dtype=np.int64)}

    def __repr__(self) -> str:
        weighted = f", weights={list(self.weights)}" if self.weights else ""
        return f"MixedOrder(sizes={self.sizes}, seed={self.seed}{weighted})"

    def _choices(self, epoch: int) -> np.ndarray:
        gen = np.random.default_rng([abs(self.seed), 7919, epoch])
        return draw_tasks(self.sizes, self.weights, sum(self.sizes), gen)

    def _task_offsets(self, epoch: int) -> np.ndarray:
        """Episodes each task had served before ``epoch``."""
        known = max(e for e in self._offsets if e <= epoch)
        offsets = self._offsets[known]
        for e in range(known, epoch):
            offsets = offsets + np.bincount(self._choices(e), minlength=len(self.sizes))
        self._offsets = {0: self._offsets[0], epoch: offsets}
        return offsets

    def __call__(self, epoch: int) -> np.ndarray:
        choices = self._choices(epoch)
        offsets = self._task_offsets(epoch)
        out = np.empty(len(choices), dtype=np.int64)
        for task, size in enumerate(self.sizes):
            where = np.flatnonzero(choices == task)
            served = offsets[task] + np.arange(len(where))
            rounds = served // size
            picked = np.empty(len(where), dtype=np.int64)
            for q in np.unique(rounds):
                mask = rounds == q
                picked[mask] = permutation(size, self.seed, task, int(q))[served[mask] % size]
            out[where] = self.starts[task] + picked
        return out


def draw_tasks(sizes: Sequence[int], weights: Sequence[float], count: int, gen: np.random.Generator) -> np.ndarray:
    """``count`` tasks drawn among those with episodes: uniformly, or in proportion to ``weights`` (those of
    weight 0 never, unless every task with episodes has weight 0: a process's share of weighted tasks only)."""
    live = np.flatnonzero(np.asarray(sizes) > 0)
    chances = np.asarray(weights, dtype=np.float64)[live] if len(weights) else np.zeros(0)
    with np.errstate(over="ignore"):  # weights near the float maximum: their sum overflows (to inf)
        total = chances.sum()
    if not total > 0:
        return live[gen.integers(0, len(live), size=count)]
    if not np.isfinite(total):
        chances = chances / chances.max()
    return live[gen.choice(len(live), size=count, p=chances / chances.sum())]


def mixed_examples(table: EpisodeTable, seed: int, *key: int) -> np.ndarray:
    """The examples of a dynamic-batching epoch of multitask training, as flat indices: episodes drawn by
    :class:`MixedOrder`'s rule (each draw's task among those with episodes, by -mtw, a task's episodes in
    seeded permutations, one after another) until they hold the table's number of examples, cut there. So
    each epoch has as many examples as the data, and the tasks their shares of ParlAI's draw (a task of
    longer episodes more examples), not shares in proportion to their sizes."""
    sizes, total = np.asarray(table.tasks, dtype=np.int64), table.num_examples
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    gen = np.random.default_rng([abs(seed), 7919, *key])
    choices = draw_tasks(sizes, table.weights, total, gen)  # each episode holds a turn: draws enough
    episodes = np.empty(total, dtype=np.int64)
    for task in np.unique(choices).tolist():
        where, size = np.flatnonzero(choices == task), int(sizes[task])
        rounds = -(-len(where) // size)
        cycles = np.argsort(np.random.default_rng([abs(seed), task, *key]).random((rounds, size)), axis=1)
        episodes[where] = starts[task] + cycles.ravel()[:len(where)]
    ends = np.cumsum(table.turns[episodes])
    return table.flat(episodes[:int(np.searchsorted(ends, total)) + 1])[:total]


__all__ = ["AlternatingOrder", "DataOrder", "MixedOrder", "Order", "PassOrder", "ShuffledOrder", "TaskBalancedOrder",
           "draw_tasks", "make_order", "mixed_examples", "mixes_tasks", "permutation"]
