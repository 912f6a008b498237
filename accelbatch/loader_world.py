"""LoaderWorld: the batched front end. The same schedule's steps a BatchWorld of teacher and agent clones
serves (or, with ``--dynamic-batching``, a batch plan), built by the data loader: in data workers, through the
async accessor, from a file read on demand; the main process receives ready tensors. One parley is ParlAI's
four steps for a whole batch: the loader acts as the teacher, the agent steps on the batch, the teacher scores
the replies.
"""

from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Sequence

import numpy as np
import torch

from accelbatch.agents import Agent, TorchAgent
from accelbatch.data.datasets import EpisodeStore
from accelbatch.data.loader import LoadedBatch, make_loader
from accelbatch.data.squash import AwaitsReply, awaits_reply, keeps_answers, replies_not_returned
from accelbatch.messages import Message
from accelbatch.opts import OptionError, Opts, eval_datatype
from accelbatch.plan import ExecutionPlan
from accelbatch.teachers import FixedTeacher, is_training, shuffles
from accelbatch.world_display import display_rows, show
from accelbatch.worlds import World, checked_batch_act, refuse_non_messages


class LoaderWorld(World):
    """One teacher's store through :func:`~accelbatch.data.loader.make_loader` to one model agent.

    The loader builds the steps of the same schedule a BatchWorld serves (or, with ``--dynamic-batching``,
    a batch plan), with the agent's ``vectorize`` and ``batchify`` run where the batch is built; the teacher
    scores the replies. One parley is ParlAI's four steps for a whole batch.
    """

    def __init__(self, opts: Opts, agent: Agent, teacher: FixedTeacher, rows: int, shard: tuple[int, int] = (0, 1),
                 row_multiple: int = 1, serve: Sequence[int] | None = None):
        super().__init__(opts, [teacher, agent])
        self.training = is_training(opts.datatype)
        collate = agent.collate_fn() if isinstance(agent, TorchAgent) else None
        cut = _replica_cut(opts, shard, rows, self.training) if serve is None else None
        if cut is not None:  # this replica's rows of the combined batches every replica plans
            rows, row_multiple = rows * shard[1], row_multiple * shard[1]
        self._make_loader = partial(make_loader, teacher.store, opts, collate=collate, training=self.training,
                                    shard=shard, rows=rows, serve=serve,
                                    length_fn=getattr(agent, "example_length", None),
                                    batch_size=rows if serve is None else len(serve), cut=cut,
                                    row_multiple=row_multiple, shuffle=shuffles(opts.datatype))
        try:
            self.loader = self._make_loader()
        except AwaitsReply:  # met by dynamic batching's lengths, read before the first step
            raise OptionError(_replies_unknown(opts, streamed=not isinstance(teacher.store, EpisodeStore)
                                               and _stages(agent))) from None
        # the position at shutdown() ({}: the start, after a reset); the next fetch opens a new loader there
        self._shut_at: dict[str, Any] | None = None
        self._tasks = getattr(teacher.store, "task_of", None)
        self._iter: Any = None
        self._done = False
        self._ordered_pass_over = False  # train:ordered: the last parley ended a pass (epoch_done, as ParlAI)
        self._ahead: LoadedBatch | None = None  # fetched one parley early, its copy to the device started
        self.padded_tokens = 0
        self.real_tokens = 0
        self._last_rows: tuple[Sequence[Message], Sequence[Message]] = ((), ())
        self.dropped_exs = 0  # training examples the batch plan left out (--drop-last), counted with their pass
        # the agent's history would hold its replies to unlabelled turns, which the loader's squashed texts
        # cannot: episodes held in memory are checked once, now; a streamed file's batch by batch
        if awaits_replies(opts, teacher):
            raise OptionError(_replies_unknown(opts))
        self._checks_replies = keeps_answers(opts.context_length, opts.include_labels) and \
            not isinstance(teacher.store, EpisodeStore)

    def clone(self) -> "World":
        raise TypeError("a LoaderWorld is not cloned: it batches through its loader")

    def parley(self) -> None:
        """One batch; then get_acts() is [the batch's examples, the model's replies], one per row."""
        self.total_parleys += 1
        batch = self._next_batch()
        if batch is None:
            return
        if self.training and batch.num_real < batch.rows:  # --no-drop-last: padding rows stay out of the loss
            batch = _real_rows_only(batch)
        last = batch.step[1] + 1 == self.loader.steps.steps_in(batch.step[0])
        self._done = self._done or not self.training and last  # evaluation: epoch_done() after its last batch
        pass_over = self.training and last
        if pass_over:
            self.dropped_exs += self.loader.steps.dropped(batch.step[0])
        self._ordered_pass_over = pass_over and not self.loader.config.shuffle
        teacher, messages = self.agents[0], batch.messages
        if self._checks_replies and any(map(awaits_reply, messages)):
            raise OptionError(_replies_unknown(self.opts, streamed=_stages(self.agents[1])))
        ids = np.asarray(batch.ids, dtype=np.int64)
        tasks = self._tasks(ids) if self._tasks is not None else None
        replies = self._replies(messages, batch) if messages else []  # no rows of this replica: nothing to run
        teacher.score(replies, teacher.store.answer_ids(ids), len(messages), tasks)  # type: ignore[attr-defined]
        self._last_rows = (messages, replies)
        if self.opts.display_examples:
            show(self.display())
        self.total_exs += len(messages)
        self.real_tokens += sum(batch.lengths)
        self.padded_tokens += batch.rows * batch.padded_len
        self.acts = [messages, replies]

    def _next_batch(self) -> LoadedBatch | None:
        """The next batch; when the engine copies batches to a device, the one after it is fetched now and
        its copy started, so that it overlaps this batch's step (cross-call prefetch); through the async
        accessor both stay valid (the loader's ``consumer_holds=2``)."""
        start = time.perf_counter()
        try:
            engine = getattr(self.agents[1], "slot", None) and self.agents[1].engine  # type: ignore[attr-defined]
            if engine is None or not engine.stages:
                return self._fetch()
            batch, self._ahead = (self._ahead or self._fetch()), None
            if batch is not None:
                self._ahead = self._fetch()
                if self._ahead is not None and self._ahead.tensors is not None:
                    engine.stage(self._ahead.tensors)
            return batch
        finally:
            self.data_time_s += time.perf_counter() - start

    def _fetch(self) -> LoadedBatch | None:
        if self._done:
            return None
        if self._shut_at is not None:
            self._reopen(self._shut_at or None)
        if self._iter is None:
            self._iter = iter(self.loader)
        try:
            return next(self._iter)
        except StopIteration:
            if not self.training:
                self._done = True
                return None
            self._iter = iter(self.loader)  # the next training pass
            try:
                return next(self._iter)
            except StopIteration:
                raise OptionError(f"-t {self.opts.task}: an epoch of training data yields no full batch of "
                                  f"{self.loader.config.batch_size} rows; lower --batchsize, or train on the "
                                  "partial batch with --no-drop-last") from None

    def _replies(self, messages: list[Message], batch: LoadedBatch) -> list[dict]:
        agent = self.agents[1]
        if isinstance(agent, TorchAgent):
            replies: list[dict] = [{} for _ in messages]
            for row, reply in agent.step(messages, batch.tensors):  # step() refuses a reply that is no dict
                replies[row] = reply
            return replies
        if hasattr(agent, "batch_act") and getattr(agent, "use_batch_act", True):
            replies = checked_batch_act(agent, messages)
            refuse_non_messages(agent, "batch_act()", replies)
            return replies
        out = []
        for msg in messages:
            agent.observe(msg)
            out.append(agent.act())
        refuse_non_messages(agent, "act()", out)
        return out

    def epoch_done(self) -> bool:
        """Evaluation: its one pass is over; ``train:ordered`` (no cycling): the last parley ended a pass, and
        the next one starts the next pass (how ``run()`` trains ``-ne`` passes)."""
        return self._done or self._ordered_pass_over

    def display(self) -> str:
        """The last parley's rows: each example, then the model's reply to it."""
        model_id = getattr(self.agents[1], "id", type(self.agents[1]).__name__)
        return display_rows([(m, {"id": model_id, **r}) for m, r in zip(*self._last_rows)])

    def passes(self) -> float | None:
        """Training on a batch plan or in whole passes: the passes over this shard's data parleyed (whole
        passes, then the share of the current one's steps), a pass's dropped examples passed over with it; the
        same on every replica (they step together). None where the examples trained measure it: rows run on
        into the next pass."""
        at = self.plan_position()
        return None if at is None else at[0] + at[1] / max(1, at[2])

    def plan_position(self) -> tuple[int, int, int, int] | None:
        """Training on a batch plan, or a hogwild process's share served in whole passes: (pass, its steps
        parleyed, its steps, examples of this shard); None otherwise (see :meth:`passes`)."""
        steps = self.loader.steps
        if not self.training or (steps.plan is None and not steps.own_share):
            return None
        pass_, done = self.loader.position(int(self._ahead is not None))
        return pass_, done, steps.steps_in(pass_), steps.table.num_examples

    def get_total_epochs(self) -> float:
        """ParlAI's epochs parleyed: on a batch plan its passes, as this shard's share of the data (the replicas'
        add up to the passes)."""
        passes = self.passes()
        if passes is None:
            return super().get_total_epochs()
        return passes * self.loader.steps.table.num_examples / max(1, self.num_examples())

    def state_dict(self) -> dict[str, Any]:
        held = int(self._ahead is not None)  # fetched early, not parleyed yet: served again after a restore
        return {"total_exs": self.total_exs, "loader": self.loader.state_dict(held)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self._shut_at is not None:
            self._reopen(None)
        self.loader.load_state_dict(state["loader"])
        self._iter, self._done, self._ahead, self._ordered_pass_over = None, False, None, False
        self.total_exs = int(state["total_exs"])

    def report(self) -> dict[str, float]:
        return {**super().report(), **self.batching_report()}

    def batching_report(self) -> dict[str, float]:
        """The batch plan's figures: with dynamic batching pad_fraction and batch_tokens (padding included: the
        count pad_fraction is weighted by when reports merge), and the examples left out; like the teacher's
        metrics these counts start afresh after a restore."""
        rep: dict[str, float] = {}
        if self.padded_tokens and self.opts.dynamic_batching != "none":
            rep["pad_fraction"] = 1 - self.real_tokens / self.padded_tokens
            rep["batch_tokens"] = self.padded_tokens
        if self.dropped_exs:
            rep["dropped_exs"] = self.dropped_exs
        return rep

    def reset(self) -> None:
        """Serve from the start of the first pass again, as a teacher's reset rewinds its feed."""
        if self._iter is not None:
            self._iter.close()
        if self._shut_at is not None:  # the loader opened at the next fetch starts from the start
            self._shut_at = {}
        else:
            self.loader.load_state_dict({"pass": 0, "steps": 0, "digest": self.loader.steps.digest(0)})
        self._iter, self._done, self._ahead, self._ordered_pass_over = None, False, None, False
        self.padded_tokens = self.real_tokens = self.dropped_exs = 0
        super().reset()

    def shutdown(self) -> None:
        """Stop the loader (its data workers and accessor). The world stays usable, as a BatchWorld does: a
        later parley starts a new loader where this one's caller stood (``run()`` again on an evaluation
        world: from the start, as its reset does)."""
        if self._shut_at is None:
            self._shut_at = self.state_dict()
        if self._iter is not None:
            self._iter.close()
            self._iter = None
        self.loader.close()

    def _reopen(self, state: dict[str, Any] | None) -> None:
        """A new loader after :meth:`shutdown`, at ``state``'s position (None: the start)."""
        self._shut_at, self._iter, self._ahead = None, None, None
        self.loader = self._make_loader()
        if state is not None:
            self.loader.load_state_dict(state["loader"])


def awaits_replies(opts: Opts, teacher: Any) -> bool:
    """Whether episodes held in memory have a turn without a label that more turns follow, while histories keep
    answers: its next turns' histories hold the model's reply to it (a streamed file is not read through)."""
    store = getattr(teacher, "store", None)
    if not isinstance(store, EpisodeStore) or not keeps_answers(opts.context_length, opts.include_labels):
        return False
    return any(map(awaits_reply, store.examples[:-1]))


def check_replies_returned(opts: Opts, plan: ExecutionPlan, model: Agent, teacher: Any) -> None:
    """Refuse, before the first step, training a TorchAgent on episodes held in memory that await replies (see
    ``awaits_replies``) under an output mode that returns the outputs of some of a call's rows only: the
    history of the next turns would lack the reply to each turn of the others (``final`` with -ga/-di above 1
    made -ga 2's weights differ from -rf 2's)."""
    if isinstance(model, TorchAgent) and is_training(opts.datatype) and not returns_every_row(plan) \
            and awaits_replies(opts, teacher):
        raise OptionError(replies_not_returned(opts))


def returns_every_row(plan: ExecutionPlan) -> bool:
    """Whether a call of the plan's combined batch returns an output for each of its rows."""
    lay = plan.layout(plan.combined_batch)
    if lay.out_rows is None:  # sum: each row as given only where a replica sums one micro-batch
        return plan.device_iterations * plan.gradient_accumulation == 1
    return len(lay.out_rows) == plan.combined_batch


def _replies_unknown(opts: Opts, streamed: bool = False) -> str:
    """The line refusing a turn without a label that more turns of its episode follow (see ``awaits_reply``),
    naming the options without which this world would not build histories ahead of the model: those that ask
    for the loader front end, and with ``streamed`` (a streamed file, its engine staging batches) the
    ``:stream`` too, since a staging engine keeps the clones for episodes in memory that await replies."""
    chosen = ([f"--num-workers {opts.num_workers}"] if opts.num_workers else []) \
        + ([f"--dataloader-mode {opts.dataloader_mode}"] if opts.dataloader_mode != "sync" else []) \
        + ([f"--dynamic-batching {opts.dynamic_batching}"] if opts.dynamic_batching != "none" else [])
    staged = f"the loader front end (which --device {opts.device} stages batches through)"
    if streamed:
        stream = _stream_option(opts)
        why = " ".join([*chosen, stream]) if chosen else f"{stream}, read through {staged},"
        chosen.append(stream)
    else:
        why = " ".join(chosen) or staged
    without = f"run without {'it' if len(chosen) == 1 else 'them'}, or " if chosen else "run "
    return (f"-t {opts.task}: a turn without a label is followed by more turns of its episode, whose history holds "
            f"the model's reply to it; {why} builds histories ahead of the model and cannot: {without}with "
            "--context-length 1 or --no-include-labels")


def _stream_option(opts: Opts) -> str:
    """The option that streams this world's file: a training world's -dt as given; an evaluation's datatype is
    derived (from training's -dt, an --eval-splits split, or eval's -dt), so the :stream is named with it."""
    if is_training(opts.datatype):
        return f"-dt {opts.datatype}"
    split_streams = any("stream" in s and eval_datatype(s.strip()) == opts.datatype
                        for s in opts.eval_splits.split(","))
    return f"{'-dt or --eval-splits' if split_streams else '-dt'} ...:stream (this evaluation reads {opts.datatype})"


def _stages(agent: Agent) -> bool:
    """Whether ``agent``'s engine copies batches to a device ahead of their step (what ``_next_batch`` asks)."""
    engine = getattr(getattr(agent, "slot", None), "engine", None)
    return bool(getattr(engine, "stages", False))


def _replica_cut(opts: Opts, shard: tuple[int, int], rows: int,
                 training: bool) -> Callable[[int], list[list[int]]] | None:
    """With dynamic batching, each replica process's rows of an n-row combined call (``plan.shard``'s layout),
    so that R processes train and evaluate on the batches one process plans for the combined batch; None
    otherwise (one process, or hogwild processes: each batches its share of the episodes)."""
    plan = ExecutionPlan.from_opts(opts, training=training)
    count = shard[1]
    if (opts.dynamic_batching == "none" or count < 2 or rows * count != plan.combined_batch
            or plan.replication_factor != count):
        return None
    return partial(_replica_rows, plan)


def _replica_rows(plan: ExecutionPlan, rows: int) -> list[list[int]]:
    return [plan.shard({"row": torch.arange(rows)}, r)["row"].tolist() for r in range(plan.replication_factor)]


def _real_rows_only(batch: LoadedBatch) -> LoadedBatch:
    """The batch without its padding rows (training with --no-drop-last: the plan's tail policy)."""
    real = batch.num_real

    def cut(t: Any) -> Any:
        return t[:real] if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == batch.rows else t

    tensors = {k: cut(v) for k, v in batch.tensors.items()} if isinstance(batch.tensors, dict) else batch.tensors
    return LoadedBatch(tensors, batch.messages, batch.ids, batch.lengths, real, batch.padded_len, batch.step)


__all__ = ["LoaderWorld"]
