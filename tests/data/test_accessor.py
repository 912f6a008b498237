"""AsyncDataAccessor: ring views, epochs, resets, preloading, errors, and no leaked process or segment."""

from __future__ import annotations

import atexit
import dataclasses
import gc
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch

from accelbatch.data.accessor import AsyncDataAccessor, EmptySourceError
from accelbatch.messages import Message
from accelbatch.procs import ProcessDied, ProcessFailure, ProcessRaised, ProcessTimeout

from . import gone, no_leaks, orphaned_shm  # noqa: F401  (pytest fixture)

pytestmark = [pytest.mark.filterwarnings("ignore:This DataLoader will create"), pytest.mark.multiprocess]


# --- sources (module level: they travel to the worker process) ----------------------------------

def batches(n=10, rows=4):
    return [{"x": torch.full((rows, 3), float(i)), "i": torch.tensor(i)} for i in range(n)]


class Marked:
    """Batches 0..n-1; every pass appends a line to ``marker`` when it starts."""

    def __init__(self, n, marker, delay=0.0):
        self.n, self.marker, self.delay = n, marker, delay

    def __len__(self):
        return self.n

    def __iter__(self):
        with open(self.marker, "a") as f:
            f.write("pass\n")
        for i in range(self.n):
            time.sleep(self.delay)
            yield torch.full((2,), float(i))


class SpawnedLoader:
    """A DataLoader over the numbers 0..n-1 in batches of 2, its 2 workers started by spawn (as in a replica
    process, whose start method is spawn): each pass waits seconds for them."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        data = torch.utils.data.TensorDataset(torch.arange(float(self.n)))
        return iter(torch.utils.data.DataLoader(data, batch_size=2, num_workers=2, multiprocessing_context="spawn"))


class SlowToExit:
    """Batches 0..n-1; iterating it registers an exit function that outlasts the accessor's stop grace (1 s),
    as torch's finalizers can under load: the stop's SIGTERM then reaches the worker while it exits."""

    def __init__(self, n):
        self.n = n

    def __iter__(self):
        atexit.register(time.sleep, 1.6)
        return iter([torch.full((2,), float(i)) for i in range(self.n)])


class Failing:
    def __init__(self, at, how):
        self.at, self.how = at, how

    def __iter__(self):
        for i in range(5):
            if i == self.at:
                if self.how == "raise":
                    raise_from_the_source(i)
                if self.how == "unpicklable":
                    raise Unpicklable(lambda: i)
                if self.how == "exit":
                    os._exit(3)
                if self.how == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                if self.how == "hang":
                    time.sleep(120)
            yield torch.full((2,), float(i))


def raise_from_the_source(i):
    raise ValueError(f"bad example {i}")


class Unpicklable(Exception):
    def __init__(self, fn):
        super().__init__("cannot travel")
        self.fn = fn


@dataclasses.dataclass
class Record:
    tensor: torch.Tensor
    name: str


class Announced:
    """Batches 0..n-1 (tensors of their number); asking the source for batch i first appends a line to ``marker``."""

    def __init__(self, n, marker):
        self.n, self.marker = n, marker

    def __len__(self):
        return self.n

    def __iter__(self):
        for i in range(self.n):
            with open(self.marker, "a") as f:
                f.write(f"{i}\n")
            yield torch.full((4,), float(i))


def marker_lines(path, expect, within=10.0):
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if os.path.exists(path) and len(open(path).read().splitlines()) >= expect:
            return len(open(path).read().splitlines())
        time.sleep(0.02)
    return len(open(path).read().splitlines()) if os.path.exists(path) else 0


# --- tests -------------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_epochs_len_and_views_of_the_ring(no_leaks):
    with AsyncDataAccessor(batches(), buffer_size=1) as accessor:
        assert len(accessor) == 10
        for _ in range(3):
            assert [int(b["i"]) for b in accessor] == list(range(10))
        kept, cloned = [], []
        for b in accessor:
            assert b["x"].is_shared() and b["x"].shape == (4, 3) and b["i"].dim() == 0
            kept.append(b["x"])
            cloned.append(b["x"].clone())
        assert [int(c[0, 0]) for c in cloned] == list(range(10))
        assert len({int(k[0, 0]) for k in kept}) < 10        # views were overwritten: clone what you keep


@pytest.mark.timeout(60)
def test_any_structure_dtype_and_shape(no_leaks):
    source = [
        (torch.arange(6).view(2, 3).t(), [torch.tensor([True, False]), "text"],
         {"bf16": torch.ones(3, dtype=torch.bfloat16), "empty": torch.zeros(0, 5),
          "msgs": [Message({"text": "hi", "labels": ["a"]})], "n": 7},
         Record(torch.full((i + 1, 100 * (i + 1)), float(i)), f"r{i}"))
        for i in range(6)
    ]
    with AsyncDataAccessor(source, buffer_size=2) as accessor:
        for i, (a, (flags, word), d, rec) in enumerate(accessor):
            assert torch.equal(a, torch.arange(6).view(2, 3).t())
            assert flags.dtype == torch.bool and flags.tolist() == [True, False] and word == "text"
            assert d["bf16"].dtype == torch.bfloat16 and d["empty"].shape == (0, 5) and d["n"] == 7
            assert isinstance(d["msgs"][0], Message) and d["msgs"][0]["labels"] == ["a"]
            assert isinstance(rec, Record) and rec.name == f"r{i}" and rec.tensor.shape == (i + 1, 100 * (i + 1))
            assert float(rec.tensor[-1, -1]) == i                 # slots grow for bigger batches


@pytest.mark.timeout(60)
def test_leaving_early_resets_to_the_first_item(no_leaks):
    with AsyncDataAccessor(batches(20), buffer_size=3) as accessor:
        for k in (1, 5, 0):
            for b in accessor:
                if int(b["i"]) == k:
                    break
            assert [int(b["i"]) for b in accessor][:3] == [0, 1, 2]
        first = iter(accessor)
        assert int(next(first)["i"]) == 0 and int(next(first)["i"]) == 1
        assert [int(b["i"]) for b in accessor] == list(range(20))   # a new pass abandons the old one
        with pytest.raises(RuntimeError, match="abandoned"):
            next(first)


@pytest.mark.timeout(60)
def test_early_preload_and_load_indefinitely(tmp_path, no_leaks):
    lazy = str(tmp_path / "lazy")
    with AsyncDataAccessor(Marked(3, lazy), early_preload=False, load_indefinitely=False) as accessor:
        time.sleep(0.5)
        assert not os.path.exists(lazy)                          # nothing loaded before iterating
        assert [int(b[0]) for b in accessor] == [0, 1, 2]
        time.sleep(0.5)
        assert marker_lines(lazy, 1) == 1                        # waits to be asked for the next pass
        assert [int(b[0]) for b in accessor] == [0, 1, 2]
        assert marker_lines(lazy, 2) == 2

    eager = str(tmp_path / "eager")
    with AsyncDataAccessor(Marked(3, eager), early_preload=True, load_indefinitely=True) as accessor:
        assert marker_lines(eager, 1) >= 1                       # loading started at construction
        assert [int(b[0]) for b in accessor] == [0, 1, 2]
        assert marker_lines(eager, 2) >= 2                       # the next pass starts by itself


@pytest.mark.timeout(60)
def test_overlaps_loading_with_compute(tmp_path, no_leaks):
    n, step = 12, 0.05
    with AsyncDataAccessor(Marked(n, str(tmp_path / "m"), delay=step), early_preload=True) as accessor:
        it = iter(accessor)
        next(it)                                                 # the worker process is up
        start = time.monotonic()
        for _ in it:
            time.sleep(step)                                     # the "model step"
        elapsed = time.monotonic() - start
    assert elapsed < 1.6 * (n - 1) * step                        # serial would be 2 * (n - 1) * step


@pytest.mark.timeout(60)
def test_worker_exception_reaches_the_caller_with_its_traceback(no_leaks):
    accessor = AsyncDataAccessor(Failing(2, "raise"))
    accessor_pid = accessor.worker_pid
    seen = []
    with pytest.raises(ValueError, match="bad example 2") as info:
        for b in accessor:
            seen.append(int(b[0]))
    assert seen == [0, 1]
    cause = info.value.__cause__
    assert isinstance(cause, ProcessRaised) and cause.pid == accessor_pid and cause.role == "data accessor"
    assert "raise_from_the_source" in str(cause) and cause.error_types[0] == "builtins.ValueError"
    assert any("worker process" in note and "raise_from_the_source" in note for note in info.value.__notes__)
    with pytest.raises(RuntimeError, match="terminated"):
        iter(accessor)


@pytest.mark.timeout(60)
def test_unpicklable_worker_exception_still_reported(no_leaks):
    with pytest.raises(ProcessRaised, match="Unpicklable: cannot travel") as info:
        list(AsyncDataAccessor(Failing(0, "unpicklable")))
    assert info.value.child_exception is None and "in __iter__" in info.value.child_traceback


@pytest.mark.timeout(60)
def test_empty_source_is_a_clear_error(no_leaks):
    with pytest.raises(EmptySourceError, match="no batches") as info:
        list(AsyncDataAccessor([]))
    assert isinstance(info.value, ProcessFailure) and isinstance(info.value, ValueError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how, message", [("exit", "exited with code 3"), ("kill", "killed by signal 9")])
def test_a_dying_worker_is_an_error_not_a_hang(how, message, no_leaks):
    with pytest.raises(ProcessDied, match=message):
        list(AsyncDataAccessor(Failing(1, how), timeout_s=30))


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_hanging_worker_times_out_and_is_stopped(no_leaks):
    accessor = AsyncDataAccessor(Failing(1, "hang"), timeout_s=1.0)
    pid = accessor.worker_pid
    start = time.monotonic()
    with pytest.raises(ProcessTimeout, match="timeout_s=1"):
        list(accessor)
    assert time.monotonic() - start < 10
    assert gone(pid)


@pytest.mark.timeout(60)
def test_terminate_and_garbage_collection_leave_nothing(no_leaks):
    accessor = AsyncDataAccessor(batches(), early_preload=True)
    next(iter(accessor))
    pid = accessor.worker_pid
    accessor.terminate()
    accessor.terminate()                                       # idempotent
    assert gone(pid)
    with pytest.raises(RuntimeError, match="terminated"):
        iter(accessor)
    accessor = AsyncDataAccessor(batches(), early_preload=True)
    pid = accessor.worker_pid
    del accessor
    gc.collect()
    assert gone(pid)


@pytest.mark.timeout(60)
def test_unpicklable_source_is_a_clear_error(no_leaks):
    class Local:
        def __iter__(self):
            yield torch.zeros(1)

    with pytest.raises(TypeError, match="cannot be sent to the worker"):
        AsyncDataAccessor(Local())


@pytest.mark.timeout(60)
@pytest.mark.parametrize("holds", [1, 2])
def test_the_latest_consumer_holds_batches_stay_valid_across_passes(tmp_path, holds, no_leaks):
    """A consumer that fetches one batch ahead (a training loop staging the next batch's copy to a GPU) holds
    two: with consumer_holds=2 neither is overwritten, also when the one ahead opens the next pass. The worker
    fills every free slot, then asks the source for one more batch: the marker says when it is done."""
    marker = tmp_path / "asked"
    with AsyncDataAccessor(Announced(6, marker), buffer_size=1, consumer_holds=holds) as accessor:
        passes = iter(accessor)
        first, second = next(passes), next(passes)
        assert marker_lines(marker, 4) == 4                # batch 2 is written, in the slot of batch 0 if free
        assert (float(first[0]), float(second[0])) == ((2.0, 1.0) if holds == 1 else (0.0, 1.0))
        third = next(passes)
        assert marker_lines(marker, 5) == 5                # batch 3 is written
        assert (float(second[0]), float(third[0])) == ((3.0, 2.0) if holds == 1 else (1.0, 2.0))
        rest = []
        for last in passes:
            rest.append(float(last[0]))
        assert rest == [3.0, 4.0, 5.0]
        next_pass = iter(accessor)
        opening = next(next_pass)                          # the worker went straight on to the next pass
        assert marker_lines(marker, 9) == 9                # its batch 0 handed out, 1 written, 2 asked for
        assert (float(last[0]), float(opening[0])) == ((1.0, 0.0) if holds == 1 else (5.0, 0.0))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leave", ["break", "raise"])
def test_the_batch_in_hand_stays_valid_after_leaving_a_pass(tmp_path, leave, no_leaks):
    """Leaving a pass (break, an exception) asks for no next batch: the one in hand is not handed back, so the
    worker, restarting the pass, cannot refill it; the next pass starts at the first item."""
    marker = tmp_path / "asked"
    with AsyncDataAccessor(Announced(10, marker), buffer_size=1) as accessor:
        try:
            for batch in accessor:
                if float(batch[0]) == 5.0:
                    if leave == "raise":
                        raise KeyError("stop here")
                    break
        except KeyError:
            pass
        # time for the restarted worker to fill every slot it was handed back (one, before: this batch's); the
        # worker cannot signal a write it never makes, so a wait it is
        time.sleep(0.5)
        assert float(batch[0]) == 5.0 and batch.tolist() == [5.0] * 4
        assert [float(b[0]) for b in accessor] == [float(i) for i in range(10)]


@pytest.mark.timeout(30)
def test_bad_arguments():
    with pytest.raises(ValueError, match="buffer_size"):
        AsyncDataAccessor([], buffer_size=0)
    with pytest.raises(ValueError, match="rebatch_size"):
        AsyncDataAccessor([], rebatch_size=0)


SCRIPT = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {root!r})
    from accelbatch.data.accessor import AsyncDataAccessor

    class Slow:
        def __iter__(self):
            for i in range(10_000):
                time.sleep(0.01)
                yield torch.zeros(4)

    if __name__ == "__main__":
        accessor = AsyncDataAccessor(Slow(), early_preload=True)
        print(accessor.worker_pid, flush=True)
        if sys.argv[1] == "crash":
            next(iter(accessor))
            os._exit(0)                     # the consumer vanishes without cleaning up
        for batch in accessor:
            time.sleep(0.01)
""")


@pytest.mark.slow
@pytest.mark.timeout(90)
@pytest.mark.parametrize("how", ["ctrl-c", "crash"])
def test_ctrl_c_or_a_vanished_consumer_leave_no_worker(tmp_path, how):
    script = tmp_path / "consumer.py"
    script.write_text(SCRIPT.format(root=os.getcwd()))
    env = dict(os.environ, OMP_NUM_THREADS="1")
    shm = set(os.listdir("/dev/shm"))
    proc = subprocess.Popen([sys.executable, str(script), how], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env)
    try:
        worker = int(proc.stdout.readline())
        if how == "ctrl-c":
            time.sleep(1.0)
            proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:  # a consumer that did not stop must not outlive the test
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    if how == "ctrl-c":
        assert proc.returncode != 0 and "KeyboardInterrupt" in err
        assert "Traceback" not in err.split("KeyboardInterrupt")[-1]     # the worker printed nothing
    assert gone(worker, within=15)
    assert orphaned_shm(shm) == set()


@pytest.mark.slow
@pytest.mark.timeout(90)
def test_a_dataloader_source_stopped_while_its_workers_start_ends_without_a_word(capfd, no_leaks):
    """The worker loads the next pass as soon as one ends, so a consumer that stops after a pass finds it
    waiting for its DataLoader's workers to start; stopped then (SIGTERM, after the grace), their deaths
    were reported as failures by torch's SIGCHLD handler: two tracebacks on a run that ended well."""
    accessor = AsyncDataAccessor(SpawnedLoader(8), buffer_size=2)
    try:
        got = [batch[0].clone() for batch in accessor]
    finally:
        accessor.terminate()
    assert torch.equal(torch.cat(got), torch.arange(8.0))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "killed by signal" not in err, err


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_stop_that_reaches_an_exiting_worker_ends_it_without_a_word(capfd, no_leaks):
    """The stop's SIGTERM came while the worker ran its exit functions (after the grace, under load): its
    handler raised SystemExit inside one of them, and Python printed "Exception ignored in atexit callback"
    with a traceback on a run that ended well."""
    accessor = AsyncDataAccessor(SlowToExit(4), buffer_size=2)
    try:
        got = [batch.clone() for batch in accessor]
    finally:
        accessor.terminate()
    assert torch.equal(torch.stack(got)[:, 0], torch.arange(4.0))
    err = capfd.readouterr().err
    assert "Traceback" not in err and "Exception ignored" not in err, err
