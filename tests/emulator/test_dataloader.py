"""poptorch.DataLoader in Sync mode: combined batches, lengths, order, tails, workers, distribution.

Vectors from PopTorch's tests/dataloader_test.py; expected values are computed here from the dataset.
"""

from __future__ import annotations

import gc
import math
import multiprocessing

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch

pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")


class IncrementDataset(torch.utils.data.Dataset):
    def __init__(self, shape, length):
        self._shape, self._length = shape, length

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        if index >= self._length:
            raise IndexError(index)
        return torch.full(self._shape, index, dtype=torch.float32)


class IncrementIterableDataset(torch.utils.data.IterableDataset):
    def __init__(self, shape, length, start=0):
        self._shape, self.length, self.start = shape, length, start

    def __iter__(self):
        for index in range(self.length):
            yield torch.full(self._shape, self.start + index, dtype=torch.float32)


class IncrementIterableDatasetWithLen(IncrementIterableDataset):
    def __len__(self):
        return self.length


def split_between_workers(worker_id):
    """PopTorch's test worker_init_fn: contiguous ceil(n / workers) slices, the last one shorter."""
    info = torch.utils.data.get_worker_info()
    ds = info.dataset
    per_worker = math.ceil(ds.length / info.num_workers)
    ds.start = per_worker * worker_id
    if worker_id == info.num_workers - 1:
        ds.length = ds.length - per_worker * (info.num_workers - 1)
    else:
        ds.length = per_worker


class CheckOrder(torch.nn.Module):
    def forward(self, data, expected):
        return torch.sum(data - expected)


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = set(multiprocessing.active_children())
    yield
    gc.collect()
    leaked = set(multiprocessing.active_children()) - before
    assert not leaked, f"data workers left running: {leaked}"


@pytest.mark.parametrize("b,D,R,workers", [(1, 1, 1, 0), (4, 1, 1, 0), (1, 4, 1, 0), (1, 1, 4, 0),
                                           (2, 5, 2, 0), (2, 5, 2, 4)])
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_lengths_and_order(b, D, R, workers):
    shape, n = [2, 3], 100
    opts = poptorch.Options().deviceIterations(D).replicationFactor(R)
    loader = poptorch.DataLoader(opts, IncrementDataset(shape, n), batch_size=b, num_workers=workers)
    assert loader.combinedBatchSize == b * D * R
    assert len(loader) == n // (b * D * R)
    model = poptorch.inferenceModel(CheckOrder(), opts)
    seen = []
    for it, batch in enumerate(loader):
        expected = torch.stack([torch.full(shape, float(i)) for i in range(it * b * D * R, (it + 1) * b * D * R)])
        assert torch.equal(batch, expected)
        assert float(torch.sum(model(batch, expected))) == 0.0
        seen += batch[:, 0, 0].int().tolist()
    assert seen == list(range(len(loader) * b * D * R))


def test_gradient_accumulation_is_part_of_the_combined_batch():
    opts = poptorch.Options().deviceIterations(2).replicationFactor(3)
    opts.Training.gradientAccumulation(4)
    loader = poptorch.DataLoader(opts, IncrementDataset([1], 100), batch_size=2)
    assert loader.combinedBatchSize == 48 and len(loader) == 2
    opts = poptorch.Options().replicationFactor(4).inputReplicaGrouping(2, poptorch.CommGroupType.Consecutive)
    assert poptorch.DataLoader(opts, IncrementDataset([1], 100), batch_size=3).combinedBatchSize == 6


def test_map_style_drop_last_false_keeps_the_tail():
    loader = poptorch.DataLoader(poptorch.Options(), IncrementDataset([2, 3], 101), batch_size=6,
                                 drop_last=False)
    assert len(loader) == math.ceil(101 / 6)
    sizes = [batch.shape[0] for batch in loader]
    assert sizes == [6] * 16 + [5]
    assert len(poptorch.DataLoader(poptorch.Options(), IncrementDataset([2, 3], 101), batch_size=6)) == 16


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_iterable_dataset_loses_each_workers_tail():
    # 101 items over 7 workers: slices of 15 (and 11); batches of 4 drop 3 per worker -> 20 batches, 80 items
    n, workers, b = 101, 7, 4
    loader = poptorch.DataLoader(poptorch.Options(), IncrementIterableDatasetWithLen([2, 3], n), batch_size=b,
                                 num_workers=workers, worker_init_fn=split_between_workers)
    assert len(loader) == n // b  # torch's theoretical length
    per_worker = math.ceil(n / workers)
    last = n - per_worker * (workers - 1)
    expected_items = b * ((workers - 1) * (per_worker // b) + last // b)
    assert expected_items == 80
    for _ in range(2):  # persistent workers: the same every epoch
        values = [int(v) for batch in loader for v in batch[:, 0, 0]]
        assert all(batch_shape == (b, 2, 3) for batch_shape in [tuple(t.shape) for t in loader])
        assert len(values) == len(set(values)) == expected_items


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_iterable_dataset_drop_last_false_tails_per_worker():
    n, workers, b = 101, 7, 6
    loader = poptorch.DataLoader(poptorch.Options(), IncrementIterableDatasetWithLen([1], n), batch_size=b,
                                 num_workers=workers, worker_init_fn=split_between_workers, drop_last=False,
                                 persistent_workers=False)
    sizes = sorted(batch.shape[0] for batch in loader)
    # 6 workers of 15 items -> 2 full + a tail of 3; the last worker's 11 -> 1 full + a tail of 5
    assert sizes == sorted([3] * 6 + [5] + [6] * 13)


def test_iterable_dataset_rejects_auto_distributed_partitioning():
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(AssertionError, match="auto_distributed_partitioning not supported for IterableDataset"):
        poptorch.DataLoader(opts, IncrementIterableDataset([1], 10))
    poptorch.DataLoader(opts.clone(), IncrementIterableDataset([1], 10), auto_distributed_partitioning=False)


@pytest.mark.parametrize("b,hosts,workers", [(4, 3, 0), (2, 2, 3)])
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_distributed_processes_read_disjoint_blocks(b, hosts, workers):
    n = 100
    next_expected = 0
    for host in range(hosts):
        opts = poptorch.Options()
        opts.Distributed.configureProcessId(host, hosts)
        loader = poptorch.DataLoader(opts, IncrementDataset([2, 3], n), batch_size=b, num_workers=workers)
        assert len(loader) == n // (b * hosts)
        for batch in loader:
            for row in batch:
                assert int(row[0][0]) == next_expected
                next_expected += 1
    assert next_expected == hosts * b * (n // (b * hosts))


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_distributed_shuffle_uses_every_item_over_two_epochs():
    n, b, hosts = 100, 4, 3
    used = set()
    for host in range(hosts):
        opts = poptorch.Options().randomSeed(42)
        opts.Distributed.configureProcessId(host, hosts)
        loader = poptorch.DataLoader(opts, IncrementDataset([1], n), batch_size=b, shuffle=True)
        first = [int(v) for batch in loader for v in batch.flatten()]
        assert len(first) == len(set(first)) == b * (n // (b * hosts))
        used |= set(first)
        used |= {int(v) for batch in loader for v in batch.flatten()}
    assert used == set(range(n))
    opts = poptorch.Options()
    opts.Distributed.configureProcessId(0, 2)
    with pytest.raises(AssertionError, match="you must set poptorch.Options.randomSeed"):
        poptorch.DataLoader(opts, IncrementDataset([1], n), shuffle=True)


@pytest.mark.parametrize("b,D,drop_last", [(2, 1, True), (3, 4, True), (3, 4, False), (2, 5, False)])
def test_batch_sampler_batches_are_combined(b, D, drop_last):
    n = 100
    dataset = IncrementDataset([2], n)
    sampler = torch.utils.data.BatchSampler(torch.utils.data.SequentialSampler(dataset), batch_size=b,
                                            drop_last=drop_last)
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(D), dataset, batch_sampler=sampler,
                                 drop_last=drop_last)
    batches = list(loader)
    # independent expectation: cut the sampled index stream into groups of D sampler batches
    micro = [list(range(i, min(i + b, n))) for i in range(0, n, b)]
    if drop_last:
        micro = [m for m in micro if len(m) == b]
    groups = [sum(micro[i:i + D], []) for i in range(0, len(micro), D)]
    if drop_last:
        groups = [g for g in groups if len(g) == b * D]
    assert [batch[:, 0].int().tolist() for batch in batches] == groups
    with pytest.raises(poptorch.Error, match="`batch_sampler` option is mutually exclusive with batch_size"):
        poptorch.DataLoader(poptorch.Options(), dataset, batch_size=2, batch_sampler=sampler)


def test_rebatched_worker_size_must_fit():
    with pytest.raises(AssertionError, match=r"The rebatched_worker_size \(5\) must be <= to the combined "
                                             r"batch size \(4\)"):
        poptorch.DataLoader(poptorch.Options(), IncrementDataset([1], 10), batch_size=4,
                            mode=poptorch.DataLoaderMode.AsyncRebatched, rebatched_worker_size=5)
