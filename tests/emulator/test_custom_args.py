"""registerCustomArgParser: a user type carrying a batch's tensors through the DataLoader and a model."""

from __future__ import annotations

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch


class Pair:
    def __init__(self, data, label):
        self.data = data
        self.label = label


class PairParser(poptorch.ICustomArgParser):
    def yieldTensors(self, struct):
        yield struct.data
        yield struct.label

    def reconstruct(self, original_structure, tensor_iterator):
        return type(original_structure)(next(tensor_iterator), next(tensor_iterator))


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 12

    def __getitem__(self, i):
        return Pair(torch.full((2,), float(i)), torch.tensor(i))


def _collate(items):
    return Pair(torch.stack([p.data for p in items]), torch.stack([p.label for p in items]))


@pytest.fixture
def pair_parser():
    poptorch.registerCustomArgParser(Pair, PairParser())
    yield
    poptorch.registerCustomArgParser(Pair, None)


def test_loader_joins_custom_batches_over_device_iterations(pair_parser):
    opts = poptorch.Options().deviceIterations(3)
    loader = poptorch.DataLoader(opts, Rows(), batch_size=2, collate_fn=_collate)
    batches = list(loader)
    assert len(batches) == 2  # 12 rows / (2 * 3)
    assert isinstance(batches[0], Pair)
    assert batches[0].label.tolist() == [0, 1, 2, 3, 4, 5]
    assert batches[1].data[:, 0].tolist() == [6.0, 7.0, 8.0, 9.0, 10.0, 11.0]


def test_model_takes_and_returns_custom_type(pair_parser):
    class Swap(torch.nn.Module):
        def forward(self, pair):
            return Pair(pair.data * 2, pair.label + 1)

    model = poptorch.inferenceModel(Swap(), poptorch.Options().deviceIterations(2))
    out = model(Pair(torch.arange(8.0).reshape(4, 2), torch.arange(4)))
    assert isinstance(out, Pair)
    assert out.data.tolist() == [[0.0, 2.0], [4.0, 6.0], [8.0, 10.0], [12.0, 14.0]]
    assert out.label.tolist() == [1, 2, 3, 4]


def test_parser_must_implement_the_interface():
    with pytest.raises(poptorch.Error, match="arg_parser must inherit from ICustomArgParser"):
        poptorch.registerCustomArgParser(Pair, object())


@pytest.mark.slow
@pytest.mark.multiprocess  # the loading process
@pytest.mark.timeout(120)
def test_async_rebatched_loader_reforms_custom_batches(pair_parser):
    # 12 rows loaded in batches of 4 (rebatched_worker_size), re-formed into the combined 2 x 3 = 6 rows
    opts = poptorch.Options().deviceIterations(2)
    loader = poptorch.DataLoader(opts, Rows(), batch_size=3, collate_fn=_collate, drop_last=False,
                                 mode=poptorch.DataLoaderMode.AsyncRebatched, rebatched_worker_size=4)
    labels = []
    for batch in loader:
        assert isinstance(batch, Pair)
        assert batch.data[:, 1].tolist() == batch.label.float().tolist()
        labels.append(batch.label.tolist())
    assert labels == [[0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]]
