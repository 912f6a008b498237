"""poptorch.DataLoader in Async / AsyncRebatched modes and AsynchronousDataAccessor.

Vectors from PopTorch's tests/dataloader_test.py; every test checks that no loading process is left behind.
"""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from accelbatch.backends import poptorch_emulator as poptorch

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(90),
              pytest.mark.filterwarnings("ignore:This DataLoader will create:UserWarning")]

Async, AsyncRebatched, Sync = (poptorch.DataLoaderMode.Async, poptorch.DataLoaderMode.AsyncRebatched,
                               poptorch.DataLoaderMode.Sync)


class IncrementDataset(torch.utils.data.Dataset):
    def __init__(self, shape, length):
        self._shape, self._length = shape, length

    def __len__(self):
        return self._length

    def __getitem__(self, index):
        if index >= self._length:
            raise IndexError(index)
        return torch.full(self._shape, index, dtype=torch.float32)


class IncrementWithLabels(IncrementDataset):
    def __getitem__(self, index):
        return torch.full(self._shape, index, dtype=torch.float32), torch.full((1,), index, dtype=torch.long)


class IncrementDict(IncrementDataset):
    def __getitem__(self, index):
        return {"data": torch.full(self._shape, index, dtype=torch.float32),
                "label": torch.full((1,), index, dtype=torch.long)}


class IncrementIterable(torch.utils.data.IterableDataset):
    def __init__(self, shape, length, start=0):
        self._shape, self.length, self.start = shape, length, start

    def __iter__(self):
        for index in range(self.length):
            yield torch.full(self._shape, self.start + index, dtype=torch.float32)


class IncrementIterableWithLen(IncrementIterable):
    def __len__(self):
        return self.length


class BrokenDataset(IncrementDataset):
    def __getitem__(self, index):
        raise AssertionError("Broken dataset")


class BreaksAt(IncrementDataset):
    def __getitem__(self, index):
        if index == 7:
            raise ValueError("item 7 is corrupt")
        return super().__getitem__(index)


def split_between_workers(worker_id):
    info = torch.utils.data.get_worker_info()
    ds = info.dataset
    per_worker = math.ceil(ds.length / info.num_workers)
    ds.start = per_worker * worker_id
    ds.length = ds.length - per_worker * (info.num_workers - 1) if worker_id == info.num_workers - 1 \
        else per_worker


class DoubleData(torch.nn.Module):
    def forward(self, data):
        return data * 2


@pytest.fixture(autouse=True)
def no_leaked_processes():
    before = set(multiprocessing.active_children())
    yield
    gc.collect()
    leaked = set(multiprocessing.active_children()) - before
    assert not leaked, f"processes left running: {leaked}"


def values(batches):
    return [int(v) for b in batches for v in b.reshape(b.shape[0], -1)[:, 0]]


@pytest.mark.parametrize("b,D,workers", [(2, 1, 0), (2, 10, 0), (1, 1, 2)])
def test_async_map_style_order_over_epochs(b, D, workers):
    shape, n = [2, 3], 100
    opts = poptorch.Options().deviceIterations(D)
    loader = poptorch.DataLoader(opts, IncrementDataset(shape, n), batch_size=b, num_workers=workers,
                                 mode=Async)
    assert len(loader) == n // (b * D)
    model = poptorch.inferenceModel(DoubleData(), opts)
    cb = loader.combinedBatchSize
    for _ in range(2):
        count = 0
        for it, batch in enumerate(loader):
            expected = torch.stack([torch.full(shape, 2.0 * i) for i in range(cb * it, cb * (it + 1))])
            assert torch.equal(model(batch), expected)
            count += 1
        assert count == len(loader)
    loader.terminate()


def test_async_tuples_with_labels():
    opts = poptorch.Options().deviceIterations(10)
    loader = poptorch.DataLoader(opts, IncrementWithLabels([2, 3], 60), batch_size=2, mode=Async)
    total, label_total = 0.0, 0
    for data, label in loader:
        assert label.dtype == torch.long and label.shape == (20, 1)
        total += float(data[:, 0, 0].sum())
        label_total += int(label.sum())
    assert total == label_total == sum(range(60))


@pytest.mark.parametrize("mode", [Sync, Async, AsyncRebatched])
def test_dictionary_batches(mode):
    opts = poptorch.Options().deviceIterations(2).replicationFactor(3)
    n = 500
    loader = poptorch.DataLoader(opts, IncrementDict([2, 3], n), num_workers=2, mode=mode)
    seen = 0
    for batch in loader:
        assert set(batch) == {"data", "label"}
        assert batch["data"].shape == (6, 2, 3) and batch["label"].shape == (6, 1)
        assert batch["label"][:, 0].tolist() == list(range(seen * 6, seen * 6 + 6))
        seen += 1
    assert seen == n // loader.combinedBatchSize == len(loader)


@pytest.mark.parametrize("mode,expected", [(Async, 80), (AsyncRebatched, 100)])
def test_iterable_dataset_tails(mode, expected):
    # PopTorch test_iterable_dataloader_drop_last: 101 items, 7 workers, batches of 4
    loader = poptorch.DataLoader(poptorch.Options(), IncrementIterable([2, 3], 101), batch_size=4,
                                 num_workers=7, mode=mode, worker_init_fn=split_between_workers)
    for _ in range(2):
        got = []
        for t in loader:
            assert t.shape == (4, 2, 3)
            got += values([t])
        assert len(got) == len(set(got)) == expected
    del loader


@pytest.mark.parametrize("iterable", [False, True])
def test_rebatched_drop_last_false_keeps_the_tail(iterable):
    # PopTorch test_leftover (AsyncRebatched): 101 items, batch 6 -> 16 full batches and one of 5
    n, b = 101, 6
    ds = IncrementIterableWithLen([2, 3], n) if iterable else IncrementDataset([2, 3], n)
    loader = poptorch.DataLoader(poptorch.Options(), ds, batch_size=b, num_workers=7 if iterable else 2,
                                 worker_init_fn=split_between_workers if iterable else None,
                                 drop_last=False, mode=AsyncRebatched)
    assert len(loader) == math.ceil(n / b)
    for _ in range(2):
        batches = [t.clone() for t in loader]
        assert sorted(t.shape[0] for t in batches) == [5] + [6] * 16
        assert sorted(values(batches)) == list(range(n))


@pytest.mark.parametrize("worker_size,drop_last", [(1, True), (3, False)])
def test_rebatched_worker_size(worker_size, drop_last):
    n = 101
    loader = poptorch.DataLoader(poptorch.Options(), IncrementIterableWithLen([2, 3], n), batch_size=4,
                                 num_workers=7, mode=AsyncRebatched, drop_last=drop_last,
                                 rebatched_worker_size=worker_size, worker_init_fn=split_between_workers)
    got = []
    for t in loader:
        assert not drop_last or t.shape == (4, 2, 3)
        got += values([t])
    assert len(got) == len(set(got)) == (n // 4 * 4 if drop_last else n)


def test_async_drop_last_false_rebatches():
    # Async + drop_last=False + a combined batch > 1 is rebatched, as in PopTorch
    loader = poptorch.DataLoader(poptorch.Options().deviceIterations(2), IncrementDataset([1], 25),
                                 batch_size=3, drop_last=False, mode=Async)
    assert len(loader) == 5
    assert [t.shape[0] for t in loader] == [6, 6, 6, 6, 1]


def test_leaving_a_pass_early_restarts_from_the_first_item():
    loader = poptorch.DataLoader(poptorch.Options(), IncrementDataset([2, 3], 10), batch_size=1,
                                 num_workers=1, mode=Async)
    for i, t in enumerate(loader):
        assert t[0, 0, 0] == i
        if i == 4:
            break
    assert values(t.clone() for t in loader) == list(range(10))


def test_accessor_over_sync_loader_and_plain_dataset():
    # PopTorch test_indexable_dataloader_len / test_iterable_dataloader_len (Sync part)
    ds = IncrementDataset([2, 3], 101)
    loader = poptorch.DataLoader(poptorch.Options(), ds, batch_size=4, num_workers=2)
    accessor = poptorch.AsynchronousDataAccessor(loader)
    assert len(accessor) == len(loader) == 25
    assert sum(1 for _ in accessor) == 25
    accessor.terminate()
    accessor = poptorch.AsynchronousDataAccessor(ds)
    assert len(accessor) == 101 and sum(1 for _ in accessor) == 101
    assert next(iter(accessor)).shape == (2, 3)  # a new pass; the accessor is its own iterator
    accessor.terminate()

    iterable = poptorch.DataLoader(poptorch.Options(), IncrementIterableWithLen([2, 3], 101), batch_size=4,
                                   num_workers=7, worker_init_fn=split_between_workers)
    accessor = poptorch.AsynchronousDataAccessor(iterable)
    assert len(iterable) == 25 and sum(1 for _ in accessor) == 20
    accessor.terminate()


def test_accessor_errors():
    ds = IncrementDataset([1], 10)
    async_loader = poptorch.DataLoader(poptorch.Options(), ds, mode=Async)
    with pytest.raises(poptorch.Error, match=r"The DataLoader already uses an AsynchronousDataAccessor "
                                             r"internally. Either use the existing one or set "
                                             r"mode='poptorch.DataLoaderMode.Sync' in the DataLoader."):
        poptorch.AsynchronousDataAccessor(async_loader)
    async_loader.terminate()
    keep_tail = poptorch.DataLoader(poptorch.Options(), ds, batch_size=3, drop_last=False)
    with pytest.raises(AssertionError, match="The 'drop_last=False' option from the DataLoader only works if "
                                             "'rebatched_size' is specified too."):
        poptorch.AsynchronousDataAccessor(keep_tail)
    with pytest.raises(AssertionError, match="rebatched_size must be None or greater than 1"):
        poptorch.AsynchronousDataAccessor(ds, rebatched_size=1)
    with pytest.raises(AssertionError, match="You cannot use DataLoaderMode.AsyncRebatched and manually "
                                             "specify the rebatched_size in async_options"):
        poptorch.DataLoader(poptorch.Options(), ds, mode=Async, async_options={"rebatched_size": 2})


def test_broken_or_empty_dataset_fails_to_start():
    loader = poptorch.DataLoader(poptorch.Options(), BrokenDataset([1], 100), batch_size=1)
    with pytest.raises(poptorch.Error, match="worker thread failed to start") as info:
        poptorch.AsynchronousDataAccessor(loader)
    assert "Broken dataset" in str(info.value.__cause__)
    with pytest.raises(poptorch.Error, match="worker thread failed to start"):
        poptorch.DataLoader(poptorch.Options(), IncrementDataset([1], 0), mode=Async)


def test_error_during_a_pass():
    loader = poptorch.DataLoader(poptorch.Options(), BreaksAt([1], 20), batch_size=2, mode=Async)
    with pytest.raises(AssertionError, match="An error occurred in the data fetcher") as info:
        for _ in loader:
            pass
    assert isinstance(info.value.__cause__, ValueError) and "item 7 is corrupt" in str(info.value.__cause__)


def test_a_killed_loading_process_is_the_data_fetchers_error():
    """PopTorch raises AssertionError("An error occurred in the data fetcher") for any failed worker; the
    emulator's cause names the signal."""
    import signal

    from accelbatch.procs import ProcessDied

    loader = poptorch.DataLoader(poptorch.Options(), IncrementDataset([1], 200), batch_size=2, mode=Async)
    batches = iter(loader)
    next(batches)
    os.kill(loader._accessor._inner.worker_pid, signal.SIGKILL)
    with pytest.raises(AssertionError, match="An error occurred in the data fetcher") as info:
        for _ in batches:
            pass
    assert isinstance(info.value.__cause__, ProcessDied) and "SIGKILL" in str(info.value.__cause__)
    loader.terminate()


@pytest.mark.parametrize("mode", [Async, poptorch.DataLoaderMode.AsyncRebatched])
def test_an_async_shuffle_follows_the_callers_seed(mode):
    """The loading process's own generator never saw the caller's seed: the same seed shuffles the same
    epochs, another seed others; each epoch serves every item once."""
    def epochs(seed):
        opts = poptorch.Options().randomSeed(seed)
        loader = poptorch.DataLoader(opts, IncrementDataset([1], 24), batch_size=3, shuffle=True, mode=mode)
        try:
            return [[int(x) for b in loader for x in b.flatten()] for _ in range(2)]
        finally:
            loader.terminate()

    first, again, other = epochs(1), epochs(1), epochs(2)
    assert first == again and first != other and first[0] != first[1]
    torch.manual_seed(5)
    expected = torch.rand(3)
    torch.manual_seed(5)
    loader = poptorch.DataLoader(poptorch.Options(), IncrementDataset([1], 24), batch_size=3, shuffle=True, mode=mode)
    loader.terminate()
    assert torch.equal(torch.rand(3), expected)   # the caller's random numbers are left as they were
    assert all(sorted(epoch) == list(range(24)) for epoch in first + other)


def test_early_preload_and_finite_loading():
    ds = IncrementDataset([1], 10)
    for async_options in ({"early_preload": True, "buffer_size": 5}, {"load_indefinitely": False}):
        loader = poptorch.DataLoader(poptorch.Options(), ds, mode=Async, async_options=async_options)
        for _ in range(2):
            assert values(loader) == list(range(10))


def test_distributed_shuffle_in_the_loading_process():
    n, b, hosts = 100, 4, 3
    used = set()
    for host in range(hosts):
        opts = poptorch.Options().randomSeed(42)
        opts.Distributed.configureProcessId(host, hosts)
        loader = poptorch.DataLoader(opts, IncrementDataset([1], n), batch_size=b, shuffle=True,
                                     num_workers=2, mode=Async)
        first = values(t.clone() for t in loader)
        assert len(first) == len(set(first)) == b * (n // (b * hosts))
        second = values(t.clone() for t in loader)
        assert first != second  # a new permutation every epoch
        used |= set(first) | set(second)
    assert used == set(range(n))


class CountingDataset(IncrementDataset):
    """Counts the items read, in shared memory (the count is seen from the loading process)."""

    def __init__(self, shape, length):
        super().__init__(shape, length)
        self.reads = torch.zeros(1, dtype=torch.int64).share_memory_()

    def __getitem__(self, index):
        self.reads += 1
        return super().__getitem__(index)


def test_early_preload_false_reads_only_the_first_batch_before_iterating():
    # PopTorch's worker reads the first element while it starts, then waits for iter() unless early_preload
    ds = CountingDataset([1], 10)
    loader = poptorch.DataLoader(poptorch.Options(), ds, batch_size=1)
    accessor = poptorch.AsynchronousDataAccessor(loader, buffer_size=3)
    time.sleep(0.5)
    assert int(ds.reads) == 1
    assert values(accessor) == list(range(10))
    accessor.terminate()
    eager = CountingDataset([1], 10)
    accessor = poptorch.AsynchronousDataAccessor(poptorch.DataLoader(poptorch.Options(), eager, batch_size=1),
                                                 buffer_size=3, early_preload=True)
    deadline = time.monotonic() + 10
    while int(eager.reads) < 4 and time.monotonic() < deadline:  # the ring: 3 ahead + the one handed out
        time.sleep(0.05)
    assert int(eager.reads) >= 4
    assert values(accessor) == list(range(10))
    accessor.terminate()


def test_next_without_iter_continues_the_first_pass():
    loader = poptorch.DataLoader(poptorch.Options(), IncrementDataset([1], 4), batch_size=1)
    accessor = poptorch.AsynchronousDataAccessor(loader)
    assert [int(next(accessor)) for _ in range(4)] == [0, 1, 2, 3]
    accessor.terminate()


def test_worker_traceback_printed_as_a_failed_process(capsys):
    loader = poptorch.DataLoader(poptorch.Options(), BrokenDataset([1], 100), batch_size=1)
    with pytest.raises(poptorch.Error, match="worker thread failed to start"):
        poptorch.AsynchronousDataAccessor(loader)
    err = capsys.readouterr().err
    assert re.search(r"^Process AsynchronousDataAccessor worker \(pid \d+\):\nTraceback \(most recent call "
                     r"last\):\n", err, re.M), err
    assert "in __getitem__" in err and err.rstrip().endswith("AssertionError: Broken dataset")
    loader = poptorch.DataLoader(poptorch.Options(), BreaksAt([1], 20), batch_size=2, mode=Async)
    with pytest.raises(AssertionError, match="An error occurred in the data fetcher"):
        for _ in loader:
            pass
    err = capsys.readouterr().err
    assert "Traceback (most recent call last):" in err and err.rstrip().endswith("ValueError: item 7 is corrupt")


@pytest.mark.slow
def test_miss_sleep_time_delays_refilling_a_full_ring():
    # buffer_size=1: the worker fills the ring then checks for a freed slot every miss_sleep_time_in_ms, so
    # of 7 batches asked for back to back, every other one waits for the worker's next check (~250 ms)
    def seconds_for_7_batches(miss_ms):
        loader = poptorch.DataLoader(poptorch.Options(), IncrementDataset([1], 8), batch_size=1)
        accessor = poptorch.AsynchronousDataAccessor(loader, buffer_size=1, miss_sleep_time_in_ms=miss_ms)
        it = iter(accessor)
        next(it)
        time.sleep(0.3)  # the ring is full
        start = time.monotonic()
        got = [int(next(it)) for _ in range(7)]  # (iterating `it` again would start a new pass)
        elapsed = time.monotonic() - start
        accessor.terminate()
        assert got == list(range(1, 8))
        return elapsed

    # measured 0.70 s alone (3 waits of ~250 ms), 0.45 s and 0.20 s on loaded cores (where the worker's checks
    # fall against the consumer's asks varies; the first wait may have begun before the clock starts): waits
    # of a good part of 250 ms, against milliseconds without them
    assert seconds_for_7_batches(250) > 0.1
    assert seconds_for_7_batches(0.1) < 0.1  # measured 0.003 s
    with pytest.raises(ValueError, match="miss_sleep_time_in_ms must be a number >= 0"):
        poptorch.AsynchronousDataAccessor(IncrementDataset([1], 4), miss_sleep_time_in_ms=-1)


@pytest.mark.slow
def test_an_async_loader_left_open_when_the_script_ends_exits_quietly(tmp_path):
    """A script that iterates an Async DataLoader and never terminates it (as PopTorch's examples do) ends
    with the loader's finalizer while the interpreter exits: no 'Exception ignored' traceback, exit 0."""
    script = tmp_path / "left_open.py"
    script.write_text(
        "import torch\n"
        "from accelbatch.backends import poptorch_emulator as poptorch\n"
        "data = torch.utils.data.TensorDataset(torch.arange(20.).unsqueeze(1), torch.arange(20))\n"
        "if __name__ == '__main__':\n"
        "    loader = poptorch.DataLoader(poptorch.Options(), data, batch_size=2,\n"
        "                                 mode=poptorch.DataLoaderMode.Async)\n"
        "    print(sum(1 for _ in loader))\n")
    root = str(Path(__file__).resolve().parents[2])
    ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": root})
    assert (ran.returncode, ran.stdout, ran.stderr) == (0, "10\n", "")
