"""LoaderWorld: a batch world fed by the data loader instead of per-row teacher clones.

Used when ``--dataloader-mode`` is async or async-rebatched, ``--num-workers`` > 0, ``--dynamic-batching``
is not none, or the datatype streams (``-dt train:stream``). The teacher's episodes (or its files, when
streaming) are squashed (``--context-length``, ``--include-labels``), batched by the loader (dynamic
batching, sharding across replicas), and the agent's ``vectorize`` and ``batchify`` run in the data
workers, so the main process receives ready tensors. One parley is still ParlAI's four steps, for a
whole batch: the loader acts as the teacher, the agent steps on the batch, and the replies are scored
against the batch's labels in one pass.

Resume. :meth:`LoaderWorld.data_position` (taken between parleys) is the loader's position as batches the
world has consumed (:meth:`accelbatch.data.loader.Loader.position`) with ``total_exs`` and
``dropped_exs``; :meth:`LoaderWorld.restore_data_position` puts a freshly built world (same options) there
before its first parley. :func:`accelbatch.data_position.world_position` uses them. Streamed data
(``-dt train:stream``) has an exact position too: batches per data worker consumed in the current epoch,
restored by re-reading each worker's shard and discarding them (see :mod:`accelbatch.data.loader`).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

from accelbatch.agents import Agent, TorchAgent
from accelbatch.data.datasets import _is_example
from accelbatch.data.loader import LoadedBatch, Loader, make_loader
from accelbatch.data.sharding import ShardSpec
from accelbatch.messages import EVAL_LABELS, LABELS, TEXT, Message
from accelbatch.metrics import Metrics
from accelbatch.opts import OptionError, Opts
from accelbatch.plan import ExecutionPlan
from accelbatch.tasks.files import file_format
from accelbatch.teachers import FileTeacher, FixedTeacher, create_teachers, is_training
from accelbatch.worlds import World


def uses_loader(opts: Opts) -> bool:
    """Whether ``opts`` ask for the data loader rather than ParlAI's per-row teacher clones."""
    return (opts.dataloader_mode != "sync" or opts.num_workers > 0 or opts.dynamic_batching != "none"
            or "stream" in opts.datatype)


class LoaderWorld(World):
    """One task's data through :func:`accelbatch.data.loader.make_loader` to one model agent."""

    def __init__(self, opts: Opts, agent: Agent, rows: int, shard: ShardSpec | None = None,
                 row_multiple: int = 1):
        super().__init__(opts, [agent])
        self.training = is_training(opts.datatype)
        self.metrics = Metrics()
        data, self._num_examples = _task_data(opts)
        collate = agent.collate_fn() if isinstance(agent, TorchAgent) else None
        self.loader: Loader = make_loader(data, opts, collate=collate, training=self.training, shard=shard,
                                          batch_size=rows, row_multiple=row_multiple,
                                          shuffle="ordered" not in opts.datatype, length_fn=_length_fn(agent))
        self._iter: Any = None
        self._done = False
        self.padded_tokens = 0
        self.real_tokens = 0
        self.dropped_exs = 0  # training examples left out in partial static-shape batches (--drop-last)
        self.acts = [None, None]

    def get_task_agent(self) -> Any:
        return None

    def get_model_agent(self) -> Agent:
        return self.agents[0]

    def clone(self) -> "World":
        raise TypeError("a LoaderWorld is not cloned: it batches through its loader")

    def parley(self) -> None:
        batch = self._next_batch()
        while batch is not None and self.training and batch.num_real < batch.rows:
            if self.opts.drop_last:
                # a static-shape batch with padding rows (a bucket's partial tail): padding must not enter
                # the loss, so with --drop-last it is left out like any partial training batch, and counted
                self.dropped_exs += batch.num_real
                batch = self._next_batch()
            else:
                batch = _real_rows_only(batch)
        if batch is None:
            return
        messages = batch.messages if self.training else [_as_eval(m) for m in batch.messages]
        texts = self._replies(messages, batch)
        self.metrics.add_rows(texts, [tuple(m.targets()) for m in messages], len(messages))
        self.total_exs += len(messages)
        self.real_tokens += sum(batch.lengths)
        self.padded_tokens += batch.rows * batch.padded_len
        self.acts = [messages[-1] if messages else None, None]

    def _next_batch(self) -> LoadedBatch | None:
        start = time.perf_counter()
        try:
            return self._fetch()
        finally:
            self.data_time_s += time.perf_counter() - start

    def _fetch(self) -> LoadedBatch | None:
        if self._done:
            return None
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            if not self.training:
                self._done = True
                return None
            self._iter = iter(self.loader)  # the next training epoch
            try:
                return next(self._iter)
            except StopIteration:
                raise OptionError(f"-t {self.opts.task}: an epoch of training data yields no full batch "
                                  f"of {self.loader.config.batch_size} rows; lower --batchsize, or train on the "
                                  "partial batch with --no-drop-last") from None

    def _replies(self, messages: list[Message], batch: LoadedBatch) -> list[str | None]:
        agent = self.agents[0]
        if isinstance(agent, TorchAgent):
            texts: list[str | None] = [None] * len(messages)
            for row, reply in agent.step(messages, batch.tensors):
                texts[row] = reply.get(TEXT)
            return texts
        if hasattr(agent, "batch_act") and getattr(agent, "use_batch_act", True):
            return [r.get(TEXT) for r in agent.batch_act(messages)]
        out = []
        for msg in messages:
            agent.observe(msg)
            out.append(agent.act().get(TEXT))
        return out

    def epoch_done(self) -> bool:
        return self._done

    # data position (resume) ------------------------------------------------------------------------
    def data_position(self) -> dict[str, Any]:
        """JSON data: ``{"loader": Loader.position(), "total_exs", "dropped_exs", "unsupported": []}``.
        Take it between parleys."""
        return {"loader": self.loader.position(), "total_exs": int(self.total_exs),
                "dropped_exs": int(self.dropped_exs), "unsupported": []}

    def restore_data_position(self, position: dict[str, Any]) -> None:
        """Put this world (freshly built with the same options) at a :meth:`data_position`."""
        from accelbatch.checkpoint import CheckpointError

        if not isinstance(position.get("loader"), dict):
            raise CheckpointError(f"data position: the checkpoint was taken with a {position.get('world')} "
                                  "world, this run feeds a LoaderWorld through the data loader; resume with the "
                                  "same --dynamic-batching, --num-workers, --dataloader-mode and -dt")
        try:
            self.loader.restore(position["loader"])
        except (ValueError, TypeError) as exc:
            raise CheckpointError(f"{exc}") from None
        self._iter = None
        self._done = False
        self.total_exs = int(position["total_exs"])
        self.dropped_exs = int(position.get("dropped_exs", 0))

    def num_examples(self) -> int:
        return self._num_examples

    def num_episodes(self) -> int:
        return self._num_examples

    def task_report(self) -> dict[str, float]:
        return self.metrics.report()

    def report(self) -> dict[str, float]:
        rep = self.metrics.report()
        rep.update(self.get_model_agent().report())
        if self.padded_tokens:
            rep["pad_fraction"] = round(1 - self.real_tokens / self.padded_tokens, 4)
        if self.dropped_exs:
            rep["dropped_exs"] = self.dropped_exs
        return rep

    def reset_metrics(self) -> None:
        self.metrics.clear()
        self.get_model_agent().reset_metrics()

    def reset(self) -> None:
        self._iter = None
        self._done = False
        self.get_model_agent().reset()

    def shutdown(self) -> None:
        self.loader.close()


def _real_rows_only(batch: LoadedBatch) -> LoadedBatch:
    """The batch without its padding rows (training with --no-drop-last: the plan's tail policy)."""
    real = batch.num_real

    def cut(t: Any) -> Any:
        return t[:real] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch.rows else t

    tensors = {k: cut(v) for k, v in batch.tensors.items()} if isinstance(batch.tensors, dict) else batch.tensors
    return LoadedBatch(tensors, batch.messages, batch.ids, batch.lengths, real, batch.padded_len, batch.source)


def _as_eval(msg: Message) -> Message:
    if LABELS not in msg:
        return msg
    out = Message(msg)
    out[EVAL_LABELS] = out.pop(LABELS)
    return out


def _length_fn(agent: Agent) -> Callable[[Message], int] | None:
    return getattr(agent, "example_length", None)


def _task_data(opts: Opts) -> tuple[Any, int]:
    """(episodes or file path, number of examples) of one task."""
    if "stream" in opts.datatype:
        kind = opts.task.partition(":")[0]
        if kind not in ("jsonl", "parlai"):
            raise ValueError(f"-dt {opts.datatype}: streaming reads files; use -t jsonl:PATH or "
                             f"-t parlai:PATH (got -t {opts.task})")
        path = FileTeacher.resolve_path(opts)
        return path, _count_examples(path)
    teacher = create_teachers(opts)[0]
    if not isinstance(teacher, FixedTeacher):
        raise TypeError(f"-t {opts.task}: the data loader needs a FixedTeacher (episodes in memory) or a "
                        "file task; run it without --dynamic-batching/--num-workers/--dataloader-mode")
    return teacher.episodes, teacher.num_examples()


def _count_examples(path: str) -> int:
    fmt = file_format(path)
    with open(path, "rb") as handle:
        return sum(1 for line in handle if _is_example(line, fmt))


def make_loader_worlds(opts: Opts, agent: Agent, plan: ExecutionPlan, shard: ShardSpec) -> list[LoaderWorld]:
    """One LoaderWorld per comma-separated task, each with this replica's rows per step."""
    replicas = shard.world_size
    rows = plan.combined_batch // replicas
    multiple = plan.factor // replicas
    tasks = [t.strip() for t in opts.task.split(",") if t.strip()]
    return [LoaderWorld(opts.replace(task=t), agent, rows, shard, multiple) for t in tasks]


__all__ = ["LoaderWorld", "make_loader_worlds", "uses_loader"]
