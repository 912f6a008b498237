"""A user's torch Dataset and model, as in PopTorch's tutorials (used by tests/test_torch_task.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset, TensorDataset

SIZES = {"train": 37, "valid": 23, "test": 11}


def tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(list(SIZES).index(split))
    x = torch.randn(SIZES[split], 4, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 0).long()  # 3 classes a linear model can learn


def make_dataset(split: str) -> TensorDataset:
    return TensorDataset(*tensors(split))


class Stream(IterableDataset):
    def __init__(self, split: str):
        self.x, self.y = tensors(split)

    def __iter__(self):
        return iter(zip(self.x, self.y))


def make_stream(split: str) -> Stream:
    return Stream(split)


def make_ragged(split: str) -> list:
    x, y = tensors(split)
    items = list(zip(x, y))
    items[5] = (torch.zeros(6), y[5])
    return items


class Classifier(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def forward(self, x, target=None):
        out = self.lin(x)
        if target is None:
            return out
        return out, F.cross_entropy(out, target)


class NotAModule:
    """Callable without arguments, but not a torch.nn.Module."""


def make_ragged_sequences(split: str) -> list:
    """Items of different lengths (the first 1 to 4 features of x): a user's collate pads them."""
    x, y = tensors(split)
    return [(x[i, : 1 + i % 4], y[i]) for i in range(len(y))]


def pad_collate(items: list) -> tuple:
    """Zero-pads each item's input to the 4 features the model takes, then stacks; the targets stacked."""
    xs, ys = zip(*items)
    return torch.stack([F.pad(x, (0, 4 - len(x))) for x in xs]), torch.stack(ys)


def broken_collate(items: list) -> tuple:
    raise ValueError("cannot batch these")
