"""A user's torch Dataset and model, as in PopTorch's tutorials (used by tests/test_torch_task.py)."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F
from torch.utils.data import Dataset, IterableDataset, TensorDataset

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


# --- datasets a user gets wrong, and ones without a class target (tests of the errors and of the report) --


def make_train_only(split: str) -> TensorDataset | None:
    """A user who has no valid or test data: None for those splits."""
    return make_dataset(split) if split == "train" else None


def make_empty(split: str) -> TensorDataset:
    """A Dataset of no items for every split."""
    return TensorDataset(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))


def make_failing(split: str) -> TensorDataset:
    """A factory whose valid and test files are missing."""
    if split != "train":
        raise FileNotFoundError(f"data/{split}.pt: no such file")
    return make_dataset(split)


FAULTY_ITEM = 7  # the item Faulty's __getitem__ cannot read


class Faulty(Dataset):
    """Map-style, reads every item but FAULTY_ITEM, whose __getitem__ raises the user's own KeyError."""

    def __init__(self, split: str):
        self.data = make_dataset(split)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int):
        if i == FAULTY_ITEM:
            raise KeyError(f"row {i} missing from the index")
        return self.data[i]


class Overcounted(Faulty):
    """__len__ counts 3 items more than there are: the first one past the end raises IndexError."""

    def __len__(self) -> int:
        return len(self.data) + 3

    def __getitem__(self, i: int):
        return self.data[i]


def make_faulty(split: str) -> Faulty:
    return Faulty(split)


def make_overcounted(split: str) -> Overcounted:
    return Overcounted(split)


class Endless(IterableDataset):
    """An iterable that never ends (a stream with no stop). ``safety``: a test's net, raising after that many
    items so that a reader with no bound fails instead of filling the memory (None: truly endless)."""

    safety: int | None = None

    def __init__(self, split: str):
        self.x, self.y = tensors(split)

    def __iter__(self):
        for n in itertools.count():
            if self.safety is not None and n == self.safety:
                raise RuntimeError(f"Endless: read {n} items; the reader has no bound")
            yield self.x[n % len(self.x)], self.y[n % len(self.y)]


def make_endless(split: str) -> Endless:
    return Endless(split)


def regression_tensors(split: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The inputs of ``tensors`` and a float target (a linear function of them), one column."""
    x, _ = tensors(split)
    return x, x @ torch.tensor([[1.0], [-2.0], [0.5], [0.0]]) + 0.25


def make_regression(split: str) -> TensorDataset:
    return TensorDataset(*regression_tensors(split))


def make_inputs_only(split: str) -> TensorDataset:
    """Items without a target: one tensor each."""
    return TensorDataset(tensors(split)[0])


class Regressor(torch.nn.Module):
    """One output per item and a mean squared error: no class scores."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 1)

    def forward(self, x, target=None):
        out = self.lin(x)
        if target is None:
            return out
        return out, F.mse_loss(out, target)


class AutoEncoder(torch.nn.Module):
    """Trained without targets, as PopTorch's trainingModel takes it: forward(x) -> (outputs, loss)."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, x):
        out = self.linear(x)
        return out, F.mse_loss(out, x)


# --- models and a collate that break the contract (tests/test_torch_task_errors.py) ---------------------


class TupleOutputs(Classifier):
    """forward returns ((logits, x), loss), and (logits, x) without a target: outputs that are not one tensor."""

    def forward(self, x, target=None):
        out = self.lin(x)
        return (out, x) if target is None else ((out, x), F.cross_entropy(out, target))


class DictOutputs(Classifier):
    """forward returns ({"logits": out}, loss): a dict of outputs."""

    def forward(self, x, target=None):
        out = self.lin(x)
        return {"logits": out} if target is None else ({"logits": out}, F.cross_entropy(out, target))


class FloatLoss(Classifier):
    """forward returns (outputs, loss.item()): a Python float, through which no gradient flows."""

    def forward(self, x, target=None):
        out = self.lin(x)
        return out if target is None else (out, F.cross_entropy(out, target).item())


class NanInEval(Classifier):
    """Trains as Classifier; its loss in evaluation is NaN (a model whose validation scores no number)."""

    def forward(self, x, target=None):
        out = self.lin(x)
        if target is None:
            return out
        loss = F.cross_entropy(out, target)
        return out, loss if self.training else loss * float("nan")


def short_collate(items: list) -> tuple:
    """Stacks all items but the last: one row fewer than the items."""
    xs, ys = zip(*items[:-1])
    return torch.stack(xs), torch.stack(ys)


def make_mixed_dtypes(split: str) -> list:
    """Class targets, but item 3's is a float: default_collate would batch them all as floats."""
    x, y = tensors(split)
    items = list(zip(x, y))
    items[3] = (x[3], torch.tensor(1.0))
    return items


class NoParameters(torch.nn.Module):
    """Fixed scores: nothing to train."""

    def forward(self, x, target=None):
        out = x[:, :3] * 2.0
        return out if target is None else (out, F.cross_entropy(out, target))


def make_ragged_valid(split: str) -> list:
    """Valid's last item has 6 features: alone in the last batch at -bs 11, default_collate never meets it."""
    x, y = tensors(split)
    items = list(zip(x, y))
    if split == "valid":
        items[-1] = (torch.zeros(6), y[-1])
    return items


def make_extra_part(split: str) -> list:
    """Item 6 has a third part of the same dtype as the target: (x, y, y)."""
    x, y = tensors(split)
    return [(x[i], y[i]) if i != 6 else (x[i], y[i], y[i]) for i in range(len(y))]


class StopsReading(Faulty):
    """__getitem__ of FAULTY_ITEM raises StopIteration (a reader that ran out of records)."""

    def __getitem__(self, i: int):
        if i == FAULTY_ITEM:
            raise StopIteration(f"record {i} truncated")
        return self.data[i]


def make_stops_reading(split: str) -> StopsReading:
    return StopsReading(split)


class PooledClassifier(torch.nn.Module):
    """Reads inputs of any length through their mean and max: items of several lengths, one a batch."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(2, 3)

    def forward(self, x, target=None):
        out = self.lin(torch.stack([x.mean(1), x.amax(1)], 1))
        return out if target is None else (out, F.cross_entropy(out, target))
