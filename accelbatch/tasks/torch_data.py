"""A user's own torch Dataset and nn.Module, PopTorch-style: ``-t torch:pkg.mod:make_dataset`` and
``-m torch:pkg.mod:MyModel``.

The dataset factory is called with the split (``"train"``, ``"valid"`` or ``"test"``) and returns a map-style
or iterable ``torch.utils.data.Dataset``; each item is a tensor or a tuple of tensors whose last element is the
target when there are two or more (PopTorch's tutorials' ``(x, y)``). The model class (or factory) is called
with no arguments; its ``forward(*inputs, target)`` returns ``(outputs, loss)`` and ``forward(*inputs)``
returns ``outputs``, as PopTorch's trainingModel/inferenceModel expect.

Each item is one example (an episode of one turn) served by a :class:`~accelbatch.teachers.FixedTeacher`, so
the plan (D, R, G, output modes), the loaders, exactly-once evaluation, exact resume and the report work as
for any task. Items are read once when the split is set up and held in memory; an iterable dataset (no
``len``) that yields more than :data:`MAX_STREAMED_ITEMS` (1,000,000: about 1.4 GB and 10 s for small items)
is refused, as one that never ends would otherwise fill the memory. A target that is a single integer is also
the example's label (its decimal text); when the model's outputs are one row of class scores per item, the
reply is the arg max, so the report has accuracy beside the loss. An item without such a target (inputs only,
or a regression's float target) has no label and is not scored: the report has its loss only.

A factory that raises or returns None, and an item that cannot be read (``__getitem__`` or the iterator
raises, or ``__len__`` counts more items than there are) or is not tensors, end the run with one line naming
``-t``, the split, the item index and the user's exception (chained as the cause). A model whose forward
cannot be called so with the items' parts (its signature does not bind them) is one line naming ``-m`` and
``-t``, said before the engine calls it. Items are read by ``-m torch:...`` alone, and it reads nothing else:
a text task with it, or a ``torch:`` task with another model, is refused before the first step
(:func:`check_pairing`; a user's own teacher serving text to it, at its first batch).
"""

from __future__ import annotations

import functools
import inspect
import math
import os
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, default_collate

from accelbatch.agents import TorchAgent
from accelbatch.messages import Message
from accelbatch.names import AGENT_PATHS, import_object
from accelbatch.opts import OptionError, is_training
from accelbatch.teachers import TASK_PATHS, FixedTeacher, split_of

PREFIX = "torch:"
ITEM, INDEX = "item", "item_index"
MAX_STREAMED_ITEMS = 1_000_000  # items an iterable dataset (which has no len) may give one split


def load(path: str, flag: str, what: str) -> Any:
    """The object at ``pkg.module:Name`` (after ``torch:``), or an OptionError naming ``flag``."""
    if not path.startswith(PREFIX) or path.count(":") != 2:
        raise OptionError(f"{flag} {path!r}: expected torch:pkg.module:Name (the {what})")
    return import_object(path[len(PREFIX):], what, [])


def items_of(dataset: Any, task: str, split: str = "train") -> list[tuple[torch.Tensor, ...]]:
    """Every item of a map-style (``len`` and ``[i]``) or iterable dataset, each as a tuple of tensors.

    Bad data is an OptionError naming ``-t``, the split and the item index: an item that is not tensors, a
    ``__getitem__`` or iterator that raises (its message kept, the exception chained), and an iterable that
    yields more than :data:`MAX_STREAMED_ITEMS` items (it is held in memory, so it must end)."""
    where = f"-t {task} ({split})"
    iterable = isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__")
                                                             and hasattr(dataset, "__getitem__"))
    if iterable and not (hasattr(dataset, "__iter__") or hasattr(dataset, "__getitem__")):
        raise OptionError(f"{where}: the dataset factory returned {_a(dataset)}, not a torch Dataset; return a "
                          f"map-style or iterable Dataset for {split!r}")
    try:
        size = None if iterable else len(dataset)
        raw = iter(dataset) if iterable else None
    except Exception as exc:
        raise OptionError(f"{where}: {'iter' if iterable else 'len'}(dataset) raised {_said(exc)}; fix the "
                          "dataset") from exc
    items = []
    while True:
        index = len(items)
        try:  # map-style items read by index, not through a generator (which turns a StopIteration into another)
            item = next(raw, _END) if raw is not None else dataset[index] if index < size else _END
        except Exception as exc:  # the user's __getitem__ or __iter__: named with the item it was reading
            hint = (f"; does __len__ (which gives {size}) count more items than there are?"
                    if isinstance(exc, IndexError) and size is not None else "; fix the dataset")
            raise OptionError(f"{where}: item {index}: {'reading it' if iterable else '__getitem__'} raised "
                              f"{_said(exc)}{hint}") from exc
        if item is _END:
            return items
        if iterable and index == MAX_STREAMED_ITEMS:  # one item more than the bound: refused, not held
            raise OptionError(f"{where}: the iterable dataset yielded more than {MAX_STREAMED_ITEMS:,} items "
                              "without ending; items are read once per split and held in memory, so an iterable "
                              "must end within that: give a finite one, or a map-style Dataset (len and [i]), "
                              "which has no such bound")
        # a numpy scalar becomes the Python number it holds (numpy's float64 then float32, as a Python float)
        parts = tuple(p.item() if isinstance(p, np.generic) else p
                      for p in (item if isinstance(item, (tuple, list)) else (item,)))
        for p in parts:
            if not isinstance(p, (torch.Tensor, int, float)):
                raise OptionError(f"{where}: item {index} holds a {type(p).__name__}; items must be tensors (or "
                                  "tuples of tensors, the target last)")
        items.append(tuple(torch.as_tensor(p) for p in parts))


def check_batchable(items: Sequence[tuple[torch.Tensor, ...]], where: str, together: str | None = "") -> None:
    """Refuse, when the data is read, items that ``default_collate`` would batch wrongly with item 0 (a part of
    another dtype: a float target among class indices would be batched as a float, and the loss fail far from
    the item) and, when batches hold several items (``together``: why, or "", None when they hold one), items
    it cannot batch with it (another number of parts, a part of another shape); naming both items."""
    if not items:
        return
    first = [(p.dtype, p.shape) for p in items[0]]
    fix = "(or batch them yourself: --collate)"
    for index, item in enumerate(items):
        if together is not None and len(item) != len(first):
            raise OptionError(f"{where}: item {index} has {len(item)} parts, item 0 {len(first)}; every item "
                              f"needs the same parts {fix}")
        odd = next((k for k, p in enumerate(item[:len(first)])
                    if p.dtype != first[k][0] or together is not None and p.shape != first[k][1]), None)
        if odd is None:
            continue
        dtype, shape = first[odd]
        if item[odd].dtype != dtype:
            raise OptionError(f"{where}: item {index}'s part {odd} is {item[odd].dtype}, item 0's {dtype}; give "
                              f"every item's part the same dtype {fix}")
        raise OptionError(f"{where}: item {index} cannot be batched with item 0{together}: part {odd} has shape "
                          f"{tuple(item[odd].shape)} against {tuple(shape)}; give every item's part the same "
                          f"shape {fix}")


def label_of(item: tuple[torch.Tensor, ...]) -> str | None:
    """The item's class label (its target's decimal text) when the target is one integer; None otherwise (no
    target, or a float or multi-element one): such an item is not scored."""
    target = item[-1] if len(item) > 1 else None
    if target is not None and target.numel() == 1 and not target.is_floating_point():
        return str(int(target))
    return None


def _replies_with_class(item: tuple[torch.Tensor, ...]) -> bool:
    """True when an arg max of the model's class scores is a sensible reply: the target is one class index; an
    item without one (a regression target, or inputs only) gets no reply text, so it is counted, not scored."""
    return label_of(item) is not None


class TorchDatasetTeacher(FixedTeacher):
    """``-t torch:pkg.mod:make_dataset``: one example per item of the factory's dataset for the split."""

    @property
    def reported_metrics(self) -> frozenset[str]:  # type: ignore[override]
        """accuracy and f1 only when some item has a class target: items without one are not scored."""
        scored = any(turn.targets() for episode in self.episodes for turn in episode)
        return frozenset({"exs", "accuracy", "f1"} if scored else {"exs"})

    def setup_data(self) -> list[list[Message]]:
        task = self.opts.task
        if self.opts.dynamic_batching != "none":  # it would measure the placeholder text below, not the items
            raise OptionError(f"--dynamic-batching {self.opts.dynamic_batching}: -t {task}'s items are tensors with "
                              "no text to measure (its batches are -bs items); leave --dynamic-batching out")
        factory = load(task, "-t", "dataset factory")
        split = split_of(self.opts.datatype)
        if not callable(factory):
            raise OptionError(f"-t {task}: {_a(factory)}, not a dataset factory (a function or class called "
                              "with the split)")
        try:
            dataset = factory(split)
        except Exception as exc:
            raise OptionError(f"-t {task} ({split}): calling the dataset factory with {split!r} raised "
                              f"{_said(exc)}; fix the factory{_leave_out(split)}") from exc
        if dataset is None:
            raise OptionError(f"-t {task} ({split}): the dataset factory returned None for {split!r}; return a "
                              f"Dataset for it{_leave_out(split)}")
        items = items_of(dataset, task, split)
        if not self.opts.collate:  # default_collate's batches, checked before the first step
            o = self.opts
            plan = [("-bs", o.batchsize)] + [(flag, n) for flag, n in (
                ("-di", o.device_iterations), ("-ga", o.gradient_accumulation), ("-rf", o.replication_factor)) if n > 1]
            rows = math.prod(n for _, n in plan)
            together = f" ({' x '.join(f'{f} {n}' for f, n in plan)} = {rows} items are batched together, as " \
                "poptorch.DataLoader's combined batch)" if len(plan) > 1 else ""
            check_batchable(items, f"-t {task} ({split})", together=together if rows > 1 else None)
        # labels: the class index as text, or an empty list for an item without a class target (its reply has
        # no text, so it is counted in exs and not scored)
        return [[Message(text=f"{split} item {i}", labels=[] if (label := label_of(item)) is None else [label],
                         episode_done=True, **{ITEM: item, INDEX: i})] for i, item in enumerate(items)]


_END = object()  # the end of a dataset's items (next's default)


def _a(obj: Any) -> str:
    """``None``, or "a list" / "an int": what a user's code gave instead of what was expected."""
    if obj is None:
        return "None"
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _said(exc: BaseException) -> str:
    """A user's exception in one line: its type, the first line of its message and where it was raised."""
    message = str(exc).splitlines()[0] if str(exc).strip() else ""
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if f.filename != __file__]  # the user's code
    at = f" at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno}" if frames else ""
    return f"{type(exc).__name__}{': ' + message if message else ''}{at}"


def _leave_out(split: str) -> str:
    """How not to read an evaluation split (train always reads the train split)."""
    if split == "train":
        return ""
    no_validation = " and -veps -1" if split == "valid" else ""
    return f", or leave {split!r} out (train: --eval-splits without it{no_validation}; eval: another -dt)"


class ModuleAdapter(torch.nn.Module):
    """dict in, dict out around a PopTorch-style module: ``{"input00", ..., "target"}`` ->
    ``{"out", "loss"}``. Without a target the module's ``forward(*inputs)`` gives the outputs, or, as a
    PopTorch model trained without labels (an autoencoder) does, ``(outputs, loss)``: a 0-dim loss."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = [batch[k] for k in input_keys(batch)]
        if "target" not in batch:
            result = self.module(*inputs)
            if isinstance(result, (tuple, list)) and len(result) == 2 and isinstance(result[1], torch.Tensor) \
                    and result[1].dim() == 0:
                return {"out": self._rows(result[0], inputs, "forward(*inputs)", True), "loss": result[1]}
            if self.training:
                raise OptionError(f"-m {type(self.module).__name__}: the items have no target (one part each), "
                                  f"and forward(*inputs) returned {type(result).__name__}, not (outputs, loss) "
                                  "with a 0-dim loss: to train without targets return the loss with the outputs; "
                                  "to train on targets make them each item's last part")
            return {"out": self._rows(result, inputs, "forward(*inputs)", False)}
        result = self.module(*inputs, batch["target"])
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise OptionError(f"-m {type(self.module).__name__}: forward(*inputs, target) must return "
                              f"(outputs, loss), got {type(result).__name__}")
        outputs, loss = result
        if not isinstance(loss, torch.Tensor):  # loss.item(): training and evaluation read a tensor
            raise OptionError(f"-m {type(self.module).__name__}: forward(*inputs, target) returned (outputs, loss) "
                              f"with loss {_a(loss)}, not a tensor: return the loss tensor itself (not loss.item() "
                              "or float(loss)); the gradient flows through it")
        return {"out": self._rows(outputs, inputs, "forward(*inputs, target)", True), "loss": loss}

    def _rows(self, outputs: Any, inputs: list[torch.Tensor], call: str, paired: bool) -> torch.Tensor:
        """``outputs`` when it is one tensor of per-row outputs (dim 0: the batch's rows), as the engine splits
        and returns them by row; anything else (a tuple, a dict, a 0-dim tensor) is an OptionError naming -m and
        ``call`` (``paired``: it returned ``(outputs, loss)``)."""
        rows = inputs[0].shape[0] if inputs and inputs[0].dim() else None
        if isinstance(outputs, torch.Tensor) and outputs.dim() and rows in (None, outputs.shape[0]):
            return outputs
        got = f"a tensor of shape {tuple(outputs.shape)}" if isinstance(outputs, torch.Tensor) else _a(outputs)
        raise OptionError(f"-m {type(self.module).__name__}: {call} returned {'(outputs, loss) with outputs ' * paired}"
                          f"{got}; the outputs must be one tensor with a row per item (dim 0: {rows} rows here), "
                          "e.g. the logits alone, not a tuple or dict")


class TorchModelAgent(TorchAgent):
    """``-m torch:pkg.mod:MyModel``: the user's module, batches collated with torch's default_collate."""

    _fitting_calls: frozenset[tuple[int, bool]] = frozenset()  # (inputs, has a target) forward was checked for

    def step(self, observations: Sequence[Message], batch: dict[str, torch.Tensor]) -> list[tuple[int, dict]]:
        """Check (once per layout) that the module's forward takes the batch's parts before the engine calls it:
        a misfit is one line naming -m and -t, not a TypeError from deep inside the step."""
        layout = (len(input_keys(batch)), "target" in batch)
        if layout not in self._fitting_calls and isinstance(self.model, ModuleAdapter):
            self._check_call(self.model.module, *layout)
            self._fitting_calls = self._fitting_calls | {layout}
        return super().step(observations, batch)

    def _check_call(self, module: torch.nn.Module, inputs: int, target: bool) -> None:
        """An OptionError unless ``module.forward`` binds ``inputs`` positional inputs (then the target)."""
        try:
            signature = inspect.signature(module.forward)
        except (TypeError, ValueError):  # no readable signature (a builtin forward): the call itself will tell
            return
        try:
            signature.bind(*range(inputs + target))
            return
        except TypeError as exc:
            why = str(exc)
        source = f"--collate {self.opts.collate}'s batches" if self.opts.collate else f"-t {self.opts.task}'s items"
        names = [f"x{i}" if inputs > 1 else "x" for i in range(inputs)] + ["target=None"] * target
        example = f" (e.g. def forward(self, {', '.join(names)}))" if inputs <= 4 else ""
        if target:
            parts = (f"the {inputs} input{'s' * (inputs != 1)} and the target of {source} ({inputs + 1} parts: "
                     "the inputs, then the target last)")
            what = (f"give forward one parameter per input, then the target{example}, or make the items hold "
                    "just the inputs the model reads and the target last")
        else:
            parts = f"the {inputs} input{'s' * (inputs != 1)} of {source} (no target: one part each)"
            what = (f"give forward one parameter per input{example}, or, to train on targets, make them each "
                    "item's last part")
        call = "forward(*inputs, target)" if target else "forward(*inputs)"
        raise OptionError(f"-m {self.opts.model}: {type(module).__name__}.forward{signature} cannot take {parts} "
                          f"({why}); accelbatch calls {call} with them: {what}")

    def build_model(self) -> torch.nn.Module:
        factory = load(self.opts.model, "-m", "model class or factory")
        if not callable(factory):
            raise OptionError(f"-m {self.opts.model}: a {type(factory).__name__}, not a model class or factory")
        try:
            module = factory()
        except TypeError as exc:
            raise OptionError(f"-m {self.opts.model}: calling it with no arguments failed ({exc}); give a class "
                              "or factory that takes none") from None
        if not isinstance(module, torch.nn.Module):
            raise OptionError(f"-m {self.opts.model}: made a {type(module).__name__}, not a torch.nn.Module")
        if is_training(self.opts.datatype) and not any(p.requires_grad for p in module.parameters()):
            raise OptionError(f"-m {self.opts.model}: the module has no parameter that requires grad: training "
                              "would change nothing; give it parameters (or score it as it is: accelbatch eval)")
        return ModuleAdapter(module)

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        try:
            items = [obs[ITEM] for obs in observations]
        except KeyError:  # a user's teacher (-t module:Class) serving text: known only now (others: check_pairing)
            text = next(str(obs.get("text", ""))[:40] for obs in observations if ITEM not in obs)
            raise OptionError(f"{_reads_items(self.opts.model)}; -t {self.opts.task} gives text messages (this one "
                              f"has no item: {text!r}): {_text_way_out(self.opts.task)}") from None
        if self.opts.collate:
            batch = _as_batch(self._user_collate(items, observations), f"--collate {self.opts.collate}")
            odd = next((t for t in batch.values() if t.dim() == 0 or t.shape[0] != len(items)), None)
            if odd is not None:  # rows scored against the wrong items, or a training batch of padding rows
                rows = odd.shape[0] if odd.dim() else 0
                raise OptionError(f"--collate {self.opts.collate} returned {rows} rows (a tensor of shape "
                                  f"{tuple(odd.shape)}) for the {len(items)} {_items(observations)} of -t "
                                  f"{self.opts.task}; return one row per item (dim 0 of every tensor)")
            return batch
        if any(len(item) != len(items[0]) for item in items):
            odd = next(o for o, item in zip(observations, items) if len(item) != len(items[0]))
            raise OptionError(f"-t {self.opts.task}: item {odd[INDEX]} has {len(odd[ITEM])} parts, item "
                              f"{observations[0][INDEX]} {len(items[0])}; every item needs the same parts")
        columns = []
        for part in range(len(items[0])):
            try:
                columns.append(default_collate([item[part] for item in items]))
            except RuntimeError as exc:
                shapes = {obs[INDEX]: tuple(obs[ITEM][part].shape) for obs in observations}
                first, odd = _first_mismatch(shapes)
                raise OptionError(f"-t {self.opts.task}: item {odd} cannot be batched with item {first}: part "
                                  f"{part} has shape {shapes[odd]} against {shapes[first]} ({str(exc).splitlines()[0]})"
                                  ) from None
        return _as_batch(columns, "default_collate")

    def _user_collate(self, items: list[tuple[torch.Tensor, ...]], observations: list[Message]) -> Any:
        """``--collate``'s function on the items (as the dataset gave them: one tensor, or a tuple)."""
        collate = _collate_function(self.opts.collate)
        try:
            return collate([item if len(item) > 1 else item[0] for item in items])
        except Exception as exc:
            indices = [obs[INDEX] for obs in observations]
            named = ", ".join(map(str, indices[:8])) + (f", ... ({len(indices)} in all)" if len(indices) > 8 else "")
            raise OptionError(f"-t {self.opts.task}: --collate {self.opts.collate} failed on the batch of items "
                              f"{named}: {_said(exc)}; fix the collate function") from None

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        """The arg max of each row's class scores (outputs of shape (rows, classes >= 2), float), for the rows
        whose item has a class target or none; no reply otherwise (a regression's outputs are no class)."""
        out = outputs.get("out")
        if (out is None or out.dim() != 2 or out.shape[1] < 2 or not out.is_floating_point()
                or out.shape[0] != len(observations)):
            return [{} for _ in observations]
        return [{"text": str(p)} if _replies_with_class(obs[ITEM]) else {}
                for p, obs in zip(out.argmax(dim=1).tolist(), observations)]


def check_pairing(opts: Any, model: Any, tasks: Sequence[str]) -> None:
    """An OptionError, before any step, for a model that cannot read its task: -m torch:... reads the items of
    -t torch:... tasks, which no other model reads (they have no text). A user's teacher (-t module:Class) may
    serve either: with -m torch:... it is checked at the first batch (:meth:`TorchModelAgent.batchify`)."""
    torch_tasks = [t for t in tasks if t.startswith(PREFIX)]
    if torch_tasks and not isinstance(model, TorchModelAgent):
        path = AGENT_PATHS.get(opts.model, opts.model)
        who = f"-m {opts.model}" if path.rpartition(":")[2] == type(model).__name__ else type(model).__name__
        raise OptionError(f"-t {torch_tasks[0]} gives items (tensors, no 'text'), which {who} cannot read: a torch "
                          "Dataset task is trained by your model, -m torch:pkg.mod:Model (an nn.Module whose "
                          "forward takes the items' tensors, see the README)")
    text_tasks = [t for t in tasks if not t.startswith(PREFIX) and t.partition(":")[0] in TASK_PATHS]
    if text_tasks and isinstance(model, TorchModelAgent):
        raise OptionError(f"{_reads_items(opts.model)}; -t {text_tasks[0]} gives text messages: "
                          f"{_text_way_out(text_tasks[0])}")


def _reads_items(model: str) -> str:
    """What -m torch:... reads, for the refusals of other tasks."""
    return f"-m {model} reads the items of a -t torch:pkg.mod:make_dataset task (your torch Dataset)"


def _text_way_out(task: str) -> str:
    """The ways on for a text task given to -m torch:...: a Dataset task, or a text model."""
    return (f"give -t your Dataset's factory (torch:pkg.mod:make_dataset), or give -t {task} a model that reads "
            "text (-m memnn, transformer/generator, or your own TorchAgent as -m module:Class)")


@functools.lru_cache(maxsize=None)
def _collate_function(path: str) -> Callable[[list[Any]], Any]:
    """``--collate``'s function, imported once per process (batchify runs once per step)."""
    collate = import_object(path, "collate function", [])
    if not callable(collate):
        raise OptionError(f"--collate {path}: a {type(collate).__name__}, not a function")
    return collate


def _as_batch(columns: Any, made_by: str) -> dict[str, torch.Tensor]:
    """The model's inputs and target from a collated batch: a tensor (inputs only) or a tuple or list of
    tensors, the target last when there are two or more. Anything else (a dict, a number, None) is refused
    naming ``made_by`` and the type it returned: a dict is not read as its keys."""
    if isinstance(columns, torch.Tensor):
        columns = [columns]
    must = "it must return a tensor or a tuple of tensors (the target last)"
    if not isinstance(columns, (tuple, list)):
        raise OptionError(f"{made_by} returned {_a(columns)}; {must}")
    if not columns or not all(isinstance(c, torch.Tensor) for c in columns):
        raise OptionError(f"{made_by} returned {_a(columns)} of {[type(c).__name__ for c in columns]}; {must}")
    *inputs, target = columns if len(columns) > 1 else (*columns, None)
    batch = {f"input{i:02d}": x for i, x in enumerate(inputs)}
    if target is not None:
        batch["target"] = target
    return batch


def input_keys(batch: dict[str, torch.Tensor]) -> list[str]:
    """The batch's input keys in the items' order: ``input2`` before ``input10`` (by number, not as text)."""
    return sorted((k for k in batch if k.startswith("input")), key=lambda k: int(k[len("input"):]))


def _items(observations: list[Message]) -> str:
    """The batch's item indices: ``items 4..7`` when consecutive, else the first few (training shuffles)."""
    indices = [obs[INDEX] for obs in observations]
    if indices == list(range(indices[0], indices[0] + len(indices))):
        return f"items {indices[0]}..{indices[-1]}"
    return f"items {', '.join(map(str, indices[:6]))}{', ...' if len(indices) > 6 else ''}"


def _first_mismatch(shapes: dict[int, tuple[int, ...]]) -> tuple[int, int]:
    (first, shape), *rest = shapes.items()
    return first, next((i for i, s in rest if s != shape), first)


__all__: Sequence[str] = ["TorchDatasetTeacher", "TorchModelAgent", "ModuleAdapter", "check_pairing", "items_of",
                           "label_of"]
