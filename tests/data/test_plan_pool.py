"""PlanPool: the async accessor's data workers for planned (map-style) batches."""

from __future__ import annotations

import os
import pickle
import signal
import time

import pytest
import torch

from accelbatch.data.accessor import AccessorError
from accelbatch.data.loader import make_loader
from accelbatch.data.plan_pool import DataWorkerDiedError, DataWorkerTimeoutError, PlanPool

from . import no_leaks  # noqa: F401  (pytest fixture)


class Plan:
    """Stands in for the loader's sampler: every pass plans the same items."""

    def __init__(self, items: list[int]):
        self.items, self.passes = items, 0

    def begin_pass(self) -> None:
        self.passes += 1

    def __iter__(self):
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class HoldsAFunction(Exception):
    """An exception that pickle cannot send (it holds a lambda)."""

    def __init__(self) -> None:
        super().__init__("holds a function")
        self.fn = lambda: 0


class Echo:
    """A packed payload naming the item, the process and torch's worker info; ``faults`` maps an item to
    what goes wrong while loading it."""

    def __init__(self, faults: dict[int, str] | None = None):
        self.faults = faults or {}

    def __getitem__(self, item: int) -> bytes:
        fault = self.faults.get(item)
        if fault == "raise":
            raise ValueError(f"item {item} is malformed")
        if fault == "unpicklable":
            raise HoldsAFunction()
        if fault == "exit":
            os._exit(3)
        if fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "hang":
            time.sleep(60)
        info = torch.utils.data.get_worker_info()
        return pickle.dumps((item, os.getpid(), info.id, info.num_workers), protocol=5)


def _decode(payloads) -> list[tuple]:
    return [pickle.loads(p) for p in payloads]


@pytest.fixture
def pools(no_leaks):
    """``pools(dataset, plan, **options)``: a PlanPool that is closed after the test (before the leak check)."""
    made: list[PlanPool] = []

    def make(dataset, plan, **options) -> PlanPool:
        made.append(PlanPool(dataset, plan, **options))
        return made[-1]

    yield make
    for pool in made:
        pool.close()


@pytest.mark.timeout(60)
def test_batches_come_in_plan_order_from_every_worker(pools):
    items = [7, 3, 9, 1, 4, 8, 2, 6, 5, 0, 11]
    pool = pools(Echo(), Plan(items), num_workers=3)
    for _ in range(2):  # the same workers serve both passes
        got = _decode(pool)
        assert [g[0] for g in got] == items
        assert [g[2] for g in got] == [k % 3 for k in range(len(items))]  # batch k from worker k mod 3
        assert {g[3] for g in got} == {3}
        assert {g[1] for g in got} == set(pool.pids) and os.getpid() not in pool.pids
    assert pool.sampler.passes == 2


@pytest.mark.timeout(60)
def test_a_pass_left_early_leaves_the_next_pass_clean(pools):
    items = list(range(20))
    pool = pools(Echo(), Plan(items), num_workers=2, prefetch=3)
    first = iter(pool)
    assert [pickle.loads(next(first))[0] for _ in range(2)] == [0, 1]
    first.close()  # 6 batches were out; they are collected, not served to the next pass
    assert [g[0] for g in _decode(pool)] == items


@pytest.mark.timeout(60)
def test_an_exception_in_a_worker_reaches_the_caller_with_its_traceback(pools):
    pool = pools(Echo({5: "raise"}), Plan(list(range(8))), num_workers=2)
    for _ in range(2):  # the workers stay up: the next pass gets as far again
        served = []
        with pytest.raises(ValueError, match="item 5 is malformed") as caught:
            for payload in pool:
                served.append(pickle.loads(payload)[0])
        assert served == [0, 1, 2, 3, 4]
        text = caught.value.worker_traceback
        assert text.startswith("(in data worker 1, pid ") and "in __getitem__" in text
        assert len(pool.pids) == 2


@pytest.mark.timeout(60)
def test_an_exception_pickle_cannot_send_arrives_as_its_summary(pools):
    pool = pools(Echo({2: "unpicklable"}), Plan(list(range(4))), num_workers=2)
    with pytest.raises(AccessorError, match="data worker 0 raised HoldsAFunction: holds a function") as caught:
        _decode(pool)
    assert "in __getitem__" in caught.value.worker_traceback


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fault, how", [("exit", "exited with code 3"), ("kill", "was killed by signal 9")])
def test_a_worker_that_dies_is_an_error_naming_it(fault, how, pools):
    pool = pools(Echo({4: fault}), Plan(list(range(8))), num_workers=2)
    start = time.monotonic()
    with pytest.raises(DataWorkerDiedError, match=rf"data worker 0 \(pid \d+\) {how}"):
        _decode(pool)
    assert time.monotonic() - start < 20
    assert pool.pids == []  # the other worker was stopped too


@pytest.mark.timeout(60)
def test_a_hanging_worker_times_out_naming_the_option(pools):
    pool = pools(Echo({2: "hang"}), Plan(list(range(6))), num_workers=2, timeout_s=0.5)
    start = time.monotonic()
    with pytest.raises(DataWorkerTimeoutError, match=r"--data-timeout-s=0.5"):
        _decode(pool)
    assert time.monotonic() - start < 10
    assert pool.pids == []


@pytest.mark.timeout(60)
def test_workers_end_when_the_accessor_side_is_gone(pools):
    """Only the pool's own end keeps a worker's pipe open (forked workers close the copies they inherit), so
    when the accessor process dies its workers see the pipe close and exit."""
    pool = pools(Echo(), Plan(list(range(6))), num_workers=3)
    _decode(pool)
    procs = list(pool._procs)
    for conn in pool._conns:
        conn.close()  # what the accessor's death does to its ends
    deadline = time.monotonic() + 5
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.exitcode for p in procs] == [0, 0, 0]


def _collate(messages):
    return {"ids": torch.tensor([int(m["text"].split()[1]) for m in messages]),
            "pid": torch.tensor([os.getpid()] * len(messages))}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["async", "async-rebatched"])
def test_the_loader_serves_the_same_batches_through_the_pool(mode, no_leaks):
    """Map-style data with data workers behind the accessor: the same batches, in the same order, as
    everything in this process, over two shuffled epochs; collated in worker processes."""
    data = [{"text": f"example {i} " + "word " * (i % 7), "labels": ["x"], "episode_done": True} for i in range(70)]

    def epochs(**kw):
        with make_loader(data, collate=_collate, batch_size=8, seed=3, **kw) as loader:
            return [[(b.ids, b.tensors["ids"].tolist(), b.tensors["pid"].tolist()) for b in loader] for _ in range(2)]

    here = epochs(mode="sync", num_workers=0)
    pooled = epochs(mode=mode, num_workers=2)
    assert [[b[:2] for b in e] for e in pooled] == [[b[:2] for b in e] for e in here]
    assert here[0] != here[1]  # shuffled per epoch
    pids = {p for e in pooled for b in e for p in b[2]}
    assert len(pids) == 2 and os.getpid() not in pids
