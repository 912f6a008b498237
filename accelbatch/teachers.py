"""Teachers: agents that serve a dataset and score the replies, and the task registry.

A :class:`FixedTeacher` serves a store of episodes (:mod:`accelbatch.data.datasets`) through the schedule
(:mod:`accelbatch.data.schedule`): its clones (one per BatchWorld row) are the rows of one
:class:`~accelbatch.data.schedule.RowFeed`, so in evaluation every example is served once whatever the batch
size, and in training episodes come in a fresh seeded order each epoch. A BatchWorld reads the feed for all
rows at once; a clone acting alone reads its own row: the same examples in the same order either way.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from accelbatch.agents import Agent
from accelbatch.data.datasets import PADDING, ConcatStore, EpisodeStore, FileStore, Store, _is_pair, episodes_of
from accelbatch.data.orders import make_order
from accelbatch.data.schedule import RowFeed, RowSchedule
from accelbatch.messages import CANDIDATE_FIELDS, AgentMethodMissing, Message, str_candidates
from accelbatch.metrics import Metrics, merge_reports, wants_bleu
from accelbatch.names import UnknownNameError, import_path
from accelbatch.opts import OptionError, Opts, eval_datatype, is_training, split_of  # noqa: F401 (re-exported)
from accelbatch.task_weights import task_weights
from accelbatch.tasks.files import DataFileError, FileIndex, episode_at, load_numbered_episodes

_NO_EXAMPLES = "-t {task} ({split}): the task holds no examples; give its {split} data at least one{torch}"
# task name -> "module:Class"; a task string is "name" or "name:argument" (e.g. babi:1, jsonl:PATH).
TASK_PATHS: dict[str, str] = {
    "babi": "accelbatch.tasks.babi:BabiTeacher",
    "jsonl": "accelbatch.teachers:FileTeacher",
    "parlai": "accelbatch.teachers:FileTeacher",
    "dialogues": "accelbatch.tasks.dialogues:SyntheticDialogueTeacher",
    "torch": "accelbatch.tasks.torch_data:TorchDatasetTeacher",
    "reverse": "accelbatch.tasks.reverse:ReverseTeacher",
}

TASK_HELP: dict[str, str] = {
    "babi:1": "generated bAbI-style QA, single supporting fact (no download)",
    "babi:2": "generated bAbI-style QA, two supporting facts (no download)",
    "jsonl:PATH": "a JSONL file (or a folder with train/valid/test.jsonl)",
    "parlai:PATH": "a ParlAI text-format file (or a folder with train/valid/test.txt)",
    "dialogues": "synthetic dialogues of the throughput benchmark",
    "torch:pkg.mod:make_dataset": "your torch Dataset: make_dataset(split) (use with -m torch:pkg.mod:Model)",
    "reverse": "generation: reply with the text's word reversed (reverse:N for N training examples)",
}


def shuffles(datatype: str) -> bool:
    """Whether the data order is shuffled each epoch (training, unless ``:ordered``)."""
    return is_training(datatype) and "ordered" not in datatype


class Teacher(Agent):
    """A teacher acts with examples and observes replies to score them. Its acts' ``id`` is its task when ``-t``
    names its class (``babi:1``, ``jsonl:PATH``, ``pkg.mod:Class``), as ParlAI's, else its class's name, unless
    the class sets ``id`` itself."""

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        if not hasattr(self, "id") and _serves_task(type(self), getattr(opts, "task", "")):
            self.id = opts.task
        super().__init__(opts, shared)

    def epoch_done(self) -> bool:
        """ParlAI's: ``self.epochDone``, which a teacher of yours sets when its data runs out."""
        return bool(getattr(self, "epochDone", False))

    def reset(self) -> None:
        """Start the data again with no metrics (ParlAI's)."""
        super().reset()
        self.epochDone = False
        self.reset_metrics()

    def state_dict(self) -> dict[str, Any]:
        """Where this teacher's data continues; a teacher of unknown position says so (FixedTeacher knows)."""
        return {"unsupported": f"{type(self).__name__} is not a FixedTeacher: its data position is unknown"}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "unsupported" in state:
            raise ValueError(f"data position: {state['unsupported']}")

    def num_examples(self) -> int:
        raise AgentMethodMissing(f"{type(self).__name__} must implement num_examples() (a Teacher says how many "
                                 "examples and episodes it serves; a FixedTeacher counts its setup_data())")

    def num_episodes(self) -> int:
        raise AgentMethodMissing(f"{type(self).__name__} must implement num_episodes() (a Teacher says how many "
                                 "examples and episodes it serves; a FixedTeacher counts its setup_data())")


@dataclass
class Serving:
    """How a FixedTeacher's clones read its store, shared by them: rows per step, this process's shard of
    the episodes, and the feed built from those (lazily, on the first act)."""

    rows: int = 1
    shard: tuple[int, int] = (0, 1)
    feed: RowFeed | None = None
    layout: tuple[int, tuple[int, ...]] | None = None  # a replica: (rows of the combined batch, its rows of them)


class PassFeed(RowFeed):
    """Training on ordered data (``train:ordered``): as in ParlAI the data does not cycle, so the epoch is
    done after one pass (its last step padded); a step after that starts the next pass, which is how
    ``run()`` trains ``-ne`` passes. A world driven by hand stops at ``epoch_done()`` (or calls ``reset()``)."""

    def _next_pass(self) -> None:
        if min(self.row_steps) >= (self.schedule.steps or 0):
            self.rewind()

    def step(self) -> tuple[Any, ...]:
        self._next_pass()
        return super().step()

    def take(self, row: int) -> tuple[Any, ...]:
        self._next_pass()
        return super().take(row)


class FixedTeacher(Teacher):
    """Serves a fixed set of episodes; subclasses give ``setup_data()``: a list of episodes (lists of message
    dicts), or ParlAI's DialogTeacher form, yielding ``(message, new_episode)`` pairs (or override
    :meth:`build_store`). A turn saying ``episode_done`` ends its episode.

    Training (datatype train) loops forever over shuffled episodes; evaluation (valid/test or train:evalmode)
    serves each episode once, then only padding rows, and so does ``train:ordered`` (ParlAI: ordered data does
    not cycle) until acted again after its epoch (:class:`PassFeed`). In evaluation the ``labels`` become
    ``eval_labels`` so the agent does not train on them. Examples are served read-only (``FrozenMessage``, one
    object per example): an agent that changes what it observes copies it first.
    """

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        self.datatype = opts.datatype
        self.training = is_training(opts.datatype)
        self.cycles = shuffles(opts.datatype)  # ParlAI's should_cycle: training, not ordered
        self.row = 0  # the feed row this clone serves
        self._last: tuple[Any, ...] | None = None
        if shared is None:
            try:
                self.store = self.build_store()
            except DataFileError as exc:
                if str(exc).startswith("a training example"):  # said of an example: name its task too
                    raise DataFileError(f"-t {opts.task}: {exc}") from None
                raise
            if self.store.table.num_examples == 0:
                raise DataFileError(_NO_EXAMPLES.format(task=opts.task, split=split_of(opts.datatype), torch=(
                    " (its Dataset: at least one item)" if opts.task.startswith("torch:") else "")))
            self.metrics = Metrics(bleu=wants_bleu(opts.metrics))
            self.serving = Serving()
        else:
            self.store, self.metrics, self.serving = shared["store"], shared["metrics"], shared["serving"]

    def setup_data(self) -> Any:
        """A list of episodes (lists of message dicts), or ParlAI's form: yield (message, new_episode) pairs."""
        parlai_get = " (ParlAI's FixedDialogTeacher get(episode_idx, entry_idx) is not read)" \
            if callable(getattr(self, "get", None)) else ""
        raise AgentMethodMissing(f"{type(self).__name__} must implement setup_data(): a FixedTeacher's data, a "
                                 f"list of episodes or ParlAI's (message, new_episode) pairs{parlai_get}")

    def build_store(self) -> Store:
        owner = type(self).__name__
        data = self.setup_data(*_datafile_for(self.setup_data, self.opts, owner))
        return EpisodeStore(episodes_of(candidates_checked(data, owner), owner), self.id, self.training)

    @property
    def episodes(self) -> list[list[Message]]:
        """The prepared episodes (an in-memory store's)."""
        return self.store.episodes  # type: ignore[attr-defined]

    def share(self) -> dict[str, Any]:
        return {**super().share(), "store": self.store, "metrics": self.metrics, "serving": self.serving}

    def check_counts(self) -> None:
        """Refuse an override of num_examples() / num_episodes() that is not what the data holds (-ne counts
        epochs by them); called once the teacher is whole (ParlAI's set what they return in __init__)."""
        wrong = self.store.table.miscounted(type(self).__name__, num_examples=self.num_examples(),
                                            num_episodes=self.num_episodes())
        if wrong:
            raise DataFileError(wrong)

    def num_examples(self) -> int:
        """Examples of the whole split (every shard's), so epochs mean the same on every replica."""
        return self.store.table.num_examples

    def num_episodes(self) -> int:
        return self.store.table.num_episodes

    # --- the feed ------------------------------------------------------------------------------------
    def serve_rows(self, rows: int) -> None:
        """Serve ``rows`` rows per step (a BatchWorld's clones are rows 0..rows-1); before any act."""
        self.serving.rows, self.serving.feed = rows, None

    def keep_shard(self, index: int, count: int) -> None:
        """Serve only episodes ``index, index + count, ...`` (this replica's or process's share)."""
        self.check_shareable(count)
        self.serving.shard, self.serving.feed = (index, count), None

    def check_shareable(self, count: int) -> None:
        """Refuse in one line to share training data of fewer episodes than ``count`` replicas or processes."""
        episodes = self.num_episodes()
        if count > 1 and self.training and episodes < count:
            raise OptionError(f"-t {self.opts.task}: {episodes} training episode(s) cannot be shared by {count} "
                              f"replicas or processes (-rf / -nt): {count - episodes} would have none; use fewer, "
                              "or train on more data")

    def serve_replica(self, layout_rows: int, rows: Sequence[int]) -> None:
        """Serve rows ``rows`` of the schedule laid out for ``layout_rows`` rows (a replica's share of the
        combined batch: what a single process would hand that replica)."""
        self.serving.layout, self.serving.rows, self.serving.feed = (layout_rows, tuple(rows)), len(rows), None

    @property
    def feed(self) -> RowFeed:
        """The feed every clone of this teacher reads (built on first use)."""
        serving = self.serving
        if serving.feed is None:
            table = self.store.table.shard(*serving.shard, whole_small_tasks=self.training and self.cycles)
            capped = not self.training and self.opts.get("validation_max_exs", -1) > 0
            order = make_order(table, shuffles(self.datatype), self.opts.seed, balance_tasks=capped)
            layout = serving.layout if serving.layout and len(serving.layout[1]) == serving.rows else None
            schedule = RowSchedule(table, layout[0] if layout else serving.rows, order, loop=self.cycles,
                                   pad=self.store.pad, serve=layout[1] if layout else None)
            feed = PassFeed if self.training and not self.cycles else RowFeed
            serving.feed = feed(schedule, self.store.gather, self.store.example_bytes)
        return serving.feed

    def act(self) -> Message:
        """This clone's next example (read-only); padding once its row has served its part (evaluation)."""
        self._last = self.feed.take(self.row)
        return self._last[0]

    def observe(self, reply: Message) -> Message:
        """Score the reply to the last example (accuracy and F1 against its answers)."""
        last, self._last = self._last, None
        if last is not None and last[0] is not PADDING:  # a turn without labels: counted in training only
            self.score([reply], last[1:2], 1, None if len(last) < 3 else last[2:3])
        return reply

    def score(self, replies: Sequence[dict], answer_ids: Sequence[int], examples: int,
              tasks: Sequence[int] | None = None) -> None:
        """Count ``examples`` examples and score the replies against their answers, given by id in the store's
        answer table (-1: a padding row; an array or a sequence); ``tasks`` (multitask) says each row's task."""
        self.metrics.add_replies(replies, answer_ids, self.store.answers, self.counted(examples, answer_ids))

    def counted(self, examples: int, answer_ids: Sequence[int]) -> int:
        """The examples that count in the report's exs: in evaluation only turns with labels (ParlAI's: the
        others have answer id -1, as padding); training counts every turn trained, as the train row does."""
        return examples if self.training else int(np.count_nonzero(np.asarray(answer_ids) >= 0))

    def epoch_done(self) -> bool:
        return not self.cycles and self.feed.done(self.row)

    def reset(self) -> None:
        super().reset()  # the metrics too
        self.feed.rewind()
        self._last = None

    def state_dict(self) -> dict[str, Any]:
        """The feed's position (shared by every clone)."""
        return self.feed.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.feed.load_state_dict(state)

    def report(self) -> dict[str, float]:
        return self.metrics.report()

    def reset_metrics(self) -> None:
        self.metrics.clear()


def candidates_checked(data: Any, owner: str) -> Any:
    """``owner.setup_data()``'s ``data`` as it is, its turns read as they pass: a turn giving its candidates as
    one str ('red|blue|green', which ParlAI's conveniences leave a str and a ranker reads as one candidate) is a
    one-line DataFileError naming ``owner``, the item as :func:`episodes_of` names it, and the field."""
    return _checked_items(data, owner) if isinstance(data, Iterable) and not isinstance(data, (str, dict)) else data


def _checked_items(data: Iterable, owner: str) -> Iterator[Any]:
    episode, turn = -1, 0  # the pairs' episode and turn, counted as episodes_of counts them
    for i, item in enumerate(data):
        if _is_pair(item):
            episode, turn = (episode + 1, 0) if item[1] or episode < 0 else (episode, turn + 1)
            _refuse_str_candidates(item[0], f"{owner}.setup_data(): item {i} (episode {episode}, turn {turn})")
        elif isinstance(item, (list, tuple)):
            for t, msg in enumerate(item):
                if isinstance(msg, dict):
                    _refuse_str_candidates(msg, f"{owner}.setup_data(): episode {i}, turn {t}")
        yield item


def _refuse_str_candidates(msg: dict, where: str) -> None:
    for key in CANDIDATE_FIELDS:
        refused = str_candidates(key, msg.get(key))
        if refused is not None:
            raise DataFileError(f"{where}: {refused}")


class FileTeacher(FixedTeacher):
    """``jsonl:PATH`` or ``parlai:PATH``: one file served whatever the datatype, or a folder holding
    ``train``/``valid``/``test`` files (``.jsonl`` or ``.txt``). With ``-dt ...:stream`` the file is read on
    demand through an index of its episodes instead of being loaded."""

    def build_store(self) -> Store:
        kind = self.opts.task.partition(":")[0]
        path, fmt = self.resolve_path(self.opts), ("jsonl" if kind == "jsonl" else "parlai")
        if "stream" in self.opts.datatype:
            return FileStore(FileIndex.build(path, fmt), self.id, self.training)
        numbered = load_numbered_episodes(path, fmt)
        return EpisodeStore([episode for _, episode in numbered], self.id, self.training,
                            where=lambda i: episode_at(path, numbered[i][0]))

    @staticmethod
    def resolve_path(opts: Opts) -> str:
        """The file a ``jsonl:PATH``/``parlai:PATH`` task reads for ``opts.datatype``."""
        kind, _, path = opts.task.partition(":")
        if not path:
            example = "data/train.jsonl" if kind == "jsonl" else "data/train.txt"
            raise DataFileError(f"-t {kind}: needs a path, e.g. -t {kind}:{example}")
        path = given_file(path, opts.datapath)
        if os.path.isdir(path):
            path = os.path.join(path, split_of(opts.datatype) + (".jsonl" if kind == "jsonl" else ".txt"))
        return path


FILE_TASKS = ("jsonl", "parlai")


def given_file(path: str, datapath: str | None) -> str:
    """The file or folder a file task's ``path`` names: ``~`` expanded, a relative path under -dp when given."""
    path = os.path.expanduser(path)
    return os.path.join(datapath, path) if datapath and not os.path.isabs(path) else path


def portable_task(task: str, datapath: str | None) -> str:
    """``task`` naming the same data from any folder: each ``jsonl:``/``parlai:`` part's path absolute, -dp
    applied (what PATH.opt and a checkpoint keep, so an eval or a resume run elsewhere reads the same files)."""
    parts = []
    for part in task.split(","):
        kind, _, path = part.strip().partition(":")
        parts.append(f"{kind}:{os.path.abspath(given_file(path, datapath))}" if kind in FILE_TASKS and path
                     else part)
    return ",".join(parts)


def task_metric_spelled(metric: str, task: str, datapath: str | None) -> str:
    """``metric`` ("TASK/name") with its task spelled as ``task`` spells it where both name the same data (a
    file's relative and absolute path: a model file's task is kept absolute); else ``metric`` as it is."""
    prefix, slash, name = metric.rpartition("/")
    if not slash or prefix.partition(":")[0] not in FILE_TASKS:
        return metric
    same = portable_task(prefix, datapath)
    spelled = next((part.strip() for part in task.split(",") if portable_task(part.strip(), datapath) == same), None)
    return metric if spelled is None else f"{spelled}/{name}"


def task_files(task: str) -> list[str]:
    """The files and folders the ``jsonl:``/``parlai:`` parts of ``task`` name (as given)."""
    return [part.strip().partition(":")[2] for part in task.split(",")
            if part.strip().partition(":")[0] in FILE_TASKS and part.strip().partition(":")[2]]


class MultiTaskTeacher(FixedTeacher):
    """Several FixedTeachers' tasks served as one (``-t A,B``): one store, each task scored by its own metrics.
    Training draws each new episode's task at random, uniformly or by ``-mtw`` (ParlAI's multitask rule);
    ordered data and evaluation serve each example once, one episode of each task in turn (ParlAI's)."""

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None, *,
                 teachers: Sequence[FixedTeacher] = (), names: Sequence[str] = ()):
        if shared is None:
            self._parts, self.names = list(teachers), list(names)
        else:
            self._parts, self.names = shared["parts"], shared["names"]
        super().__init__(opts, shared)
        self.task_metrics = [t.metrics for t in self._parts]

    def build_store(self) -> Store:
        stores = [t.store for t in self._parts]
        return ConcatStore(stores, task_weights(self.opts.multitask_weights, [s.table.num_episodes for s in stores]))

    def share(self) -> dict[str, Any]:
        return {**super().share(), "parts": self._parts, "names": self.names}

    def score(self, replies: Sequence[dict], answer_ids: Sequence[int], examples: int,
              tasks: Sequence[int] | None = None) -> None:
        tasks, answer_ids = np.asarray(tasks), np.asarray(answer_ids)
        counted = tasks[tasks >= 0] if self.training else tasks[answer_ids >= 0]  # padding rows have task -1
        for task, served in zip(*(a.tolist() for a in np.unique(counted, return_counts=True))):
            rows = np.flatnonzero((tasks == task) & (answer_ids >= 0))
            self.task_metrics[task].add_replies([replies[r] for r in rows.tolist()], answer_ids[rows],
                                                self.store.answers, served)

    def report(self) -> dict[str, float]:
        return merge_reports((name, m.report()) for name, m in zip(self.names, self.task_metrics))

    def reset_metrics(self) -> None:
        for metrics in self.task_metrics:
            metrics.clear()


def _datafile_for(setup_data: Any, opts: Opts, owner: str) -> tuple[Any, ...]:
    """setup_data's arguments: none, or ParlAI's DialogTeacher call, ``setup_data(opt['datafile'])``, for one
    that takes a path (a teacher ported from ParlAI sets ``opt['datafile']`` before its base __init__)."""
    try:
        takes = [p for p in inspect.signature(setup_data).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.default is p.empty]
    except (TypeError, ValueError):  # no signature to read (a builtin): called as it is
        return ()
    if not takes:
        return ()
    if "datafile" not in opts:
        raise DataFileError(f"{owner}.setup_data({takes[0].name}) takes ParlAI's opt['datafile'], which is not set: "
                            "set opt['datafile'] = PATH before calling the base class's __init__, as for ParlAI's "
                            "DialogTeacher (or define setup_data(self))")
    return (opts["datafile"],)


def resolve_teacher_class(task: str) -> type[Teacher]:
    """The teacher class for one task string ('babi:1', 'jsonl:PATH', 'pkg.module:Class')."""
    name = task.split(":", 1)[0]
    if name in TASK_PATHS:
        return import_path(TASK_PATHS[name], "task", list(TASK_HELP))
    if ":" in task and "." in name or ":" in task and task.split(":", 1)[1][:1].isupper():
        return import_path(task, "task", list(TASK_HELP))
    raise UnknownNameError(f"unknown task {task!r}; known tasks: {', '.join(TASK_HELP)} "
                           "(or give a path as module:Class)")


def _serves_task(cls: type, task: str) -> bool:
    """Whether ``task`` is one task whose teacher class is ``cls`` (a teacher made by hand with other options
    does not take their task's name)."""
    try:
        return "," not in task and resolve_teacher_class(task) is cls
    except (UnknownNameError, ImportError):
        return False


def task_names(opts: Opts) -> list[str]:
    tasks = [t.strip() for t in opts.task.split(",") if t.strip()]
    if not tasks:
        raise UnknownNameError(f"-t/--task is empty; known tasks: {', '.join(TASK_HELP)}")
    twice = sorted({t for t in tasks if tasks.count(t) > 1})
    if twice:  # each task's metrics are reported under its name: a second one would overwrite the first's
        raise UnknownNameError(f"-t/--task {opts.task}: names {', '.join(twice)} more than once; list each task "
                               "once")
    return tasks


def comma_in_path(opts: Opts, task: str) -> str | None:
    """When ``task`` (a part of ``-t``) names a missing file and joining it with the parts after it names a
    path that exists, a one-line message saying so; None otherwise. A comma always separates tasks (ParlAI's
    multitask syntax), so such a path cannot be given to -t."""
    kind, _, given = task.partition(":")
    if kind not in FILE_TASKS or not given or os.path.exists(FileTeacher.resolve_path(opts.replace(task=task))):
        return None
    parts = opts.task.split(",")
    for start in (i for i, part in enumerate(parts) if part.strip() == task):
        for end in range(start + 2, len(parts) + 1):
            path = FileTeacher.resolve_path(opts.replace(task=",".join(parts[start:end]).strip()))
            if os.path.exists(path):
                names = [repr(p.strip()) for p in parts[start:end]]
                return (f"-t {opts.task}: commas separate tasks (multitask), so this is the tasks "
                        f"{', '.join(names[:-1])} and {names[-1]}; the file {path} exists: rename it without "
                        "the comma")
    return None


def create_teachers(opts: Opts) -> list[Teacher]:
    """One teacher per comma-separated task."""
    teachers: list[Teacher] = []
    for task in task_names(opts):
        try:
            teachers.append(resolve_teacher_class(task)(opts.replace(task=task)))
            getattr(teachers[-1], "check_counts", lambda: None)()  # a FixedTeacher's, once it is whole
        except DataFileError:
            # a missing file whose path was cut at a comma: say that, not just "no such file"
            message = comma_in_path(opts, task)
            if message is None:
                raise
            raise DataFileError(message) from None
    return teachers


def create_teacher(opts: Opts, teachers: list[Teacher] | None = None) -> Teacher | None:
    """The one teacher serving every task of ``opts`` (of ``teachers``, made already): the task's own, or a
    MultiTaskTeacher over several FixedTeachers; None when one of several is no FixedTeacher (a MultiWorld)."""
    teachers = create_teachers(opts) if teachers is None else teachers
    if len(teachers) == 1:
        return teachers[0]
    if all(isinstance(t, FixedTeacher) for t in teachers):
        return MultiTaskTeacher(opts, teachers=teachers, names=task_names(opts))  # type: ignore[arg-type]
    return None


def list_tasks() -> Sequence[tuple[str, str]]:
    return list(TASK_HELP.items())
