"""Agents: ParlAI's observe/act contract, sharing rules, and TorchAgent.

Sharing rules (as in ParlAI): ``share()`` returns what clones may hold in common (the model, the
optimizer, the engine slot, metrics); ``clone()`` builds a new agent of the same class from it. A clone
keeps its own conversation state (history, last observation).

A :class:`TorchAgent` subclass says *what* to compute (build_model, vectorize, batchify, replies); the
backend's engine decides *where and how* the step runs, so agents are the same on every device.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from accelbatch import agent_checks, optimizers
from accelbatch.checkpoint import CheckpointError, read_json_file, write_error, write_torch
from accelbatch.data.squash import History
from accelbatch.dictionary import hash_tokens, tokenize  # noqa: F401 - agents' public helpers
from accelbatch.messages import EPISODE_DONE, EVAL_LABELS, LABELS, TEXT, Message, checked_replies, is_padding
from accelbatch.metrics import Metrics
from accelbatch.optimizers import learning_rates, optimizer_kwargs, rates_text, set_learning_rates, state_fits
from accelbatch.opts import OptionError, Opts, is_training
from accelbatch.report_merge import with_loss_count
from accelbatch.zip_crc import damaged_entry

if TYPE_CHECKING:
    from accelbatch.data.loader import AgentCollate

# optional per-row model outputs (see TorchAgent): each row's loss, and 1 for the rows the loss counts, 0 for the
# others (no target among the row's candidates, padding rows); evaluation reports the mean over the counted rows
ROW_LOSS = "row_loss"
ROW_COUNTED = "row_counted"

class ModelFileError(OptionError):
    """A model file (--model-file, --init-model) that cannot be loaded: the message names it and the problem."""


class Agent:
    """Base agent: remembers its last observation; ``act`` is the subclass's. ``required_fields``: message
    keys without which it learns nothing (the build refuses a task none of whose examples has one)."""

    required_fields: tuple[str, ...] = ()
    # metrics the agent adds to a report besides the teacher's (None: unknown, as a user's agent may add any)
    reported_metrics: frozenset[str] | None = None
    # False: its replies carry no text, so nothing scores accuracy, f1 or bleu-4 (a generator that skips generation)
    replies_text: bool = True

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        self.opts = opts
        if not hasattr(self, "id"):  # as ParlAI's: an id set before (a teacher's task, a subclass's) stays
            self.id = type(self).__name__
        self.observation: Message | None = None

    @classmethod
    def add_cmdline_args(cls, parser: Any, partial_opt: Any = None) -> Any:
        """Declare the agent's own options on ``parser`` (ParlAI's hook; see accelbatch/agent_args.py): none."""
        return parser

    def observe(self, observation: Message) -> Message:
        self.observation = observation
        return observation

    def act(self) -> Message:
        raise NotImplementedError(f"{type(self).__name__} must implement act()")

    def self_observe(self, reply: Message) -> None:
        """Called with this agent's own reply (after batch_act); override to learn from it."""

    def share(self) -> dict[str, Any]:
        return {"class": type(self), "opts": self.opts}

    def clone(self) -> "Agent":
        return agent_checks.from_shared(agent_checks.shared_of(self))

    # ParlAI's name for opts: ported code reads (and sets) self.opt
    opt = property(lambda self: self.opts, lambda self, value: setattr(self, "opts", value))

    def getID(self) -> str:  # noqa: N802 - ParlAI's name, which ported agents call in act()
        return self.id

    def fork(self) -> "Agent":
        """A clone for another world (e.g. validation): same model, its own metrics (a copy in place of the
        ``metrics`` and ``global_metrics`` its ``share()`` hands on, as ParlAI agents share theirs with their
        clones; the world reports from its reset), so the training world's stay its own."""
        shared = agent_checks.shared_of(self)
        own = {key: _own_metrics(shared[key]) for key in ("metrics", "global_metrics") if key in shared}
        return agent_checks.from_shared({**shared, **own})

    def reset(self) -> None:
        """Forget the conversation and the metrics (ParlAI's reset: a new pass reports afresh)."""
        self.observation = None
        self.reset_metrics()

    def state_dict(self) -> dict[str, Any]:
        """This clone's conversation in progress as JSON data (checkpoints take it between parleys); the
        base agent keeps none. Model weights are the engine's, not here."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`'s data."""

    def report(self) -> dict[str, float]:
        return {}

    def reset_metrics(self) -> None:
        pass

    def shutdown(self) -> None:
        pass


@dataclass
class EngineSlot:
    """Holds the engine all clones of a TorchAgent step through; the build fills it (and the runtime that
    compiled it, so a world built later for the same agent reuses both)."""

    engine: Any = None
    backend_name: str = ""
    runtime: Any = None
    learning_rate: float | None = None  # the -lr the shared optimizer runs at, once a later world changed it


def _own_metrics(metrics: Any) -> Any:
    """A fork's own metrics: a copy of a dict of counters (which the forked world's reset_metrics clears), else
    a new one of their class (accelbatch's Metrics, ParlAI's)."""
    return copy.deepcopy(metrics) if isinstance(metrics, dict) else type(metrics)()


def pad_2d(rows: Sequence[Sequence[int]], length: int | None = None) -> torch.Tensor:
    """Right-pad integer rows with 0 into a [len(rows), length] LongTensor."""
    width = max(1, length if length is not None else max((len(r) for r in rows), default=1))
    out = torch.zeros(len(rows), width, dtype=torch.long)
    for i, r in enumerate(rows):
        r = list(r)[:width]
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


class TorchAgent(Agent):
    """An agent with a torch model. Subclasses give the four methods below; the engine runs the step.

    - ``build_model()`` -> nn.Module whose ``forward(batch)`` returns a dict with ``loss`` (mean over
      the rows) and per-row outputs; a model whose loss leaves some rows out (rows without a target) also
      returns each row's loss as :data:`ROW_LOSS` and 1/0 for the rows it counts as :data:`ROW_COUNTED`, so
      evaluation reports the mean over exactly those rows, however they are batched;
    - ``vectorize(obs)`` -> the observation with whatever per-row features batchify needs (a dict; a new
      dict of features alone is read as the observation with them added: a row is judged by what observe saw);
    - ``batchify(observations)`` -> dict of tensors, dim 0 = rows;
    - ``replies(outputs, observations)`` -> one reply dict per row.

    A method returning something else, or a model's outputs with other rows than its batch's, is refused in
    one line naming it (:mod:`accelbatch.agent_checks`).
    """

    use_batch_act = True
    reported_metrics: frozenset[str] | None = frozenset({"loss", "skipped_updates"})

    def __init_subclass__(cls, **kwargs: Any) -> None:
        """Refuse ParlAI's train_step/eval_step, which nothing here would call (the engine runs the step)."""
        super().__init_subclass__(**kwargs)
        agent_checks.refuse_parlai_steps(cls)

    def __init__(self, opts: Opts, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        self.history = History(opts.context_length, opts.include_labels)
        self._last_label: str | None = None
        self._previous_done = True
        if shared is None:
            torch.manual_seed(opts.seed)
            self.model = agent_checks.built_model(self)
            # as ParlAI's agents: an optimizer only for training (eval, display-model and interactive skip
            # building one, and with it torch's first-optimizer import of torch._dynamo: 1.7 s of start-up)
            self.optimizer = self.build_optimizer(self.model) if is_training(opts.datatype) else None
            self.slot = EngineSlot()
            self.metrics = Metrics()
            self.load_notes: list[str] = []  # what loading a model file changed, for the run to say once
            if opts.model_file and os.path.isfile(opts.model_file):
                self.load(opts.model_file)
                if opts.init_model:
                    self.load_notes.append(f"--init-model {opts.init_model}: not used: -mf {opts.model_file} exists "
                                           "and is continued (move it away to start from --init-model)")
            elif opts.init_model:
                if not os.path.isfile(opts.init_model):
                    what = "a directory, not a model file" if os.path.isdir(opts.init_model) else "no such file"
                    raise ModelFileError(f"--init-model {opts.init_model}: {what}")
                self.load(opts.init_model, "--init-model", optimizer=False)
        else:
            self.model = shared["model"]
            self.optimizer = shared["optimizer"]
            self.slot = shared["slot"]
            self.metrics = shared["metrics"]

    # --- what subclasses give ------------------------------------------------------------------
    def build_model(self) -> torch.nn.Module:
        raise agent_checks.missing(self, "build_model()")

    def vectorize(self, observation: Message) -> Message:
        return observation

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        raise agent_checks.missing(self, "batchify(observations)")

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        raise agent_checks.missing(self, "replies(outputs, observations)")

    def summed_metrics(self, outputs: dict[str, torch.Tensor]) -> None:
        """Metrics from a call's outputs under --output-mode sum (summed over its micro-batches, so no row
        replies); a subclass whose metrics are sums over rows adds them here."""

    def build_optimizer(self, model: torch.nn.Module) -> torch.optim.Optimizer | None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return None
        kinds = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}
        kind = kinds[self.opts.optimizer]
        return kind(params, lr=self.opts.learning_rate, **optimizer_kwargs(self.opts, kind, model))

    # --- sharing ---------------------------------------------------------------------------------
    def share(self) -> dict[str, Any]:
        shared = super().share()
        shared.update(model=self.model, optimizer=self.optimizer, slot=self.slot, metrics=self.metrics)
        return shared

    # --- engine ----------------------------------------------------------------------------------
    @property
    def engine(self) -> Any:
        """The engine every clone steps through (the build compiles the model for --device and sets it)."""
        if self.slot.engine is None:
            raise RuntimeError(f"{type(self).__name__} has no engine: build its world with "
                               "accelbatch.create_world(opts, agent=...), which compiles the model for --device, "
                               "or set one with agent.attach_engine(backend.compile(model, optimizer, plan), name)")
        return self.slot.engine

    def attach_engine(self, engine: Any, backend_name: str) -> None:
        self.slot.engine = engine
        self.slot.backend_name = backend_name
        adopted = engine.host_optimizer() if hasattr(engine, "host_optimizer") else None
        kept, unread = self.__dict__.pop("_device_optimizer_state", (None, None))
        if adopted is not None and adopted is not self.optimizer:  # the IPU's poptorch.optim optimizer
            rates = learning_rates(self.optimizer) if self.optimizer is not None else []
            self.optimizer = adopted
            if kept is not None:  # the model file's device state, which a torch optimizer could not hold
                adopted.load_state_dict(kept)
                set_learning_rates(adopted, rates)
        elif kept is not None:  # a device that keeps a torch optimizer: the IPU's state is not for it
            self.load_notes.append(f"{unread} --device {backend_name} cannot read it: it starts afresh (weights "
                                   "loaded; continue with --device ipu to keep it)")

    # --- conversation ----------------------------------------------------------------------------
    def observe(self, observation: Message) -> Message:
        if is_padding(observation):
            self.observation = observation
            return observation
        if self._previous_done:
            self.history.clear()
            self._last_label = None
        obs = Message(observation)
        obs["full_text"] = self.history.add(obs.get(TEXT), self._last_label)
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS)
        self._last_label = targets[0] if targets else None
        self._previous_done = bool(obs.get(EPISODE_DONE, False))
        self.observation = self._vectorized(obs)  # a dict, judged by obs (see agent_checks.vectorized)
        return self.observation

    def act(self) -> Message:
        reply = self.batch_act([self.observation])[0]
        self.self_observe(reply)
        return reply

    def self_observe(self, reply: Message) -> None:
        """After an unlabelled turn (a conversation, as interactive's), this clone's own reply joins its history
        as that turn's answer, as a label would (ParlAI's self_observe); worlds call it for batch_act's rows.
        An override that keeps this calls ``super().self_observe(reply)``."""
        if self._last_label is None and isinstance(reply, dict) and reply.get(TEXT):  # "": said nothing (a ranker
            self._last_label = reply[TEXT]  # without candidates); a reply that is no dict is refused by the world

    def reset(self) -> None:
        super().reset()
        self.history.clear()
        self._last_label = None
        self._previous_done = True

    def state_dict(self) -> dict[str, Any]:
        """This clone's episode in progress (history, last label) as JSON data, for checkpoints."""
        return {"turns": list(self.history.turns), "last_label": self._last_label, "previous_done": self._previous_done}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue an episode from :meth:`state_dict`'s data."""
        if state:
            self.history.turns = list(state["turns"])
            self._last_label = state["last_label"]
            self._previous_done = bool(state["previous_done"])

    def batch_act(self, observations: Sequence[Message | None]) -> list[Message]:
        replies = [Message(id=self.id) for _ in observations]
        rows = [i for i, obs in enumerate(observations) if not is_padding(obs)]
        if not rows:
            return replies
        batch_obs = [observations[i] for i in rows]  # type: ignore[misc]
        for j, reply in self.step(batch_obs, self.batchify(batch_obs)):
            replies[rows[j]].update(reply)
        return replies

    def before_call(self, rows: int, training: bool) -> None:
        """Called before each engine call of ``rows`` rows (``training``: a training step); nothing here."""

    def step(self, observations: Sequence[Message], batch: dict[str, torch.Tensor]) -> list[tuple[int, dict]]:
        """Run one engine call on a batchified batch whose first rows are ``observations``.

        Rows past ``len(observations)`` are padding (static shapes) and get no reply. Training when the
        rows carry ``labels``. Returns (row, reply) for the rows the output mode returned.
        """
        rows, real = agent_checks.batch_rows(self, batch, len(observations)), len(observations)
        training = self.engine.trains(any(LABELS in obs for obs in observations))
        self.before_call(rows, training)
        if training and rows != real:
            raise ValueError(f"a training batch has {rows} rows but {real} examples: "
                             "padding rows would enter the loss; train with --drop-last (the default)")
        result = self.engine.train_step(batch) if training else self.engine.eval_step(batch)
        if result.extras.get("skipped_updates"):
            self.metrics.add("skipped_updates", result.extras["skipped_updates"])
        # the examples the report's exs counts (every training row, each evaluation row with labels): see loss_exs
        labelled = [obs.get(LABELS) is not None or obs.get(EVAL_LABELS) is not None for obs in observations]
        self.metrics.add_examples(real if training else sum(labelled))
        outputs, row_ids = agent_checks.per_row_outputs(self, result, rows, real)  # None: not per row (sum)
        if training:
            agent_checks.refuse_lost_replies(self, observations, row_ids, real)
        if outputs and row_ids is None:
            self.summed_metrics(outputs)
        if row_ids is not None and ROW_LOSS in outputs and (not training or (
                len(row_ids) == real and not result.extras.get("skipped_updates"))):
            # per-row losses of every row: the mean over the rows the loss counts, however they are batched
            self._add_row_losses(outputs)
        elif result.loss is not None and rows == real:  # padding rows (static shapes) in its mean: left out
            # each micro-batch's mean weighted by its labelled rows (context turns add nothing)
            self.metrics.add_loss_parts(result.loss_parts or ((0, real, result.loss),), labelled)
        if row_ids is None:
            return []
        produced = checked_replies(self, self.replies(outputs, [observations[j] for j in row_ids]), len(row_ids))
        return list(zip(row_ids, produced))

    def _add_row_losses(self, outputs: dict[str, torch.Tensor]) -> None:
        """Add the losses of the rows ``outputs`` count (:data:`ROW_LOSS`, :data:`ROW_COUNTED`) to the report."""
        counted = outputs[ROW_COUNTED].detach().reshape(-1) > 0
        n = int(counted.sum())
        if n:  # a batch none of whose rows is counted adds nothing (its mean would be 0 / 0)
            total = outputs[ROW_LOSS].detach().reshape(-1).double()[counted].sum()
            self.metrics.add_loss(float(total) / n, n)

    def collate_fn(self) -> "AgentCollate":
        """vectorize + batchify as a picklable callable for data workers (model, optimizer left behind)."""
        from accelbatch.data.loader import AgentCollate

        light = copy.copy(self)
        for name in ("model", "optimizer", "slot", "metrics"):
            light.__dict__[name] = None
        return AgentCollate(light._vectorized, light._batchified)  # checked as in this process

    def _vectorized(self, observation: Message) -> dict:
        """``vectorize``, checked (:func:`~accelbatch.agent_checks.vectorized`), here and in data workers."""
        return agent_checks.vectorized(self, observation)

    def _batchified(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        """``batchify``, checked (:func:`~accelbatch.agent_checks.batch_rows`) where a data worker runs it."""
        batch = self.batchify(observations)
        agent_checks.batch_rows(self, batch, len(observations))
        return batch

    # --- metrics and persistence -----------------------------------------------------------------
    def report(self) -> dict[str, float]:
        """The model's metrics; its examples are the teacher's (exs left out), its loss said with its own count
        (``loss_exs``: the teacher also counts context turns, which no loss covers)."""
        rep = with_loss_count(self.metrics.report())
        rep.pop("exs", None)
        return rep

    def reset_metrics(self) -> None:
        self.metrics.clear()

    def save(self, path: str) -> None:
        """Write model and optimizer weights (and the optimizer's class) to ``path`` (a link's target) atomically;
        a write the OS refuses (no space, no permission) is one CheckpointError naming it, leaving no part."""
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["optimizer_class"] = type(self.optimizer).__name__
        try:
            target = os.path.realpath(path)
        except FileNotFoundError:  # a relative path whose working folder was removed during the run
            raise CheckpointError(f"{path}: cannot be written: the working folder it is relative to was removed; "
                                  "give -mf/--model-file as an absolute path") from None
        tmp = f"{target}.tmp"
        try:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            write_torch(tmp, state)
            os.replace(tmp, target)
        except (OSError, RuntimeError) as exc:
            error = write_error(path, exc, tmp)
            if error is exc:
                raise
            raise error from None

    def load(self, path: str, option: str = "--model-file", optimizer: bool = True) -> None:
        """Load weights saved by :meth:`save` (never unpickling code), and the optimizer's state when
        ``optimizer`` and the file's optimizer is this one's kind: its learning rate becomes --learning-rate.
        Another kind of optimizer starts fresh. Either is said in :attr:`load_notes`. A file that is not
        such a save, or holds weights of other shapes, is a :class:`ModelFileError` naming it."""
        if (damaged := damaged_entry(path)) is not None:
            raise ModelFileError(f"{option} {path}: cannot load: its {damaged} fails its CRC-32 check (the file was "
                                 f"damaged after it was saved); point {option} at another copy")
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - any failure here means the file is not a save of ours
            first = (str(exc).strip().splitlines() or [""])[0].split(". ")[0][:160]
            raise ModelFileError(f"{option} {path}: cannot load: not a model file saved by accelbatch "
                                 f"({type(exc).__name__}: {first}); point {option} at another file") from None
        weights = state.get("model") if isinstance(state, dict) else None
        if not isinstance(weights, dict):
            raise ModelFileError(f"{option} {path}: cannot load: the file holds no model weights (not saved by "
                                 f"accelbatch); point {option} at another file")
        try:
            check_weights(weights, self.model.state_dict(), f"{option} {path}: cannot load", type(self).__name__)
        except ModelFileError as exc:
            if not _opt_names_no_model(path):
                raise
            raise ModelFileError(f"{option} {path}: cannot load into {type(self).__name__}: {path}.opt names no "
                                 "model (its agent's class could not be recorded); give -m module:Class of the "
                                 "agent that saved it") from exc
        self.model.load_state_dict(weights)
        if optimizer and self.optimizer is not None:
            self._load_optimizer(state, path, option)

    def _load_optimizer(self, state: dict[str, Any], path: str, option: str) -> None:
        saved, kind = state.get("optimizer"), type(self.optimizer).__name__
        if saved is None:  # weights alone (saved by hand, or by an agent that had no optimizer)
            self.load_notes.append(f"{option} {path}: holds no optimizer state; {kind} starts fresh (weights loaded)")
            return
        saved_kind = state.get("optimizer_class")
        same_kind = state_fits(saved, self.optimizer, saved_kind)
        fresh = learning_rates(self.optimizer)  # what this run's options (and the agent) give
        misfit = optimizers.state_misfit(saved, self.optimizer, self.model) if same_kind else None
        if misfit:
            raise ModelFileError(f"{option} {path}: its {kind} state does not fit this {type(self).__name__}'s "
                                 f"parameters ({misfit}); start from its weights alone: --init-model {path} -mf "
                                 "ANOTHER_PATH")
        if same_kind:
            try:
                self.optimizer.load_state_dict(saved)
            except (ValueError, KeyError, TypeError):
                same_kind = False
        if not same_kind:
            self.optimizer = self.build_optimizer(self.model)
            self.load_notes.append(f"{option} {path}: saved with {saved_kind or 'another'} optimizer state; "
                                   f"{kind} starts fresh (weights loaded)")
            return
        if "ipu_state" in saved and self.slot.engine is None:  # saved on an IPU: for the engine's optimizer
            self._device_optimizer_state = (saved, f"{option} {path}: its {kind} state was kept by an IPU (the "
                                                   "device's format);")  # (attach_engine)
        had = set_learning_rates(self.optimizer, fresh)
        if had:
            self.load_notes.append(f"{option} {path}: continuing with -lr {rates_text(fresh)} (the file's optimizer "
                                   f"had {had})")


def check_weights(saved: dict[str, Any], wanted: dict[str, torch.Tensor], what: str, model: str) -> None:
    """A one-line ModelFileError when ``saved`` are not weights of the model ``wanted`` describes."""
    missing = [k for k in wanted if k not in saved]
    unexpected = [k for k in saved if k not in wanted]
    parts = [f"{w} {', '.join(keys[:3])}" for w, keys in (("missing", missing), ("unexpected", unexpected)) if keys]
    if parts:
        raise ModelFileError(f"{what}: its weights are not a {model}'s ({'; '.join(parts)}); was it saved by "
                             "another -m model?")
    for key, tensor in wanted.items():
        got = saved[key]
        if not isinstance(got, torch.Tensor) or got.shape != tensor.shape:
            shape = list(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
            raise ModelFileError(f"{what}: {key} is {shape} in the file but {list(tensor.shape)} in this "
                                 f"{model}; load it with the options it was trained with (e.g. -esz; -mf PATH takes "
                                 "them from PATH.opt)")


def _opt_names_no_model(path: str) -> bool:
    """Whether ``path``'s options file PATH.opt (:mod:`accelbatch.model_opts`) exists and names no ``-m`` model."""
    saved = read_json_file(f"{path}.opt")
    return isinstance(saved, dict) and "model" not in saved
