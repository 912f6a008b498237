"""What a TorchAgent subclass's methods return, checked where the step meets it (see :class:`TorchAgent`).

A user's agent that breaks the contract is told in one line naming its class and the method (a
:class:`~accelbatch.messages.ReplyError`, which the command line takes as bad input, exit 2): a
``build_model()`` that returns no Module, a ``vectorize()`` that returns no dict, a ``batchify()`` that
returns no dict of tensors, a model whose outputs have other rows than the call's. The same checks run in
this process and in data workers, so a performance option never changes what is accepted.

Agents are duck-typed here (no import of :mod:`accelbatch.agents`, which imports this module).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

import torch

from accelbatch.data.squash import awaits_reply, keeps_answers, replies_not_returned
from accelbatch.messages import EVAL_LABELS, LABELS, TEXT, AgentMethodMissing, Message, ReplyError, reply_kind
from accelbatch.opts import OptionError

# what makes an observation an example rather than padding (messages.is_padding), and a training one
EXAMPLE_KEYS = (TEXT, LABELS, EVAL_LABELS)


def missing(agent: Any, method: str) -> AgentMethodMissing:
    """The error for a TorchAgent subclass that does not define ``method`` (the base class's is called)."""
    return AgentMethodMissing(f"{type(agent).__name__} must implement {method}: a TorchAgent subclass defines "
                              "build_model(), batchify() and replies() (vectorize() optional)")


def shared_of(agent: Any) -> dict[str, Any]:
    """``agent.share()``, checked: a dict holding at least the clone's 'class' and 'opts', as ParlAI's share()
    returns (a subclass adds to ``super().share()``)."""
    shared = agent.share()
    lacks = [key for key in ("class", "opts") if key not in shared] if isinstance(shared, dict) else None
    if lacks is None or lacks:
        got = f"a dict without {' and '.join(map(repr, lacks))}" if lacks else type(shared).__name__
        raise ReplyError(f"{type(agent).__name__}.share() returned {got}: it must return a dict with the clone's "
                         "'class' and 'opts'; start from super().share() and add to it, "
                         "{**super().share(), 'model': self.model}")
    return shared


def from_shared(shared: dict[str, Any]) -> Any:
    """A clone built from ``share()``'s dict as ParlAI builds one, ``Class(opts, shared)``; a class whose
    ``__init__`` cannot take ``shared`` is told so in one line."""
    cls = shared["class"]
    try:
        inspect.signature(cls).bind(shared["opts"], shared)
    except TypeError:
        raise ReplyError(f"{cls.__name__}.__init__ takes no shared argument: accelbatch builds its clones (one "
                         f"per batch row, and validation's) as {cls.__name__}(opts, shared), as ParlAI does; declare "
                         "__init__(self, opts, shared=None) and pass shared on to super().__init__") from None
    except ValueError:  # no signature to read (a builtin): let the call itself say what is wrong
        pass
    return cls(shared["opts"], shared)


SIZE_FLAGS = (("embedding_size", "-esz/--embedding-size"),)  # what a model's size follows, unless its agent says


def built_model(agent: Any) -> torch.nn.Module:
    """``agent.build_model()``, checked: a torch Module, and a model too large for memory said in one line."""
    try:
        model = agent.build_model()
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if not isinstance(exc, torch.OutOfMemoryError) and "can't allocate memory" not in str(exc):
            raise
        asked = re.search(r"tried to allocate (\S+ [a-zA-Z]+)", str(exc), re.IGNORECASE)
        opts = agent.opts  # the options its model's size follows (an agent's model_size_options; -esz)
        sizes = [f"{flag} {getattr(opts, name)}" for name, flag in getattr(agent, "model_size_options", SIZE_FLAGS)]
        raise OptionError(f"-m {opts.model}: its model does not fit in memory (torch "
                          f"{'tried to allocate ' + asked.group(1) if asked else 'ran out'}); make it smaller "
                          f"({', '.join(sizes)})") from None
    if not isinstance(model, torch.nn.Module):
        raise ReplyError(f"{type(agent).__name__}.build_model() returned {type(model).__name__}: it must return the "
                         "torch.nn.Module to train (see examples/custom_agent.py)")
    return model


def vectorized(agent: Any, observation: Message) -> dict:
    """``agent.vectorize(observation)``, checked: a dict, else a ReplyError naming the method.

    The rows are judged by the observation vectorize was given, not by what it returns: a dict without the
    observation's keys (a new dict of features alone) comes back as the observation with those features
    added (a copy), so that it is an example (not padding), trains when the observation has labels, and
    replies() reads the observation's fields, in this process as with data workers (where the step is given
    the observations themselves)."""
    kept = [(key, observation[key]) for key in EXAMPLE_KEYS if key in observation]
    result = agent.vectorize(observation)
    if not isinstance(result, dict):
        raise ReplyError(f"{type(agent).__name__}.vectorize returned {reply_kind(result)}; return the observation "
                         "(a dict) with the features batchify reads added")
    lost = {key: value for key, value in kept if key not in result}  # taken out by vectorize
    if result is observation:
        return Message({**result, **lost}) if lost else result
    if not lost and observation.keys() <= result.keys():
        return result
    return Message({**observation, **lost, **result})


def batch_rows(agent: Any, batch: Any, examples: int) -> int:
    """The rows of ``batch`` (what ``agent.batchify`` returned for ``examples`` observations), refused in one
    ReplyError naming the method unless it is what the engine cuts into micro-batches: a dict of tensors that
    agree on dim 0, at least one row per observation (rows past them are padding)."""
    name = f"{type(agent).__name__}.batchify"
    if not isinstance(batch, dict):
        raise ReplyError(f"{name} returned {reply_kind(batch)}: it must return a dict of tensors, dim 0 = rows "
                         "(e.g. {'text_vec': pad_2d(rows)})")
    rows, first = None, ""
    for key, value in batch.items():
        if not isinstance(value, torch.Tensor):
            raise ReplyError(f"{name} returned a dict whose {key!r} is {reply_kind(value)}: every value must be a "
                             "tensor with dim 0 = rows (torch.tensor(...), pad_2d(...)), which the engine cuts "
                             "into micro-batches")
        if not value.dim():
            continue
        if rows is None:
            rows, first = int(value.shape[0]), key
        elif value.shape[0] != rows:
            raise ReplyError(f"{name} returned {key!r} with {value.shape[0]} rows but {first!r} with {rows}: every "
                             "tensor needs dim 0 = rows")
    if rows is None:
        raise ReplyError(f"{name} returned {'an empty dict' if not batch else 'only 0-dim tensors'}: give each "
                         "row's features as a tensor with dim 0 = rows")
    if rows < examples:
        raise ReplyError(f"{name} returned {rows} rows for {examples} observations: it must give one row per "
                         "observation (rows past them are padding)")
    return rows


def per_row_outputs(agent: Any, result: Any, rows: int, real: int) -> tuple[dict, list[int] | None]:
    """The engine call's outputs for the real rows (the first ``real`` of the batch's ``rows``), and which
    rows they are; None for the rows when the outputs are not per row (--output-mode sum adding up several
    micro-batches of a replica). A model output with other rows than the call returns is a ReplyError naming
    the model's forward (truncated or zipped, it would score rows against other examples)."""
    outputs = result.outputs
    if not outputs:
        return outputs, None
    if result.rows is not None:  # the rows the output mode returned (all, final, everyn; a replica's own)
        expected = len(result.rows)
        _check_rows(agent, outputs, expected, f"the batch's {rows} rows" if expected == rows else
                    f"the {expected} rows the output mode returns of this {rows}-row batch")
        keep = result.rows < real
        row_ids = result.rows[keep].tolist()
        if len(row_ids) < expected:
            outputs = {k: v[keep] if v.dim() else v for k, v in outputs.items()}
        return outputs, row_ids
    summed = summed_rows(agent.engine, rows)
    if summed is None:  # an engine without a plan: no output may have more rows than the batch
        _check_rows(agent, outputs, rows, f"the batch's {rows} rows (at most)", at_most=True)
        summed = max((int(v.shape[0]) for v in outputs.values() if v.dim()), default=0)
    else:
        _check_rows(agent, outputs, summed, f"the {summed} rows --output-mode sum returns of this {rows}-row "
                    "batch (each replica's micro-batches added up row by row)")
    if summed == rows:  # each replica summed one micro-batch: the rows as they were given
        return outputs, list(range(real))
    return outputs, None


def refuse_parlai_steps(cls: type) -> None:
    """A TorchAgent subclass defining ParlAI's train_step/eval_step, which nothing here would call (the engine
    runs the step): one line naming it (the command line's exit 2, also when -m's import defines it)."""
    for name in ("train_step", "eval_step"):
        if hasattr(cls, name):
            raise ReplyError(f"{cls.__name__}.{name}: accelbatch's TorchAgent never calls ParlAI's train_step/"
                             "eval_step; the engine runs the step: give build_model() (forward(batch) returns the "
                             "loss), vectorize(), batchify() and replies() instead")


def refuse_lost_replies(agent: Any, observations: list, row_ids: list[int] | None, real: int) -> None:
    """A training call whose output mode left out the outputs of a row awaiting the model's reply (a user's
    teacher's turn without a label that more turns follow; data held in memory is refused before the first
    step): the next turns' history would lack it, so the run stops here in one line."""
    history = getattr(agent, "history", None)
    if row_ids is None or len(row_ids) == real or history is None \
            or not keeps_answers(history.context_length, history.include_labels):
        return
    returned = set(row_ids)
    if any(awaits_reply(obs) for j, obs in enumerate(observations[:real]) if j not in returned):
        raise OptionError(replies_not_returned(agent.opts))


def summed_rows(engine: Any, rows: int) -> int | None:
    """The rows of a model's per-row outputs under --output-mode sum for a training call of ``rows`` rows:
    each replica's micro-batches summed row by row (a micro-batch's rows), one per replica returned (this
    process's own when replica processes do not gather); None for an engine without a plan to read."""
    plan = getattr(engine, "plan", None)
    if plan is None or not hasattr(plan, "layout"):
        return None
    world = getattr(engine, "world_size", 1)
    total = rows * world if world > 1 and getattr(engine, "inputs", "shard") == "shard" else rows
    lay = plan.layout(total)
    if lay.sum_groups is None:
        return None
    own = world > 1 and not getattr(engine, "gather_outputs", False)
    return (1 if own else sum(1 for group in lay.sum_groups if group)) * lay.micro_batch


def _check_rows(agent: Any, outputs: dict, expected: int, where: str, at_most: bool = False) -> None:
    """A ReplyError naming the model's forward when an output with a row dimension has other than ``expected``
    rows (``at_most``: more, when the count is not known exactly); ``where`` says what the rows are."""
    for key, value in outputs.items():
        got = int(value.shape[0]) if value.dim() else expected
        if got == expected or (at_most and got < expected):
            continue
        raise ReplyError(f"{type(agent).__name__}'s model ({type(agent.model).__name__}.forward) returned {key!r} "
                         f"with {got} rows for {where}: every output but 'loss' needs one row per row of the batch "
                         "it is given (dim 0)")
