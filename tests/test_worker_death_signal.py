"""A data worker's death reported by SIGCHLD is not lost when the handler's exception is dropped on its way.

torch's SIGCHLD handler raises where the main thread happens to be; ``threading.Condition.notify`` (inside
torch's queue puts) drops a RuntimeError raised there. The iterator must still end with the worker named,
at once, not when the next get times out."""

from __future__ import annotations

import multiprocessing
import os
import signal

import pytest

from accelbatch.data import workers
from accelbatch.proc_errors import ProcessDied

pytestmark = pytest.mark.multiprocess


def _kill_self() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _IteratorWhoseWorkerDies:
    """Stands for torch's multi-process iterator: worker 0 is dead (SIGKILL); on the first batch the SIGCHLD
    handler runs inside a notify, as when the signal arrives during torch's ``index_queue.put``."""

    def __init__(self, dead: multiprocessing.Process):
        self._workers = [dead]
        self.served = 0

    def __iter__(self) -> "_IteratorWhoseWorkerDies":
        return self

    def __next__(self) -> int:
        if self.served == 3:
            raise StopIteration
        if self.served == 0:
            try:  # what Condition.notify does with a RuntimeError raised while it releases a waiter
                signal.getsignal(signal.SIGCHLD)(signal.SIGCHLD, None)
            except RuntimeError:
                pass
        self.served += 1
        return self.served


def _torch_like_handler(signum, frame) -> None:
    raise RuntimeError("DataLoader worker (pid(s) ...) is killed by signal: Killed.")


@pytest.mark.timeout(60)
def test_a_death_whose_raise_was_dropped_ends_the_iteration_naming_the_worker():
    dead = multiprocessing.get_context("fork").Process(target=_kill_self)
    dead.start()
    dead.join(30)
    before = signal.signal(signal.SIGCHLD, _torch_like_handler)
    try:
        served = []
        with pytest.raises(ProcessDied) as failure:
            for item in workers._named_failures(_IteratorWhoseWorkerDies(dead), timeout_s=60):
                served.append(item)
    finally:
        signal.signal(signal.SIGCHLD, before)
    assert served == [1]  # the batch that came with the lost raise, then the death, not the other two
    assert "worker 0" in str(failure.value) and "SIGKILL" in str(failure.value), failure.value


class _LiveWorker:
    exitcode = None
    pid = 0


class _IteratorOfLiveWorkers:
    def __init__(self, batches: int):
        self._workers = [_LiveWorker()]
        self.left = batches

    def __iter__(self) -> "_IteratorOfLiveWorkers":
        return self

    def __next__(self) -> int:
        if not self.left:
            raise StopIteration
        self.left -= 1
        return self.left


@pytest.mark.timeout(60)
@pytest.mark.parametrize("ends", ["whole pass", "closed early"])
def test_the_wrapper_hands_sigchld_back_to_torch_when_the_pass_ends(ends):
    """Left installed, the wrapper would keep the pass's workers (their pipes) alive after the run."""
    before = signal.signal(signal.SIGCHLD, _torch_like_handler)
    try:
        passing = workers._named_failures(_IteratorOfLiveWorkers(3), timeout_s=60)
        next(passing)
        assert isinstance(signal.getsignal(signal.SIGCHLD), workers._WorkerDeaths)  # wrapped during the pass
        if ends == "whole pass":
            assert list(passing) == [1, 0]
        else:
            passing.close()
        assert signal.getsignal(signal.SIGCHLD) is _torch_like_handler
    finally:
        signal.signal(signal.SIGCHLD, before)
