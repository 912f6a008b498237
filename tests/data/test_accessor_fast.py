"""AsyncDataAccessor's one-pass batch transport: C-pickled structure, tensors set aside for the ring; pickle_batch."""

from __future__ import annotations

import pickle
from collections import namedtuple

import pytest
import torch

from accelbatch.data.accessor import AsyncDataAccessor, pickle_batch
from accelbatch.data.loader import LoadedBatch
from accelbatch.messages import Message

from . import no_leaks  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")

Pair = namedtuple("Pair", "a b")


def loaded_batches(n=6, rows=5):
    out = []
    for i in range(n):
        messages = [Message({"text": f"hello {i} {r}", "labels": [f"l{r}"], "label_candidates": ["x", f"l{r}"],
                             "episode_done": True}) for r in range(rows)]
        text = torch.arange(rows * (i + 3)).view(rows, i + 3)
        tensors = {"text_vec": text, "label_index": torch.full((rows,), i), "mask": text > 2}
        out.append(LoadedBatch(tensors, messages, list(range(rows)), [i + 3] * rows, rows, i + 3))
    return out


def shared_tensor_batches(n=4):
    out = []
    for i in range(n):
        t = torch.full((3,), float(i))
        out.append(Pair(t, [t, {"again": t}]))
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_loaded_batches_travel_whole(no_leaks):
    expected = loaded_batches()
    with AsyncDataAccessor(expected, buffer_size=2) as accessor:
        for _ in range(2):
            got = 0
            for lb, ref in zip(accessor, expected):
                assert isinstance(lb, LoadedBatch) and lb.messages == ref.messages
                assert all(isinstance(m, Message) for m in lb.messages)
                assert (lb.ids, lb.lengths, lb.rows, lb.padded_len) == (ref.ids, ref.lengths, ref.rows, ref.padded_len)
                for key, t in ref.tensors.items():
                    assert lb.tensors[key].is_shared() and lb.tensors[key].dtype == t.dtype
                    assert torch.equal(lb.tensors[key], t)
                got += 1
            assert got == len(expected)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_tensor_met_twice_is_one_view(no_leaks):
    with AsyncDataAccessor(shared_tensor_batches()) as accessor:
        for i, batch in enumerate(accessor):
            assert isinstance(batch, Pair)
            assert batch.a is batch.b[0] and batch.a is batch.b[1]["again"]
            assert batch.a.tolist() == [float(i)] * 3


@pytest.mark.parametrize("tensor", [
    torch.arange(12).view(3, 4).t(),                       # not contiguous
    torch.tensor(3.5),                                     # 0-d
    torch.zeros(0, 4),                                     # empty
    torch.ones(2, 3, dtype=torch.bfloat16),
    torch.tensor([True, False, True]),
    torch.randn(4, requires_grad=True),
])
def test_pickle_batch_round_trip(tensor):
    batch = {"t": tensor, "msgs": [Message({"text": "hi"})], "n": 3}
    back = pickle.loads(pickle_batch(batch))
    assert back["n"] == 3 and back["msgs"] == batch["msgs"] and isinstance(back["msgs"][0], Message)
    t = back["t"]
    assert t.dtype == tensor.dtype and t.shape == tensor.shape and not t.requires_grad
    assert torch.equal(t, tensor.detach())
    if t.dtype != torch.bool:
        t.add_(1)                                          # writable: its own buffer, no warning


def test_pickle_batch_of_a_loaded_batch():
    lb = loaded_batches(1, rows=32)[0]
    back = pickle.loads(pickle_batch(lb))
    assert back.messages == lb.messages
    assert all(torch.equal(back.tensors[k], v) for k, v in lb.tensors.items())
