"""Teachers: agents that serve a dataset and score the replies, and the task registry.

:class:`FixedTeacher` serves episodes from a list held in memory. Its clones (one per BatchWorld row)
share one :class:`EpisodeCursor`, so in evaluation every episode is handed out exactly once whatever the
batch size, and in training episodes come in a fresh shuffled order each epoch.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from accelbatch.agents import Agent, UnknownNameError, import_path
from accelbatch.messages import TEXT, Message
from accelbatch.metrics import Metrics
from accelbatch.opts import OptionError, Opts
from accelbatch.teacher_rows import RowBlock, RowTable, ServedExamples
from accelbatch.tasks.files import DataFileError, load_episodes

# task name -> "module:Class"; a task string is "name" or "name:argument" (e.g. babi:1, jsonl:PATH).
TASK_PATHS: dict[str, str] = {
    "babi": "accelbatch.tasks.babi:BabiTeacher",
    "jsonl": "accelbatch.teachers:FileTeacher",
    "parlai": "accelbatch.teachers:FileTeacher",
    "dialogues": "accelbatch.tasks.dialogues:SyntheticDialogueTeacher",
}

TASK_HELP: dict[str, str] = {
    "babi:1": "generated bAbI-style QA, single supporting fact (no download)",
    "babi:2": "generated bAbI-style QA, two supporting facts (no download)",
    "jsonl:PATH": "a JSONL file (or a folder with train/valid/test.jsonl)",
    "parlai:PATH": "a ParlAI text-format file (or a folder with train/valid/test.txt)",
    "dialogues": "synthetic dialogues of the throughput benchmark",
}


def split_of(datatype: str) -> str:
    """'train', 'valid' or 'test' from a datatype such as 'train:stream'."""
    return datatype.split(":")[0]


def is_training(datatype: str) -> bool:
    return split_of(datatype) == "train" and "evalmode" not in datatype


def epoch_order(num_episodes: int, shuffle: bool, seed: int, epoch: int) -> list[int]:
    """The order episodes are served in during ``epoch``: a seeded permutation when ``shuffle``.

    numpy's permutation: random.shuffle costs about a microsecond per episode, as much as serving it.
    """
    if not shuffle:
        return list(range(num_episodes))
    return np.random.default_rng([seed, epoch]).permutation(num_episodes).tolist()


@dataclass
class EpisodeCursor:
    """The position in the dataset that all clones of one teacher share (thread-safe)."""

    num_episodes: int
    shuffle: bool
    seed: int
    order: list[int] = field(default_factory=list)
    next_index: int = 0
    epoch: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def __post_init__(self) -> None:
        self._new_order()

    def _new_order(self) -> None:
        self.order = epoch_order(self.num_episodes, self.shuffle, self.seed, self.epoch)

    def take(self, loop: bool) -> int | None:
        """The next episode index, or None when the epoch is over and ``loop`` is False."""
        if loop and self.num_episodes == 0:
            raise ValueError("EpisodeCursor: no episodes to loop over")
        with self.lock:
            if self.next_index >= self.num_episodes:
                if not loop:
                    return None
                self.epoch += 1
                self.next_index = 0
                self._new_order()
            index = self.order[self.next_index]
            self.next_index += 1
            return index

    def take_many(self, count: int, loop: bool) -> list[int | None]:
        """``count`` successive :meth:`take` results under one lock (a batch of rows starting episodes)."""
        if loop and self.num_episodes == 0 and count:
            raise ValueError("EpisodeCursor: no episodes to loop over")
        out: list[int | None] = []
        with self.lock:
            start = self.next_index
            if start + count <= self.num_episodes:  # the usual case: all within this epoch
                self.next_index = start + count
                return self.order[start:start + count]
            while count > 0:
                if self.next_index >= self.num_episodes:
                    if not loop:
                        out.extend([None] * count)
                        break
                    self.epoch += 1
                    self.next_index = 0
                    self._new_order()
                taken = self.order[self.next_index:self.next_index + count]
                out.extend(taken)
                self.next_index += len(taken)
                count -= len(taken)
        return out

    def exhausted(self) -> bool:
        return self.next_index >= self.num_episodes

    def rewind(self) -> None:
        self.seek(0, 0)

    def seek(self, epoch: int, next_index: int) -> None:
        """Continue from a saved position: episode ``next_index`` of ``epoch``'s order (checkpoints)."""
        with self.lock:
            self.epoch = epoch
            self._new_order()
            self.next_index = next_index


class Teacher(Agent):
    """A teacher acts with examples and observes replies to score them."""

    def epoch_done(self) -> bool:
        return False

    def num_examples(self) -> int:
        raise NotImplementedError

    def num_episodes(self) -> int:
        raise NotImplementedError


class FixedTeacher(Teacher):
    """Serves a fixed list of episodes; subclasses give ``setup_data() -> list[list[Message]]``.

    Training (datatype train) loops forever over shuffled episodes; evaluation (valid/test or
    train:evalmode) serves each episode once, in order, then only padding rows. In evaluation the
    ``labels`` become ``eval_labels`` so the agent does not train on them.
    """

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        self.datatype = opts.datatype
        self.training = is_training(opts.datatype)
        if shared is None:
            self.episodes = self.setup_data()
            if not self.episodes:
                raise DataFileError(f"task {opts.task!r} ({split_of(opts.datatype)}) has no examples")
            cursor = EpisodeCursor(len(self.episodes), shuffle=self.training and
                                   "ordered" not in opts.datatype, seed=opts.seed)
            self.metrics = Metrics()
            self._num_examples = sum(len(ep) for ep in self.episodes)
            self._rows = RowTable(ServedExamples.prepare(self.episodes, self.id, self.training), cursor)
        else:
            self.episodes = shared["episodes"]
            self.metrics = shared["metrics"]
            self._num_examples = shared["num_examples"]
            self._rows = shared["rows"]
        self._slot = self._rows.add_slot()

    def setup_data(self) -> list[list[Message]]:
        raise NotImplementedError

    @property
    def cursor(self) -> Any:
        """The episode cursor every clone of this teacher shares (an :class:`EpisodeCursor`)."""
        return self._rows.cursor

    @cursor.setter
    def cursor(self, cursor: Any) -> None:  # e.g. hogwild's process-shared cursor, for all clones at once
        self._rows.cursor = cursor

    def share(self) -> dict[str, Any]:
        shared = super().share()
        shared.update(episodes=self.episodes, metrics=self.metrics, num_examples=self._num_examples,
                      rows=self._rows)
        return shared

    def num_examples(self) -> int:
        """Examples of the whole split (every shard's), so epochs mean the same on every replica."""
        return self._num_examples

    def num_episodes(self) -> int:
        return len(self.episodes)

    def keep_shard(self, index: int, count: int) -> None:
        """Serve only episodes ``index, index + count, ...`` (this replica's share); call before cloning."""
        if count > 1:
            if self.training and len(self.episodes) < count:
                raise OptionError(f"-t {self.opts.task}: {len(self.episodes)} training episode(s) cannot be "
                                  f"shared by {count} replicas (-rf/--replication-factor {count}): replica "
                                  f"{index} would have none; lower --replication-factor or train on more data")
            self.episodes = self.episodes[index::count]
            cursor = EpisodeCursor(len(self.episodes), self.cursor.shuffle, self.cursor.seed)
            self._rows.replace_data(ServedExamples.prepare(self.episodes, self.id, self.training), cursor)

    def act(self) -> Message:
        """The next example: read-only (a :class:`~accelbatch.messages.FrozenMessage` served without a copy);
        an agent that changes what it observes copies it first."""
        return self._rows.act(self._slot, self.training)

    def observe(self, reply: Message) -> Message:
        """Score the reply to the last example (accuracy and F1 against its labels)."""
        answers = self._rows.take_last(self._slot)
        if answers is not None:
            self.metrics.add_batch([reply.get(TEXT)], [answers])
        return reply

    def row_block(self, teachers: Sequence["Agent"]) -> RowBlock | None:
        """The clones in ``teachers`` (a BatchWorld's rows) as one :class:`RowBlock`, when they are plain
        FixedTeachers in consecutive slots of this teacher's table; else None (they act one by one)."""
        plain = all(type(t).act is FixedTeacher.act and type(t).observe is FixedTeacher.observe
                    and getattr(t, "_rows", None) is self._rows for t in teachers)
        slots = [t._slot for t in teachers] if plain else []  # type: ignore[attr-defined]
        if not slots or slots != list(range(slots[0], slots[0] + len(slots))):
            return None
        return RowBlock(self._rows, slots[0], len(slots), loop=self.training, metrics=self.metrics)

    def epoch_done(self) -> bool:
        if self.training:
            return False
        return self._rows.finished(self._slot) and self.cursor.exhausted()

    def reset(self) -> None:
        super().reset()
        self.cursor.rewind()
        self._rows.clear_slot(self._slot)

    def position(self) -> tuple[int, int] | None:
        """``(episode index, next entry)`` of the episode this clone is in the middle of, else None.

        Taken between world steps (every example handed out has been observed), with the shared
        cursor's position it is where this clone's data continues; see accelbatch.data_position.
        """
        return self._rows.position(self._slot)

    def restore(self, position: tuple[int, int] | None) -> None:
        """Continue inside episode ``position[0]`` at entry ``position[1]`` (None: between episodes)."""
        self._rows.restore(self._slot, None if position is None else (int(position[0]), int(position[1])))

    def report(self) -> dict[str, float]:
        return self.metrics.report()

    def reset_metrics(self) -> None:
        self.metrics.clear()


class FileTeacher(FixedTeacher):
    """``jsonl:PATH`` or ``parlai:PATH``: one file served whatever the datatype, or a folder holding
    ``train``/``valid``/``test`` files (``.jsonl`` or ``.txt``)."""

    def setup_data(self) -> list[list[Message]]:
        kind = self.opts.task.partition(":")[0]
        return load_episodes(self.resolve_path(self.opts), "jsonl" if kind == "jsonl" else "parlai")

    @staticmethod
    def resolve_path(opts: Opts) -> str:
        """The file a ``jsonl:PATH``/``parlai:PATH`` task reads for ``opts.datatype``."""
        kind, _, path = opts.task.partition(":")
        if not path:
            example = "data/train.jsonl" if kind == "jsonl" else "data/train.txt"
            raise DataFileError(f"-t {kind}: needs a path, e.g. -t {kind}:{example}")
        path = os.path.expanduser(path)
        if opts.datapath and not os.path.isabs(path):
            path = os.path.join(opts.datapath, path)
        if os.path.isdir(path):
            path = os.path.join(path, split_of(opts.datatype) + (".jsonl" if kind == "jsonl" else ".txt"))
        return path


def resolve_teacher_class(task: str) -> type[Teacher]:
    """The teacher class for one task string ('babi:1', 'jsonl:PATH', 'pkg.module:Class')."""
    name = task.split(":", 1)[0]
    if name in TASK_PATHS:
        return import_path(TASK_PATHS[name], "task", list(TASK_HELP))
    if ":" in task and "." in name or ":" in task and task.split(":", 1)[1][:1].isupper():
        return import_path(task, "task", list(TASK_HELP))
    raise UnknownNameError(f"unknown task {task!r}; known tasks: {', '.join(TASK_HELP)} "
                           "(or give a path as module:Class)")


def create_teachers(opts: Opts) -> list[Teacher]:
    """One teacher per comma-separated task."""
    tasks = [t.strip() for t in opts.task.split(",") if t.strip()]
    if not tasks:
        raise UnknownNameError(f"-t/--task is empty; known tasks: {', '.join(TASK_HELP)}")
    return [resolve_teacher_class(t)(opts.replace(task=t)) for t in tasks]


def list_tasks() -> Sequence[tuple[str, str]]:
    return list(TASK_HELP.items())
