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
from accelbatch.messages import EPISODE_DONE, EVAL_LABELS, ID, LABELS, TEXT, Message, padding_message
from accelbatch.metrics import Metrics
from accelbatch.opts import Opts
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
        out: list[int | None] = []
        with self.lock:
            for _ in range(count):
                if self.next_index >= self.num_episodes:
                    if not loop:
                        out.append(None)
                        continue
                    self.epoch += 1
                    self.next_index = 0
                    self._new_order()
                out.append(self.order[self.next_index])
                self.next_index += 1
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
            self.cursor = EpisodeCursor(len(self.episodes), shuffle=self.training and
                                        "ordered" not in opts.datatype, seed=opts.seed)
            self.metrics = Metrics()
            self._num_examples = sum(len(ep) for ep in self.episodes)
            self._served = self._prepare(self.episodes)
        else:
            self.episodes = shared["episodes"]
            self.cursor = shared["cursor"]
            self.metrics = shared["metrics"]
            self._num_examples = shared["num_examples"]
            self._served = shared["served"]
        self._episode: list[Message] | None = None
        self._episode_index: int | None = None  # index of _episode in self.episodes (checkpoints)
        self._entry = 0
        self._last: Message | None = None
        self._done = False

    def setup_data(self) -> list[list[Message]]:
        raise NotImplementedError

    def _prepare(self, episodes: list[list[Message]]) -> list[list[Message]]:
        """``episodes`` as act() serves them (id, episode_done, eval_labels set): built once, not per act.
        ``self._served[i]`` is ``self.episodes[i]`` prepared; ``_episode`` stays an entry of ``episodes``."""
        served = []
        for episode in episodes:
            out = []
            for entry, example in enumerate(episode, 1):
                msg = Message(example)
                msg[ID] = self.id
                msg[EPISODE_DONE] = entry >= len(episode) or bool(msg.get(EPISODE_DONE))
                if not self.training and LABELS in msg:
                    msg[EVAL_LABELS] = msg.pop(LABELS)
                out.append(msg)
            served.append(out)
        return served

    def share(self) -> dict[str, Any]:
        shared = super().share()
        shared.update(episodes=self.episodes, cursor=self.cursor, metrics=self.metrics,
                      num_examples=self._num_examples, served=self._served)
        return shared

    def num_examples(self) -> int:
        """Examples of the whole split (every shard's), so epochs mean the same on every replica."""
        return self._num_examples

    def num_episodes(self) -> int:
        return len(self.episodes)

    def keep_shard(self, index: int, count: int) -> None:
        """Serve only episodes ``index, index + count, ...`` (this replica's share); call before cloning."""
        if count > 1:
            self.episodes = self.episodes[index::count]
            self._served = self._served[index::count]
            self.cursor = EpisodeCursor(len(self.episodes), self.cursor.shuffle, self.cursor.seed)

    def act(self) -> Message:
        if self._episode is None or self._entry >= len(self._episode):
            index = self.cursor.take(loop=self.training)
            if index is None:
                self._done = True
                self._last = None
                return padding_message()
            self._episode, self._episode_index, self._entry = self.episodes[index], index, 0
        # a fresh message per act (agents may modify what they observe) of the prepared example
        msg = Message(self._served[self._episode_index][self._entry])  # type: ignore[index]
        self._entry += 1
        self._last = msg
        return msg

    def observe(self, reply: Message) -> Message:
        """Score the reply to the last example (accuracy and F1 against its labels)."""
        if self._last is not None:
            self.metrics.add_batch([reply.get(TEXT)], [self._last.targets()])
            self._last = None
        return reply

    def batch_act_rows(self, teachers: Sequence["Agent"]) -> list[Message]:
        """Each clone in ``teachers`` (BatchWorld rows) acts; the rows starting an episode take their episodes
        from the cursor together, under one lock. The same messages as calling each clone's act()."""
        if any(type(t).act is not FixedTeacher.act or t.cursor is not self.cursor for t in teachers):
            return [t.act() for t in teachers]
        starting = [t for t in teachers if t._episode is None or t._entry >= len(t._episode)]
        if starting:
            cursor, loop, episodes = self.cursor, self.training, self.episodes
            take_many = getattr(cursor, "take_many", None)  # hogwild's process-shared cursor takes one at a time
            indices = take_many(len(starting), loop) if take_many else [cursor.take(loop) for _ in starting]
            for t, index in zip(starting, indices):
                if index is None:
                    t._episode, t._episode_index, t._entry = None, None, 0
                    t._done = True
                else:
                    t._episode, t._episode_index, t._entry = episodes[index], index, 0
        served = self._served
        acts = []
        for t in teachers:
            if t._episode is None:
                t._last = None
                acts.append(padding_message())
                continue
            msg = Message(served[t._episode_index][t._entry])
            t._entry += 1
            t._last = msg
            acts.append(msg)
        return acts

    def batch_observe_rows(self, teachers: Sequence["Agent"], replies: Sequence[Message]) -> list[Message]:
        """Each clone in ``teachers`` observes its reply; the rows are scored in one pass (BatchWorld)."""
        metrics = self.metrics
        if any(type(t).observe is not FixedTeacher.observe or t.metrics is not metrics for t in teachers):
            return [t.observe(r) for t, r in zip(teachers, replies)]  # scored their own way, or elsewhere
        preds, golds = [], []
        for teacher, reply in zip(teachers, replies):
            last = teacher._last
            if last is not None:
                preds.append(reply.get(TEXT))
                golds.append(last.get(LABELS, last.get(EVAL_LABELS)) or ())
                teacher._last = None
        if preds:
            metrics.add_batch(preds, golds)
        return list(replies)

    def epoch_done(self) -> bool:
        if self.training:
            return False
        finished_episode = self._episode is None or self._entry >= len(self._episode)
        return self._done or (finished_episode and self.cursor.exhausted())

    def reset(self) -> None:
        super().reset()
        self.cursor.rewind()
        self._episode, self._episode_index, self._entry, self._last, self._done = None, None, 0, None, False

    def position(self) -> tuple[int, int] | None:
        """``(episode index, next entry)`` of the episode this clone is in the middle of, else None.

        Taken between world steps (every example handed out has been observed), with the shared
        cursor's position it is where this clone's data continues; see accelbatch.checkpoint.
        """
        if self._episode is None or self._entry >= len(self._episode):
            return None
        return (self._episode_index, self._entry)  # type: ignore[return-value]

    def restore(self, position: tuple[int, int] | None) -> None:
        """Continue inside episode ``position[0]`` at entry ``position[1]`` (None: between episodes)."""
        if position is None:
            self._episode, self._episode_index, self._entry = None, None, 0
        else:
            index, entry = position
            self._episode, self._episode_index, self._entry = self.episodes[index], index, entry
        self._last, self._done = None, False

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
