"""Where each clone of a FixedTeacher stands in its data, kept in columns so a batch of rows moves at once.

A FixedTeacher's examples are flattened once into :class:`ServedExamples` (every prepared example in data
order, read-only, plus one padding message at the end). All clones of one teacher share a :class:`RowTable`:
one slot per clone holding the flat index of its next example (``pos``), the end of its episode (``end``),
and the example it served and has not yet seen answered (``last``). A slot that found the cursor exhausted
(evaluation's end) stands between episodes and serves padding.

A clone acting alone reads and writes its slot; a BatchWorld whose rows are clones in consecutive slots
moves them all with a :class:`RowBlock`: list slices, ``compress`` and ``itemgetter`` instead of Python work
per row. Both give the same messages in the same order (rows starting an episode take theirs from the
shared cursor in row order), so checkpoints, evaluation counts and metrics do not depend on the path.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import compress
from operator import ge, itemgetter
from typing import Any, Sequence

from accelbatch.messages import EPISODE_DONE, EVAL_LABELS, ID, LABELS, FrozenMessage, Message


@dataclass
class ServedExamples:
    """A teacher's episodes as act() serves them, flattened; index ``pad`` is the padding message."""

    flat: list[FrozenMessage]
    answers: list[tuple[str, ...] | None]  # per flat index: what a reply is scored against (None: padding)
    starts: list[int]  # per episode: flat index of its first example
    ends: list[int]  # per episode: flat index after its last example
    episode_of: list[int]  # per flat index: its episode

    @property
    def pad(self) -> int:
        return len(self.flat) - 1

    @classmethod
    def prepare(cls, episodes: Sequence[Sequence[dict]], speaker: str, training: bool) -> "ServedExamples":
        """Each example with ``id`` and ``episode_done`` set (and labels as ``eval_labels`` outside training),
        frozen: built once, shared by every clone and every epoch."""
        flat: list[FrozenMessage] = []
        answers: list[tuple[str, ...] | None] = []
        starts, ends, episode_of = [], [], []
        for index, episode in enumerate(episodes):
            starts.append(len(flat))
            for entry, example in enumerate(episode, 1):
                msg = Message(example)
                msg[ID] = speaker
                msg[EPISODE_DONE] = entry >= len(episode) or bool(msg.get(EPISODE_DONE))
                if not training and LABELS in msg:
                    msg[EVAL_LABELS] = msg.pop(LABELS)
                flat.append(FrozenMessage(msg))
                answers.append(tuple(msg.get(LABELS, msg.get(EVAL_LABELS)) or ()))
                episode_of.append(index)
            ends.append(len(flat))
        flat.append(FrozenMessage({EPISODE_DONE: True}))
        answers.append(None)
        episode_of.append(-1)
        return cls(flat, answers, starts, ends, episode_of)


@dataclass
class RowTable:
    """The slots of every clone of one teacher, and the episode cursor they share."""

    data: ServedExamples
    cursor: Any  # EpisodeCursor, or hogwild's process-shared one
    pos: list[int] = field(default_factory=list)
    end: list[int] = field(default_factory=list)
    last: list[int] = field(default_factory=list)

    def add_slot(self) -> int:
        """A slot for a new clone, between episodes."""
        self.pos.append(0)
        self.end.append(0)
        self.last.append(self.data.pad)
        return len(self.pos) - 1

    def clear_slot(self, slot: int) -> None:
        self.pos[slot] = self.end[slot] = 0
        self.last[slot] = self.data.pad

    def replace_data(self, data: ServedExamples, cursor: Any) -> None:
        """New examples (a replica's shard): every slot goes back between episodes."""
        self.data, self.cursor = data, cursor
        for slot in range(len(self.pos)):
            self.clear_slot(slot)

    def act(self, slot: int, loop: bool) -> FrozenMessage:
        """The next example of ``slot`` (a new episode from the cursor when its episode is over)."""
        if self.pos[slot] >= self.end[slot]:
            index = self.cursor.take(loop)
            if index is None:
                self.pos[slot] = self.end[slot] = 0
                self.last[slot] = self.data.pad
                return self.data.flat[self.data.pad]
            self.pos[slot], self.end[slot] = self.data.starts[index], self.data.ends[index]
        at = self.pos[slot]
        self.pos[slot] = at + 1
        self.last[slot] = at
        return self.data.flat[at]

    def take_last(self, slot: int) -> tuple[str, ...] | None:
        """The answers of the example ``slot`` served last (None: nothing to score), and forget it."""
        at = self.last[slot]
        self.last[slot] = self.data.pad
        return self.data.answers[at]

    def position(self, slot: int) -> tuple[int, int] | None:
        """``(episode index, next entry)`` of the episode ``slot`` is in the middle of, else None."""
        at, end = self.pos[slot], self.end[slot]
        if at >= end:
            return None
        episode = self.data.episode_of[at]
        return episode, at - self.data.starts[episode]

    def restore(self, slot: int, position: tuple[int, int] | None) -> None:
        self.clear_slot(slot)
        if position is not None:
            episode, entry = position
            self.pos[slot] = self.data.starts[episode] + entry
            self.end[slot] = self.data.ends[episode]

    def finished(self, slot: int) -> bool:
        """``slot`` is between episodes (or ran out of data)."""
        return self.pos[slot] >= self.end[slot]


class RowBlock:
    """Slots ``first .. first + rows - 1`` of a table (the rows of one BatchWorld), moved together."""

    def __init__(self, table: RowTable, first: int, rows: int, loop: bool, metrics: Any):
        self.table, self.first, self.rows, self.loop = table, first, rows, loop
        self.metrics = metrics  # the teachers' shared Metrics, which score the rows' replies
        self._row_numbers = range(rows)

    def act(self) -> tuple[list[FrozenMessage], list[int]]:
        """Every row's next example, and their flat indices (:attr:`pad` for rows with nothing left)."""
        table, a, b = self.table, self.first, self.first + self.rows
        served = table.pos[a:b]
        ends = table.end[a:b]
        starting = list(compress(self._row_numbers, map(ge, served, ends)))
        if starting:
            data = table.data
            starts, episode_ends = data.starts, data.ends
            indices = self._take(len(starting))
            if None in indices:
                self._run_out(starting, indices, served, ends)
            else:
                for row, index in zip(starting, indices):
                    served[row] = starts[index]
                    ends[row] = episode_ends[index]
            table.end[a:b] = ends
        table.pos[a:b] = [at + 1 for at in served]
        if self.rows == 1:
            return [table.data.flat[served[0]]], served
        return list(itemgetter(*served)(table.data.flat)), served

    def _take(self, count: int) -> list[int | None]:
        """``count`` episodes from the cursor, for the starting rows in row order."""
        cursor = self.table.cursor
        take_many = getattr(cursor, "take_many", None)  # hogwild's process-shared cursor takes one at a time
        return take_many(count, self.loop) if take_many else [cursor.take(self.loop) for _ in range(count)]

    def _run_out(self, starting: list[int], indices: list[int | None], served: list[int],
                 ends: list[int]) -> None:
        """Evaluation's end: starting rows that got no episode serve padding from now on."""
        data = self.table.data
        for row, index in zip(starting, indices):
            if index is None:
                served[row] = ends[row] = data.pad
            else:
                served[row], ends[row] = data.starts[index], data.ends[index]

    @property
    def pad(self) -> int:
        return self.table.data.pad

    def answers(self, served: list[int]) -> tuple[tuple[str, ...] | None, ...]:
        """What each served example's reply is scored against (None for padding rows)."""
        answers = self.table.data.answers
        return itemgetter(*served)(answers) if self.rows > 1 else (answers[served[0]],)

    def epoch_done(self) -> bool:
        """Evaluation: the cursor ran out and every row finished its episode."""
        table, a, b = self.table, self.first, self.first + self.rows
        return table.cursor.exhausted() and all(map(ge, table.pos[a:b], table.end[a:b]))
