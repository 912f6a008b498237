"""rebatch(): structures, and PopTorch's iterable-dataset vectors through torch's DataLoader workers."""

from __future__ import annotations

import math
from collections import namedtuple

import pytest
import torch

from accelbatch.data.accessor import AsyncDataAccessor
from accelbatch.data.rebatch import RebatchError, Rows, flatten, rebatch, unflatten

from . import no_leaks  # noqa: F401  (pytest fixture)

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


class Increment(torch.utils.data.IterableDataset):
    """Yields tensors [2, 3] filled with start .. start+length-1 (PopTorch's IncrementIterableDataset)."""

    def __init__(self, length):
        self.start, self.length = 0, length

    def __len__(self):
        return self.length

    def __iter__(self):
        for i in range(self.start, self.start + self.length):
            yield torch.full((2, 3), float(i))


def split_ceil(worker_id):
    """PopTorch's worker_init_fn: ceil(n / workers) items per worker, the last one gets the rest."""
    info = torch.utils.data.get_worker_info()
    ds, total = info.dataset, info.dataset.length
    per = math.ceil(total / info.num_workers)
    ds.start = per * worker_id
    ds.length = total - per * (info.num_workers - 1) if worker_id == info.num_workers - 1 else per


def loader(batch_size, drop_last):
    return torch.utils.data.DataLoader(Increment(101), batch_size=batch_size, num_workers=7, drop_last=drop_last,
                                       worker_init_fn=split_ceil)


def values(batches):
    out = []
    for b in batches:
        out += [int(row[0][0]) for row in b]
    return out


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_poptorch_vectors_without_and_with_rebatching(no_leaks):
    plain = list(loader(4, drop_last=True))
    assert all(b.shape == (4, 2, 3) for b in plain)
    assert len(set(values(plain))) == len(values(plain)) == 80          # 6 * 3 * 4 + 2 * 4

    combined = list(rebatch(loader(1, drop_last=False), 4))
    assert all(b.shape == (4, 2, 3) for b in combined)
    assert len(set(values(combined))) == len(values(combined)) == 100   # floor(101 / 4) * 4

    small = list(rebatch(loader(3, drop_last=False), 4))                 # workers emit batches of 3 (or less)
    assert len(set(values(small))) == 100

    leftover = list(rebatch(loader(1, drop_last=False), 6, drop_last=False))
    assert [b.shape[0] for b in leftover] == [6] * 16 + [5]
    assert sorted(values(leftover)) == list(range(101))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_poptorch_vector_through_the_async_accessor(no_leaks):
    with AsyncDataAccessor(loader(1, drop_last=False), rebatch_size=4) as accessor:
        for _ in range(2):  # and again: every epoch
            seen = []
            for b in accessor:
                assert b.shape == (4, 2, 3)
                seen += [int(row[0][0]) for row in b]
            assert len(set(seen)) == len(seen) == 100


def test_structures_are_concatenated_then_cut():
    Pair = namedtuple("Pair", "x y")

    def batch(start, n):
        idx = torch.arange(start, start + n)
        return {"pair": Pair(idx, idx * 10), "rows": Rows(f"m{i}" for i in range(start, start + n)),
                "list": [idx.float()]}

    out = list(rebatch([batch(0, 3), batch(3, 2), batch(5, 5), batch(10, 1)], 4))
    assert len(out) == 2
    assert out[0]["pair"].x.tolist() == [0, 1, 2, 3] and out[1]["pair"].y.tolist() == [40, 50, 60, 70]
    assert isinstance(out[0]["pair"], Pair) and isinstance(out[0]["rows"], Rows)
    assert out[1]["rows"] == ["m4", "m5", "m6", "m7"] and out[1]["list"][0].tolist() == [4, 5, 6, 7]
    tail = list(rebatch([batch(0, 3), batch(3, 2), batch(5, 5), batch(10, 1)], 4, drop_last=False))
    assert [len(b["rows"]) for b in tail] == [4, 4, 3]


def test_full_batches_pass_through_untouched():
    batches = [torch.zeros(4, 2), torch.ones(4, 2)]
    assert all(a is b for a, b in zip(rebatch(batches, 4), batches))


def test_tuples_of_tensors_and_plain_tensors():
    out = list(rebatch(((torch.arange(i, i + 2), torch.arange(i, i + 2) * 2) for i in range(0, 10, 2)), 5))
    assert [o[0].tolist() for o in out] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert isinstance(out[0], tuple)


@pytest.mark.parametrize("batches, message", [
    ([torch.zeros(2), {"a": torch.zeros(2)}], "different structure"),
    ([(torch.zeros(2), torch.zeros(3))], "2 and 3 rows"),
    ([torch.tensor(1.0)], "0-d tensor"),
    ([(torch.zeros(2), ["a", "b"])], "only tensors with a batch dimension and Rows"),
    ([torch.zeros(2, 3), torch.zeros(2, 4)], "per-row shapes differ"),
])
def test_clear_errors(batches, message):
    with pytest.raises(RebatchError, match=message):
        list(rebatch(batches, 3))
    with pytest.raises(ValueError, match="batch_size"):
        list(rebatch([], 0))


def test_flatten_round_trip():
    obj = {"a": (torch.zeros(1), [1, "s"]), "b": Rows([1, 2])}
    leaves, spec = flatten(obj)
    assert len(leaves) == 4
    back = unflatten(spec, leaves)
    assert back["a"][1] == [1, "s"] and back["b"] == Rows([1, 2])
