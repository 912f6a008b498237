"""Where each clone of a FixedTeacher stands in its data, kept in columns so a batch of rows moves at once.

A FixedTeacher's examples are flattened once into :class:`ServedExamples` (every prepared example in data
order, read-only, plus one padding message at the end). All clones of one teacher share a :class:`RowTable`:
one slot per clone holding the flat index of its next example (``pos``), the end of its episode (``end``)
(both ``array('q')`` columns, so a block of rows moves with no int object per row),
and the example it served and has not yet seen answered (``last``). A slot that found the cursor exhausted
(evaluation's end) stands between episodes and serves padding.

A clone acting alone reads and writes its slot; a BatchWorld whose rows are clones in consecutive slots
moves them all with a :class:`RowBlock`, one :func:`accelbatch.row_kernels.advance_rows` call per step.
Both give the same messages in the same order (rows starting an episode take theirs from the shared cursor
in row order), so checkpoints, evaluation counts and metrics do not depend on the path.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field
from operator import ge
from typing import Any, Callable, Sequence

from accelbatch.messages import EPISODE_DONE, EVAL_LABELS, ID, LABELS, FrozenMessage, Message
from accelbatch.row_kernels import ADVANCE_ROWS


@dataclass
class ServedExamples:
    """A teacher's episodes as act() serves them, flattened; index ``pad`` is the padding message."""

    flat: list[FrozenMessage]
    # per flat index: what a reply is scored against (None: padding); examples with equal answers share one
    # tuple object, so counting replies reads a few hot tuples rather than one per example
    answers: list[tuple[str, ...] | None]
    starts: array  # array('q'), per episode: flat index of its first example
    ends: array  # array('q'), per episode: flat index after its last example
    episode_of: list[int]  # per flat index: its episode
    pad: int = field(init=False)  # the padding message's index, the last one

    def __post_init__(self) -> None:
        self.pad = len(self.flat) - 1

    @classmethod
    def prepare(cls, episodes: Sequence[Sequence[dict]], speaker: str, training: bool) -> "ServedExamples":
        """Each example with ``id`` and ``episode_done`` set (and labels as ``eval_labels`` outside training),
        frozen: built once, shared by every clone and every epoch."""
        flat: list[FrozenMessage] = []
        answers: list[tuple[str, ...] | None] = []
        distinct: dict[tuple[str, ...], tuple[str, ...]] = {}  # one tuple object per distinct answers
        starts, ends, episode_of = array("q"), array("q"), []
        for index, episode in enumerate(episodes):
            starts.append(len(flat))
            for entry, example in enumerate(episode, 1):
                msg = Message(example)
                msg[ID] = speaker
                msg[EPISODE_DONE] = entry >= len(episode) or bool(msg.get(EPISODE_DONE))
                if not training and LABELS in msg:
                    msg[EVAL_LABELS] = msg.pop(LABELS)
                flat.append(FrozenMessage(msg))
                golds = tuple(msg.targets())
                answers.append(distinct.setdefault(golds, golds))
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
    pos: array = field(default_factory=lambda: array("q"))  # C int64 columns, moved in place by advance_rows
    end: array = field(default_factory=lambda: array("q"))
    last: list[int] = field(default_factory=list)
    take_many: Callable[[int, bool], list[int | None]] = field(init=False)  # ``count`` episodes from the cursor

    def __setattr__(self, name: str, value: Any) -> None:
        super().__setattr__(name, value)
        if name == "cursor":  # e.g. hogwild's process-shared cursor, which takes one episode at a time
            take_many = getattr(value, "take_many", None)
            super().__setattr__("take_many", take_many if take_many is not None else self._take_one_by_one)

    def _take_one_by_one(self, count: int, loop: bool) -> list[int | None]:
        return [self.cursor.take(loop) for _ in range(count)]

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

    def act(self) -> tuple[list[FrozenMessage], list[tuple[str, ...] | None], int]:
        """Every row's next example (the padding message for rows with nothing left), its answers (None for
        padding), and how many rows got an example."""
        table, data = self.table, self.table.data
        return ADVANCE_ROWS(table.pos, table.end, self.first, self.rows, data.starts, data.ends, data.flat,
                            data.answers, table.take_many, self.loop)

    def score(self, replies: list[Any], answers: list[tuple[str, ...] | None], examples: int) -> None:
        """Hand the rows' replies to the teachers' metrics, scored against the answers :meth:`act` gave;
        ``examples`` of the rows served one (the others served padding)."""
        self.metrics.add_replies(replies, answers, examples)

    def epoch_done(self) -> bool:
        """Evaluation: the cursor ran out and every row finished its episode."""
        table, a, b = self.table, self.first, self.first + self.rows
        return table.cursor.exhausted() and all(map(ge, table.pos[a:b], table.end[a:b]))
