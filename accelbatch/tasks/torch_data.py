"""A user's own torch Dataset and nn.Module, PopTorch-style: ``-t torch:pkg.mod:make_dataset`` and
``-m torch:pkg.mod:MyModel``.

The dataset factory is called with the split (``"train"``, ``"valid"`` or ``"test"``) and returns a map-style
or iterable ``torch.utils.data.Dataset``; each item is a tensor or a tuple of tensors whose last element is the
target when there are two or more (PopTorch's tutorials' ``(x, y)``). The model class (or factory) is called
with no arguments; its ``forward(*inputs, target)`` returns ``(outputs, loss)`` and ``forward(*inputs)``
returns ``outputs``, as PopTorch's trainingModel/inferenceModel expect.

Each item is one example (an episode of one turn) served by a :class:`~accelbatch.teachers.FixedTeacher`, so
the plan (D, R, G, output modes), the loaders, exactly-once evaluation, exact resume and the report work as
for any task. Items are read once when the split is set up and held in memory. A target that is a single
integer is also the example's label (its decimal text); when the model's outputs are one row of class scores
per item, the reply is the arg max, so the report has accuracy beside the loss.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from accelbatch.agents import TorchAgent, import_object
from accelbatch.messages import Message
from accelbatch.opts import OptionError
from accelbatch.teachers import FixedTeacher, split_of

PREFIX = "torch:"
ITEM, INDEX = "item", "item_index"
NO_LABEL = "-"  # the label of an item whose target is not one integer: nothing to score


def load(path: str, flag: str, what: str) -> Any:
    """The object at ``pkg.module:Name`` (after ``torch:``), or an OptionError naming ``flag``."""
    if not path.startswith(PREFIX) or path.count(":") != 2:
        raise OptionError(f"{flag} {path!r}: expected torch:pkg.module:Name (the {what})")
    return import_object(path[len(PREFIX):], what, [])


def items_of(dataset: Any, task: str) -> list[tuple[torch.Tensor, ...]]:
    """Every item of a map-style (``len`` and ``[i]``) or iterable dataset, each as a tuple of tensors."""
    if isinstance(dataset, IterableDataset) or not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raw = iter(dataset)
    else:
        raw = (dataset[i] for i in range(len(dataset)))
    items = []
    for index, item in enumerate(raw):
        parts = tuple(item) if isinstance(item, (tuple, list)) else (item,)
        for p in parts:
            if not isinstance(p, (torch.Tensor, int, float)):
                raise OptionError(f"-t {task}: item {index} holds a {type(p).__name__}; items must be tensors (or "
                                  "tuples of tensors, the target last)")
        items.append(tuple(torch.as_tensor(p) for p in parts))
    return items


def label_of(item: tuple[torch.Tensor, ...]) -> str:
    target = item[-1] if len(item) > 1 else None
    if target is not None and target.numel() == 1 and not target.is_floating_point():
        return str(int(target))
    return NO_LABEL


class TorchDatasetTeacher(FixedTeacher):
    """``-t torch:pkg.mod:make_dataset``: one example per item of the factory's dataset for the split."""

    def setup_data(self) -> list[list[Message]]:
        factory = load(self.opts.task, "-t", "dataset factory")
        split = split_of(self.opts.datatype)
        items = items_of(factory(split), self.opts.task)
        return [[Message(text=f"{split} item {i}", labels=[label_of(item)], episode_done=True,
                         **{ITEM: item, INDEX: i})] for i, item in enumerate(items)]


class ModuleAdapter(torch.nn.Module):
    """dict in, dict out around a PopTorch-style module: ``{"input00", ..., "target"}`` ->
    ``{"out", "loss"}`` (the loss when the batch has targets)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        self.module = module

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        inputs = [batch[k] for k in sorted(batch) if k.startswith("input")]
        if "target" not in batch:
            return {"out": self.module(*inputs)}
        result = self.module(*inputs, batch["target"])
        if not (isinstance(result, (tuple, list)) and len(result) == 2):
            raise OptionError(f"-m {type(self.module).__name__}: forward(*inputs, target) must return "
                              f"(outputs, loss), got {type(result).__name__}")
        outputs, loss = result
        return {"out": outputs, "loss": loss}


class TorchModelAgent(TorchAgent):
    """``-m torch:pkg.mod:MyModel``: the user's module, batches collated with torch's default_collate."""

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
        return ModuleAdapter(module)

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        items = [obs[ITEM] for obs in observations]
        if self.opts.collate:
            return _as_batch(self._user_collate(items, observations), self.opts.collate)
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
            first, last = observations[0][INDEX], observations[-1][INDEX]
            raise OptionError(f"-t {self.opts.task}: --collate {self.opts.collate} failed on the batch of items "
                              f"{first}..{last} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
                              ) from None

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        out = outputs.get("out")
        if out is None or out.dim() != 2 or not out.is_floating_point() or out.shape[0] != len(observations):
            return [{} for _ in observations]
        return [{"text": str(p)} for p in out.argmax(dim=1).tolist()]


@functools.lru_cache(maxsize=None)
def _collate_function(path: str) -> Callable[[list[Any]], Any]:
    """``--collate``'s function, imported once per process (batchify runs once per step)."""
    collate = import_object(path, "collate function", [])
    if not callable(collate):
        raise OptionError(f"--collate {path}: a {type(collate).__name__}, not a function")
    return collate


def _as_batch(columns: Any, made_by: str) -> dict[str, torch.Tensor]:
    """The model's inputs and target from a collated batch: a tensor (inputs only) or a sequence of tensors,
    the target last when there are two or more."""
    columns = [columns] if isinstance(columns, torch.Tensor) else list(columns)
    if not columns or not all(isinstance(c, torch.Tensor) for c in columns):
        raise OptionError(f"{made_by} must return a tensor or a tuple of tensors (the target last), got "
                          f"{[type(c).__name__ for c in columns]}")
    *inputs, target = columns if len(columns) > 1 else (*columns, None)
    batch = {f"input{i:02d}": x for i, x in enumerate(inputs)}
    if target is not None:
        batch["target"] = target
    return batch


def _first_mismatch(shapes: dict[int, tuple[int, ...]]) -> tuple[int, int]:
    (first, shape), *rest = shapes.items()
    return first, next((i for i, s in rest if s != shape), first)


__all__: Sequence[str] = ["TorchDatasetTeacher", "TorchModelAgent", "ModuleAdapter", "items_of", "label_of"]
