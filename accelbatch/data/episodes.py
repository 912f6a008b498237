"""The episodes a process serves: :class:`EpisodeTable`, by the flat index of each episode's first turn and
its number of turns (per task, when multitask)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np


def index_dtype(size: int) -> type:
    return np.int32 if size < 2 ** 31 - 1 else np.int64


@dataclass(frozen=True)
class EpisodeTable:
    """Episodes by the flat index of their first turn and their number of turns (int64 arrays)."""

    first: np.ndarray
    turns: np.ndarray
    tasks: tuple[int, ...] = ()  # multitask: episodes per task, tasks one after another (empty: one task)
    weights: tuple[float, ...] = ()  # multitask: each task's weight in training's draw (empty: equal)

    @classmethod
    def of_lengths(cls, turns: Sequence[int], tasks: Sequence[int] = ()) -> "EpisodeTable":
        turns_ = np.asarray(turns, dtype=np.int64)
        first = np.zeros(len(turns_), dtype=np.int64)
        np.cumsum(turns_[:-1], out=first[1:])
        return cls(first, turns_, tuple(tasks))

    @property
    def num_episodes(self) -> int:
        return len(self.turns)

    @property
    def num_examples(self) -> int:
        return int(self.turns.sum())

    def miscounted(self, owner: str, **said: int) -> str | None:
        """What is wrong with a teacher's own num_examples() / num_episodes() (``said``) that is not what this
        table holds (None: they agree): epochs (-ne), the -bs a small task lowers and the shares of -rf / -nt
        are counted from the data."""
        for name, count in said.items():
            held = getattr(self, name)
            if count != held:
                return (f"{owner}.{name}() returns {count!r}, but its data holds {held}: remove the {name}() "
                        "override (the data is counted) or make it agree")
        return None

    def shard(self, index: int, count: int, whole_small_tasks: bool = False) -> "EpisodeTable":
        """Episodes ``index, index + count, ...`` (a replica's or a process's share); per task when multitask.
        ``whole_small_tasks`` (multitask draws in hogwild processes): a task of fewer episodes than ``count`` is
        kept whole in every share, so that each process draws it as often as one process would."""
        if count == 1:
            return self
        if not self.tasks:
            return EpisodeTable(self.first[index::count], self.turns[index::count])
        bounds = np.concatenate([[0], np.cumsum(self.tasks)])
        keep = [np.arange(a, b)[0 if whole_small_tasks and b - a < count else index::count]
                for a, b in zip(bounds[:-1], bounds[1:])]
        chosen = np.concatenate(keep)
        return EpisodeTable(self.first[chosen], self.turns[chosen], tuple(len(k) for k in keep), self.weights)

    def flat(self, episodes: np.ndarray) -> np.ndarray:
        """Flat indices of every turn of ``episodes`` (positions in this table), episode after episode."""
        lengths = self.turns[episodes]
        dtype = index_dtype(int(self.first[-1]) + int(self.turns[-1]) if len(self.first) else 0)
        if not len(lengths):
            return np.empty(0, dtype=dtype)
        starts = self.first[episodes]
        ends = np.cumsum(lengths)
        flat = np.repeat(starts - (ends - lengths), lengths)
        flat += np.arange(int(ends[-1]), dtype=np.int64)
        return flat.astype(dtype, copy=False)

    def digest(self) -> str:
        return hashlib.sha256(self.first.tobytes() + self.turns.tobytes()).hexdigest()[:16]


__all__ = ["EpisodeTable", "index_dtype"]
