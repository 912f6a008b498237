"""Example stores: a task's episodes served by flat index (every turn of every episode, in data order).

Both front ends read examples from a store through the schedule (:mod:`accelbatch.data.schedule`):

- :class:`EpisodeStore`: episodes held in memory (a teacher's ``setup_data``);
- :class:`FileStore`: JSONL / ParlAI files read on demand (``-dt ...:stream``) through a
  :class:`~accelbatch.tasks.files.FileIndex` (byte offset, line and turns of each episode: 24 bytes per
  episode in memory, none of the text), each episode parsed when a step needs it;
- :class:`ConcatStore`: several tasks' stores one after another (multitask), with the task of each example.

A store serves *prepared* turns (:func:`prepare`: ``id`` and ``episode_done`` set, labels turned into
``eval_labels`` outside training, read-only), which is what a teacher clone acts with, and *observations*
(:meth:`observations`): the prepared turn as ``TorchAgent.observe`` would leave it, with the episode's
history in ``full_text`` (``--context-length``, ``--include-labels``), which is what data workers vectorize.
Flat index ``pad`` (= the number of examples) is the padding message.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache
from itertools import repeat
from typing import Any, Callable, Sequence

import numpy as np

from accelbatch.data.schedule import EpisodeTable
from accelbatch.data.squash import AwaitsReply, awaits_reply, each_history, history_of, keeps_answers
from accelbatch.messages import (
    BATCH_PADDING,
    EPISODE_DONE,
    EVAL_LABELS,
    ID,
    LABEL_CANDIDATES,
    LABELS,
    TEXT,
    FrozenMessage,
    Message,
    has_surrogate,
    lone_surrogate,
    not_unicode,
)
from accelbatch.metrics import AnswerTable
from accelbatch.tasks.files import DataFileError, FileIndex, episode_at

PADDING = FrozenMessage({EPISODE_DONE: True, BATCH_PADDING: True})  # ParlAI's padding_example()
CACHE_BYTES = 8 << 20  # of a streamed file's text, kept parsed (FileStore)


def prepare(turn: dict, speaker: str, training: bool, last: bool) -> FrozenMessage:
    """A turn as a teacher serves it: ``id`` and ``episode_done`` set, labels as ``eval_labels`` outside
    training, read-only (one object per example, shared by every epoch and row)."""
    msg = Message(turn)
    msg[ID] = speaker
    msg[EPISODE_DONE] = last or bool(msg.get(EPISODE_DONE))
    if not training and LABELS in msg:
        msg[EVAL_LABELS] = msg.pop(LABELS)
    elif training and EVAL_LABELS in msg and LABELS not in msg:
        # an agent would train on it only when a batch also holds labelled examples (as ParlAI, refused)
        raise DataFileError(f"a training example has eval_labels and no labels (text "
                            f"{str(msg.get('text'))[:60]!r}); training learns from labels: name them labels, or "
                            "keep evaluation-only examples in the valid/test data")
    return FrozenMessage(msg)


def prepare_episode(episode: Sequence[dict], speaker: str, training: bool) -> list[FrozenMessage]:
    return [prepare(turn, speaker, training, i == len(episode) - 1) for i, turn in enumerate(episode)]


def split_at_done(episode: Sequence[dict]) -> list[Sequence[dict]]:
    """An episode cut after every turn that says ``episode_done`` (a new episode starts there, as an agent's
    history does), so that every front end sees the same episodes."""
    cuts = [i + 1 for i, turn in enumerate(episode[:-1]) if turn.get(EPISODE_DONE)]
    return [episode[a:b] for a, b in zip([0, *cuts], [*cuts, len(episode)])]


def _is_pair(item: Any) -> bool:
    """A (message dict, new_episode) pair: ParlAI's DialogTeacher setup_data form (new_episode read for its
    truth, as ParlAI does: a bool, or 0/1, numpy's too)."""
    return isinstance(item, (tuple, list)) and len(item) == 2 and isinstance(item[0], dict) \
        and isinstance(item[1], (int, np.integer, np.bool_))


# the fields a turn gives as answers: a str or a list/tuple of str (ParlAI reads a str as a one-element tuple)
ANSWER_FIELDS = (LABELS, EVAL_LABELS, LABEL_CANDIDATES)


def _short(value: Any) -> str:
    """``value``'s repr, cut to fit an error line."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _parlai_message(msg: dict) -> dict:
    """A setup_data turn with ParlAI's conveniences, ``label`` for ``labels`` and a str for a one-element list
    (a copy where it changes; the teacher's own dict is left as it is), its fields' types checked: a wrong one
    is a DataFileError saying what to give (:func:`episodes_of` says where). O(fields and answers) per turn."""
    out = msg
    if "label" in msg and LABELS not in msg:
        out = dict(msg)
        out[LABELS] = out.pop("label")
    text = out.get(TEXT)
    if text is not None and not isinstance(text, str):
        raise DataFileError(f"'text' is {type(text).__name__} {_short(text)}; give a str, e.g. 'text': "
                            f"{str(text)[:40]!r}")
    for key in ANSWER_FIELDS:
        value = out.get(key)
        if value is None:
            continue
        if isinstance(value, str):
            out = dict(out) if out is msg else out
            out[key] = [value]
        elif not isinstance(value, (list, tuple)) or not all(map(isinstance, value, repeat(str))):
            bad = value if not isinstance(value, (list, tuple)) else next(v for v in value if not isinstance(v, str))
            given = "label" if key == LABELS and "label" in msg and LABELS not in msg else key  # as the teacher wrote
            raise DataFileError(f"{given!r} is {_short(value)} (holding {type(bad).__name__}); give a str or a list "
                                f"of str, e.g. {given!r}: ['yes']")
    bad = lone_surrogate(out) if has_surrogate(out) else None  # the quick look first: most turns have none
    if bad is not None:
        raise DataFileError(f"{not_unicode(bad)} (a byte that is not UTF-8, read with errors='surrogateescape', or "
                            "half of an emoji); decode the data as UTF-8 or remove the character")
    return out


def checked_teacher_act(teacher: Any, act: Any) -> Any:
    """The act of a teacher of yours (one that overrides ``act()``) with its fields' types checked as
    setup_data's turns are, a str label made a one-item list; a wrong one is a DataFileError naming the
    teacher's act(). None and padding pass as they are."""
    if not isinstance(act, dict) or act.get(BATCH_PADDING):
        return act
    try:  # 'label' is setup_data's shorthand only: an act's is left as it is (a model reads 'labels')
        out = _parlai_message({key: value for key, value in act.items() if key != "label"})
    except DataFileError as exc:
        raise DataFileError(f"{type(teacher).__name__}.act() returned an example whose {exc}") from None
    changed = {key: out[key] for key in ANSWER_FIELDS if out.get(key) is not act.get(key)}
    return Message({**act, **changed}) if changed else act


def episodes_of(data: Any, owner: str) -> list[list[dict]]:
    """``owner.setup_data()``'s result as episodes: a list of episodes (each a list of message dicts), or
    ParlAI's DialogTeacher form, ``(message, new_episode)`` pairs (a new episode at each True). Both forms take
    ParlAI's conveniences and have each turn's fields checked (:func:`_parlai_message`). Anything else is a
    one-line DataFileError naming ``owner``, the item (episode and turn) and what to give."""
    episodes: list[list[dict]] = []
    pairs: bool | None = None
    for i, item in enumerate(data if isinstance(data, Iterable) else [data]):
        pair = _is_pair(item)
        if pairs is None:
            pairs = pair
        if pair and pairs:
            if item[1] or not episodes:
                episodes.append([])
            try:
                episodes[-1].append(_parlai_message(item[0]))
            except DataFileError as exc:
                raise DataFileError(f"{owner}.setup_data(): item {i} (episode {len(episodes) - 1}, turn "
                                    f"{len(episodes[-1])}): {exc}") from None
        elif not pairs and isinstance(item, (list, tuple)) and all(isinstance(t, dict) for t in item):
            episode: list[dict] = []
            try:
                for turn in item:
                    episode.append(_parlai_message(turn))
            except DataFileError as exc:
                raise DataFileError(f"{owner}.setup_data(): episode {i}, turn {len(episode)}: {exc}") from None
            if not episode:
                raise DataFileError(f"{owner}.setup_data(): episode {i} is empty; give each episode at least one "
                                    "message dict (or leave the empty one out)")
            episodes.append(episode)
        else:
            raise DataFileError(f"{owner}.setup_data(): item {i} is {type(item).__name__} {str(item)[:60]}; give "
                                "a list of episodes (each a list of message dicts) or yield ParlAI's (message "
                                "dict, new_episode bool) pairs, one form throughout")
    return episodes


def answer_id(msg: dict, answers: AnswerTable) -> int:
    """The id of ``msg``'s answers in ``answers``; -1 (as padding: not an example in the report) for a turn
    with neither labels nor eval_labels, which ParlAI does not count (an empty list of labels is an example)."""
    if msg.get(LABELS) is None and msg.get(EVAL_LABELS) is None:
        return -1
    return answers.id(tuple(msg.targets()))


def object_array(items: Sequence[Any]) -> np.ndarray:
    """A 1-d object array holding ``items`` as they are (numpy would unpack tuples into another dimension)."""
    out = np.empty(len(items), dtype=object)
    for i, item in enumerate(items):
        out[i] = item
    return out


class Store:
    """What the schedule and the front ends need from a store (see the module docstring)."""

    table: EpisodeTable
    speaker: str
    answers: AnswerTable  # the distinct answers of the examples served so far, by id
    example_bytes = 0.0  # file bytes read per example served, on average (0: held in memory)

    @property
    def pad(self) -> int:
        return self.table.num_examples

    def episode(self, index: int) -> list[FrozenMessage]:
        """The prepared turns of episode ``index``."""
        raise NotImplementedError

    def gather(self, block: np.ndarray) -> tuple[np.ndarray, ...]:
        """(prepared examples as an object array, their answers' ids in :attr:`answers` (-1: padding or a turn
        without labels, see :func:`answer_id`)) for an array of flat indices, both of its shape."""
        raise NotImplementedError

    def answer_ids(self, indices: Sequence[int]) -> np.ndarray:
        """The answers' ids of these flat indices."""
        return self.gather(np.asarray(indices, dtype=np.int64))[1]

    def locate(self, indices: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(episode, turn) of each flat index."""
        episodes = np.searchsorted(self.table.first, indices, side="right") - 1
        return episodes, indices - self.table.first[episodes]

    def observations(self, indices: Sequence[int], context_length: int, include_labels: bool) -> list[Message]:
        """Each example as ``TorchAgent.observe`` leaves it: a changeable copy with ``full_text``."""
        episodes, turns = self.locate(np.asarray(indices, dtype=np.int64))
        cache: dict[int, list[FrozenMessage]] = {}
        out = []
        for e, t in zip(episodes.tolist(), turns.tolist()):
            episode = cache.get(e)
            if episode is None:
                episode = cache[e] = self.episode(e)
            obs = Message(episode[t])
            obs["full_text"] = history_of(episode, t, context_length, include_labels)  # not every turn's
            out.append(obs)
        return out

    def lengths(self, length_fn: Callable[[Message], int], context_length: int, include_labels: bool) -> np.ndarray:
        """``length_fn`` of every example's observation (dynamic batching plans from these). A turn whose next
        turns' histories would hold the model's reply to it is refused (:class:`AwaitsReply`), before any step:
        these lengths, and the batches built from them, are made ahead of the model."""
        out = np.empty(self.pad + 1, dtype=np.int32)
        out[-1] = 0
        check = keeps_answers(context_length, include_labels)
        for e in range(self.table.num_episodes):
            turns = self.episode(e)
            first = int(self.table.first[e])
            if check and any(map(awaits_reply, turns[:-1])):
                raise AwaitsReply(f"episode {e}")
            for t, text in enumerate(each_history(turns, context_length, include_labels)):  # one held at a time
                obs = Message(turns[t])
                obs["full_text"] = text
                out[first + t] = int(length_fn(obs))
        return out


class EpisodeStore(Store):
    """Episodes held in memory, every turn prepared once. ``where(i)``, when given, says where episode ``i``
    comes from (:func:`~accelbatch.tasks.files.episode_at`): a turn that cannot be served is refused naming it."""

    def __init__(self, episodes: Sequence[Sequence[dict]], speaker: str, training: bool,
                 where: Callable[[int], str] | None = None):
        self.speaker, self.training = speaker, training
        self.episodes = []
        for i, episode in enumerate(episodes):
            try:
                self.episodes.extend(prepare_episode(part, speaker, training) for part in split_at_done(episode))
            except DataFileError as exc:
                if where is None:
                    raise
                raise DataFileError(f"{where(i)}: {exc}") from None
        self.table = EpisodeTable.of_lengths([len(ep) for ep in self.episodes])
        flat = [turn for ep in self.episodes for turn in ep]
        self.examples = object_array(flat + [PADDING])
        self.answers = AnswerTable()
        self.ids = np.array([answer_id(m, self.answers) for m in flat] + [-1], dtype=np.int64)

    def episode(self, index: int) -> list[FrozenMessage]:
        return self.episodes[index]

    def gather(self, block: np.ndarray) -> tuple[np.ndarray, ...]:
        return self.examples[block], self.ids[block]


class FileStore(Store):
    """A JSONL / ParlAI file read on demand: the index in memory, each episode parsed when it is needed."""

    def __init__(self, index: FileIndex, speaker: str, training: bool):
        self.index, self.speaker, self.training = index, speaker, training
        self.table = EpisodeTable.of_lengths(index.turns)
        self.answers = AnswerTable()
        self.example_bytes = index.size / max(1, self.table.num_examples)
        # parsed episodes kept for the turns that follow: up to 4,096 and about CACHE_BYTES of the file, or
        # twice the episodes of one step where that is more (_fit_cache)
        episode_bytes = max(1.0, index.size / max(1, self.table.num_episodes))  # > 0: an index of an empty file
        self._read = lru_cache(maxsize=max(64, min(4096, int(CACHE_BYTES / episode_bytes))))(self._read_episode)

    def __getstate__(self) -> dict[str, Any]:  # data workers get the index, not the cache
        return {"index": self.index, "speaker": self.speaker, "training": self.training}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["index"], state["speaker"], state["training"])

    def _read_episode(self, index: int) -> list[FrozenMessage]:
        turns = self.index.read(index)
        try:
            return prepare_episode(turns, self.speaker, self.training)
        except DataFileError as exc:  # the turn's own fault: say where it is, as the loaded file's store does
            raise DataFileError(f"{episode_at(self.index.path, int(self.index.lines[index]))}: {exc}") from None

    def episode(self, index: int) -> list[FrozenMessage]:
        return self._read(index)

    def _fit_cache(self, episodes: int) -> None:
        """Keep at least twice the episodes one step reads parsed: rows serving more episodes than the cache
        holds (-bs above about CACHE_BYTES of episodes) would evict each other's and parse each at every turn."""
        if 2 * episodes > self._read.cache_info().maxsize:
            self._read = lru_cache(maxsize=2 * episodes)(self._read_episode)

    def gather(self, block: np.ndarray) -> tuple[np.ndarray, ...]:
        flat = block.ravel()
        real = flat != self.pad
        episodes, turns = self.locate(flat[real])
        self._fit_cache(len(np.unique(episodes)))
        examples = np.full(flat.shape, PADDING, dtype=object)
        ids = np.full(flat.shape, -1, dtype=np.int64)
        picked = [self.episode(e)[t] for e, t in zip(episodes.tolist(), turns.tolist())]
        examples[real] = object_array(picked)
        ids[real] = [answer_id(m, self.answers) for m in picked]
        return examples.reshape(block.shape), ids.reshape(block.shape)


class ConcatStore(Store):
    """Several tasks' stores one after another (multitask): flat indices and episodes run on from one task
    to the next; :meth:`gather` also gives each example's task. ``weights``: each task's weight in training's
    draw (empty: equal)."""

    def __init__(self, stores: Sequence[Store], weights: tuple[float, ...] = ()):
        self.stores = list(stores)
        self.speaker = self.stores[0].speaker
        self.example_bytes = max(s.example_bytes for s in self.stores)
        self.answers = AnswerTable()
        self._global: list[list[int]] = [[] for _ in self.stores]  # per task: its answer ids -> ours
        self.offsets = np.cumsum([0] + [s.pad for s in self.stores]).astype(np.int64)
        self.episode_offsets = np.cumsum([0] + [s.table.num_episodes for s in self.stores]).astype(np.int64)
        self.table = EpisodeTable(
            np.concatenate([s.table.first + off for s, off in zip(self.stores, self.offsets[:-1])]),
            np.concatenate([s.table.turns for s in self.stores]),
            tuple(s.table.num_episodes for s in self.stores), weights)

    def task_of(self, indices: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.offsets, indices, side="right") - 1

    def episode(self, index: int) -> list[FrozenMessage]:
        task = int(np.searchsorted(self.episode_offsets, index, side="right") - 1)
        return self.stores[task].episode(index - int(self.episode_offsets[task]))

    def gather(self, block: np.ndarray) -> tuple[np.ndarray, ...]:
        examples = np.full(block.shape, PADDING, dtype=object)
        ids = np.full(block.shape, -1, dtype=np.int64)
        tasks = np.where(block != self.pad, np.minimum(self.task_of(block), len(self.stores) - 1), -1)
        for task, store in enumerate(self.stores):
            mine = (tasks == task) & (block != self.pad)
            if mine.any():
                got = store.gather(block[mine] - self.offsets[task])
                mapping = self._global[task]
                mapping.extend(self.answers.id(a) for a in store.answers.answers[len(mapping):])
                ours = np.asarray(mapping + [-1], dtype=np.int64)  # -1 stays -1
                examples[mine], ids[mine] = got[0], ours[got[1]]
        return examples, ids, tasks


__all__ = ["ConcatStore", "EpisodeStore", "FileStore", "PADDING", "Store", "answer_id", "checked_teacher_act",
           "episodes_of", "object_array", "prepare", "prepare_episode", "split_at_done"]
