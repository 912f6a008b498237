"""The child-process supervisor alone: failures as ProcessRaised / ProcessDied / ProcessTimeout, messages,
results, stack dumps, and no process left behind. Children run the module-level functions below."""

from __future__ import annotations

import gc
import multiprocessing
import os
import pickle
import signal
import time

import pytest
from helpers import live_children

from accelbatch.held_sigint import holding_sigint
from accelbatch.procs import (
    INTERRUPTED,
    ChildSpec,
    FailureRecord,
    ProcessDied,
    ProcessFailure,
    ProcessRaised,
    ProcessTimeout,
    Supervisor,
)

FAST = ChildSpec(role="worker", start_method="forkserver", threads=1)


# --- what the children run -------------------------------------------------------------------------------
def raise_here(text: str) -> None:
    raise ValueError(text)


def raises_at_one(index: int, text: str) -> None:
    if index == 1:
        raise_here(text)
    time.sleep(60)


def sleeps(index: int) -> None:
    time.sleep(60)


def kills_itself(index: int) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def killed_making_shared_memory(index: int) -> None:
    """As a child killed while torch makes a shared-memory segment: its /dev/shm name made, not yet unlinked."""
    open(f"/dev/shm/torch_{os.getpid()}_{index}_made", "wb").close()
    os.kill(os.getpid(), signal.SIGKILL)


def never_answers(index: int, conn) -> None:
    conn.send("started")
    time.sleep(60)


class Unpicklable(Exception):
    def __init__(self, fn):
        super().__init__("cannot travel")
        self.fn = fn


def raises_unpicklable(index: int) -> None:
    raise Unpicklable(lambda: index)


def echoes(index: int, conn) -> int:
    while (message := conn.recv()) is not None:
        conn.send((message, index))
    return index * 10


def interrupted(index: int) -> None:
    raise KeyboardInterrupt(f"stopped by replica {index}")


def stubborn(index: int, conn) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    conn.send("ready")
    time.sleep(60)


def describes_itself(index: int, conn) -> None:
    conn.send((os.getpgid(0) == os.getpid(), signal.getsignal(signal.SIGINT) == signal.SIG_IGN,
               multiprocessing.current_process().name, os.environ.get("ACCELBATCH_TEST_VALUE")))
    conn.recv()


def answers_once(index: int, conn) -> None:
    conn.send("ready")
    conn.recv()


def reports_what_it_inherited(index: int, tensors: list) -> tuple[str | None, int]:
    """Prints a line, adds one to each tensor in place, and returns a variable of its environment."""
    print(f"child {index} says hello", flush=True)
    for tensor in tensors:
        tensor += 1
    return os.environ.get("ACCELBATCH_TEST_LATE"), len(tensors)


def shares_a_tensor_then_ends(index: int, conn, how: str) -> None:
    """Sends a shared-memory tensor (its file descriptor is fetched from this process when the message is
    read), then raises or returns at once, before the parent has read it."""
    import torch

    conn.send(("tensor", torch.arange(4.0).share_memory_()))
    if how == "raise":
        raise ValueError("raised after sharing")
    if how == "interrupt":
        raise KeyboardInterrupt("interrupted after sharing")


# --- helpers ---------------------------------------------------------------------------------------------
def assert_gone(pids: list[int]) -> None:
    assert multiprocessing.active_children() == []
    assert live_children() == []
    assert not any(os.path.exists(f"/proc/{pid}") for pid in pids)


# --- tests -----------------------------------------------------------------------------------------------
def test_failure_record_and_errors_travel_by_pickle():
    try:
        raise_here("bad row 3")
    except ValueError as exc:
        record = FailureRecord.capture(exc)
    assert record.error_types[:2] == ("builtins.ValueError", "builtins.Exception")
    assert record.summary == "ValueError: bad row 3" and "raise_here" in record.traceback
    error = pickle.loads(pickle.dumps(record)).to_error("data worker", 2, 123)
    assert isinstance(error, ProcessRaised) and (error.role, error.index, error.pid) == ("data worker", 2, 123)
    assert str(error).startswith("data worker 2 (pid 123) raised ValueError: bad row 3")
    assert isinstance(error.child_exception, ValueError) and error.__cause__ is error.child_exception
    back = pickle.loads(pickle.dumps(error))
    assert type(back) is ProcessRaised and str(back) == str(error) and back.error_types == error.error_types
    passed_on = FailureRecord.capture(back)  # a failure passed on keeps its own child's types and traceback
    assert passed_on.error_types == record.error_types and passed_on.traceback == record.traceback
    died = pickle.loads(pickle.dumps(ProcessDied("gone", role="replica", index=1, exitcode=-9)))
    assert (died.exitcode, died.index) == (-9, 1)
    timeout = ProcessTimeout("slow", role="replica")
    assert isinstance(timeout, TimeoutError) and isinstance(pickle.loads(pickle.dumps(timeout)), ProcessTimeout)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_raising_child_is_process_raised_with_its_traceback_and_types():
    sup = Supervisor(FAST, raises_at_one, 2, args=("bad input",))
    pids = sup.pids
    with pytest.raises(ProcessRaised) as info:
        sup.receive(30)
    sup.stop()
    err = info.value
    assert (err.role, err.index, err.pid) == ("worker", 1, pids[1])
    assert str(err).startswith(f"worker 1 (pid {pids[1]}) raised ValueError: bad input")
    assert "Traceback (most recent call last)" in str(err) and "in raise_here" in err.child_traceback
    assert err.error_types[0] == "builtins.ValueError" and err.error_message == "bad input"
    assert isinstance(err.child_exception, ValueError) and err.__cause__ is err.child_exception
    assert sup.failed() == [1]
    assert_gone(pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_killed_by_a_signal_is_process_died_naming_it():
    spec = ChildSpec(role="worker", start_method="forkserver", died_hint="; stopped")
    died = r"worker 0 \(pid \d+\) was killed by signal 9 \(SIGKILL\); stopped"
    with Supervisor(spec, kills_itself, 1) as sup, pytest.raises(ProcessDied, match=died) as info:
        sup.receive(30)
    assert info.value.exitcode == -signal.SIGKILL and info.value.error_types == ()
    assert_gone(sup.pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_killed_while_making_shared_memory_leaves_nothing_in_dev_shm():
    """A /dev/shm name torch made in a child killed before unlinking it stayed until reboot (a 0-byte
    torch_<pid>_* file after a suite's SIGKILL cases); the supervisor removes the names of its killed children,
    no other process's."""
    mine = f"/dev/shm/torch_{os.getpid()}_0_kept"
    open(mine, "wb").close()
    try:
        with Supervisor(FAST, killed_making_shared_memory, 2) as sup, pytest.raises(ProcessDied):
            sup.wait(30)
            sup.receive(30)
        assert [name for name in os.listdir("/dev/shm") if name.endswith("_made")] == []
        assert os.path.exists(mine)
    finally:
        os.unlink(mine)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_that_never_answers_times_out_with_its_stack():
    spec = ChildSpec(role="worker", start_method="forkserver", pipe=True, stack_dumps=True)
    with Supervisor(spec, never_answers, 2) as sup:
        assert sorted(sup.receive(30) for _ in range(2)) == [(0, "started"), (1, "started")]
        start = time.monotonic()
        assert sup.receive(1.0) is None
        assert 0.9 < time.monotonic() - start < 10
        stacks = sup.dump_stacks([1])
        assert "in never_answers" in stacks[1]
        error = sup.timeout_error("no answer within 1 s", [1])
    assert isinstance(error, ProcessTimeout) and isinstance(error, TimeoutError) and error.index == 1
    assert str(error).startswith("no answer within 1 s\nWhere worker 1 is (its Python stack")
    assert "in never_answers" in str(error)
    assert_gone(sup.pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_an_unpicklable_exception_is_still_reported():
    raised = "worker 0 .* raised Unpicklable: cannot travel"
    with Supervisor(FAST, raises_unpicklable, 1) as sup, pytest.raises(ProcessRaised, match=raised) as info:
        sup.receive(30)
    assert info.value.child_exception is None and info.value.error_types[0].endswith(".Unpicklable")
    assert "in raises_unpicklable" in info.value.child_traceback
    assert_gone(sup.pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_messages_results_and_interrupts():
    with Supervisor(ChildSpec(role="worker", start_method="forkserver", pipe=True), echoes, 2) as sup:
        sup.send(1, "hello")
        sup.send(0, pickle.dumps("raw"), raw=True)
        assert sorted([sup.receive(30), sup.receive(30)]) == [(0, ("raw", 0)), (1, ("hello", 1))]
        for i in range(2):
            sup.send(i, None)
        while not sup.wait(5):
            pass
        assert sup.results == [0, 10] and sup.failed() == [] and sup.exitcodes == [0, 0]
    with Supervisor(FAST, interrupted, 2) as sup:
        while not sup.wait(5):
            pass
        assert sup.interrupts == {0: "stopped by replica 0", 1: "stopped by replica 1"}
        assert sup.failed() == [] and sup.exitcodes == [INTERRUPTED, INTERRUPTED]
    with pytest.raises(RuntimeError, match="stopped"):
        sup.send(0, "late")
    assert_gone(sup.pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["raise", "interrupt", "return"])
def test_a_message_that_cannot_be_read_after_its_sender_ended_loses_neither_its_report_nor_the_failure(how):
    """The child's tensor cannot be rebuilt once the child has exited: that message is lost, yet what it
    raised afterwards is still the error, and a child that just returned is a failure naming the lost message."""
    spec = ChildSpec(role="worker", start_method="forkserver", pipe=True, ignore_sigint=True)
    expected = {"raise": (ProcessRaised, "raised ValueError: raised after sharing"),
                "interrupt": (ProcessRaised, "raised KeyboardInterrupt: interrupted after sharing"),
                "return": (ProcessFailure, "worker 0 .*: a message it sent could not be read here")}[how]
    with Supervisor(spec, shares_a_tensor_then_ends, 1, args=(how,)) as sup:
        sup.context.processes[0].join(30)  # ended before its message is read
        with pytest.raises(expected[0], match=expected[1]):
            sup.receive(30)
        assert sup.failed() == [0]  # also for a child that exited 0: what it sent is lost
    assert_gone(sup.pids)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_stop_and_garbage_collection_leave_no_process():
    spec = ChildSpec(role="worker", start_method="forkserver", pipe=True, stop_request="stop", stop_grace_s=0.5)
    sup = Supervisor(spec, stubborn, 3)
    pids = sup.pids
    assert sorted(sup.receive(30)[0] for _ in range(3)) == [0, 1, 2]
    start = time.monotonic()
    sup.stop()  # they ignore the request and SIGTERM: SIGKILL after the grace periods
    sup.stop()
    assert time.monotonic() - start < 10
    assert sup.exitcodes == [None] * 3 or all(code == -signal.SIGKILL for code in sup.exitcodes)
    assert_gone(pids)
    sup = Supervisor(FAST, sleeps, 2)
    pids = sup.pids
    del sup
    gc.collect()
    assert_gone(pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(90)
@pytest.mark.parametrize("start_method", [pytest.param("spawn", marks=pytest.mark.slow), "forkserver"])
def test_children_get_their_own_group_name_environment_and_ignore_ctrl_c(start_method):
    spec = ChildSpec(role="hogwild process", start_method=start_method, pipe=True, ignore_sigint=True,
                     own_process_group=True, process_name="worker-{index}", env={"ACCELBATCH_TEST_VALUE": "42"},
                     stop_request="stop")
    before = os.environ.get("ACCELBATCH_TEST_VALUE")
    with Supervisor(spec, describes_itself, 1) as sup:
        assert os.environ.get("ACCELBATCH_TEST_VALUE") == before
        assert sup.receive(60) == (0, (True, True, "worker-0", "42"))
        sup.signal(signal.SIGINT)
        time.sleep(0.3)
        assert sup.exitcodes == [None]  # ignored
    assert sup.exitcodes == [0]
    assert_gone(sup.pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_an_exception_before_the_wrapper_reports_comes_from_torchs_error_file():
    spec = ChildSpec(role="worker", start_method="forkserver", process_name="{missing}")
    raised = r"worker 0 \(pid \d+\) raised KeyError: 'missing'"
    with Supervisor(spec, sleeps, 1) as sup, pytest.raises(ProcessRaised, match=raised) as info:
        sup.receive(30)
    assert "Traceback (most recent call last)" in info.value.child_traceback and info.value.error_types == ()
    assert_gone(sup.pids)


def test_process_failure_is_a_runtime_error_with_defaults():
    error = ProcessFailure("plain")
    assert isinstance(error, RuntimeError) and (error.role, error.index, error.pid) == ("process", None, None)
    assert error.error_types == () and error.child_exception is None


def test_a_ctrl_c_while_holding_sigint_is_raised_at_the_end_not_lost():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        reached = False
        with pytest.raises(KeyboardInterrupt):
            with holding_sigint():
                signal.raise_signal(signal.SIGINT)  # held: no KeyboardInterrupt between starting and recording
                assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, set())
                reached = True
        assert reached
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, set())
        with holding_sigint():  # nothing held: nothing raised
            pass
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # ignored stays ignored (what starts inherits it)
        with holding_sigint():
            assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, before)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(90)
def test_a_ctrl_c_while_spawned_children_start_is_an_interrupt_or_ignored_never_a_traceback(capfd):
    """A terminal's Ctrl-C reaches children still importing torch (spawn): one that takes SIGINT reports an
    interrupt once it is set up, one that ignores it goes on; neither prints a traceback."""
    for ignore in (False, True):
        spec = ChildSpec(role="worker", start_method="spawn", pipe=True, ignore_sigint=ignore, stop_request="stop")
        with Supervisor(spec, answers_once, 1) as sup:
            sup.signal(signal.SIGINT)  # it has only just started: seconds of imports are ahead of it
            if ignore:
                assert sup.receive(60) == (0, "ready")
            else:
                while not sup.wait(5):
                    pass
                assert sup.interrupts == {0: ""} and sup.exitcodes == [INTERRUPTED] and sup.failed() == []
        assert_gone(sup.pids)
    assert "Traceback" not in capfd.readouterr().err


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
@pytest.mark.slow
def test_a_message_to_a_child_whose_end_already_ran_is_its_failure_not_a_closed_process_error():
    """The children's end (what stop() runs) can run before a pending send, as when a second Ctrl-C lands
    while a loader's generator is closing: the send raises the child's failure, not ValueError."""
    with Supervisor(ChildSpec(role="worker", start_method="forkserver"), sleeps, 1) as sup:
        sup._finalizer()  # the children ended and their process objects closed, the supervisor not told
        with pytest.raises(ProcessDied, match=r"worker 0 \(pid \d+\)"):
            sup.send(0, "more")
    assert_gone(sup.pids)


def floods_until_stopped(index: int, conn) -> None:
    """Sends messages larger than a pipe holds until it reads a stop request."""
    blob = b"x" * (1 << 20)
    while not conn.poll(0):
        conn.send(blob)
    assert conn.recv() == ("stop",)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_child_blocked_sending_to_a_stopping_parent_reads_its_stop_request():
    """A child blocked writing to a full pipe never read its stop request: each stop waited out the grace and
    ended it with SIGTERM (an async loader whose worker was sending its next batch: 1 s at the end of every
    pass). What children send once they are asked to stop is now read and dropped, so they stop as asked."""
    spec = ChildSpec(role="worker", start_method="forkserver", pipe=True, stop_request=("stop",), stop_grace_s=20.0)
    with Supervisor(spec, floods_until_stopped, 2) as sup:
        while len(sup._inbox) < 2:  # both are sending
            sup.wait(5)
    assert sup.exitcodes == [0, 0]
    assert_gone(sup.pids)


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_forked_child_takes_its_parents_environment_output_and_any_number_of_shared_tensors(capfd, monkeypatch):
    """A forkserver's child starts from the server's state: it must still see a variable set after the server
    started, write where the parent's output goes now (here: this test's capture), and take more shared
    tensors than the server passes descriptors with a start (252; a hogwild model's parameters, one each)."""
    import torch

    from accelbatch import forkserver

    with holding_sigint("forkserver"):
        forkserver.ensure_running()  # before the variable and the capture: the server has neither
    monkeypatch.setenv("ACCELBATCH_TEST_LATE", "set after the server started")
    tensors = [torch.zeros(2).share_memory_() for _ in range(300)]
    with Supervisor(ChildSpec(role="worker", start_method="forkserver"), reports_what_it_inherited, 2,
                    args=(tensors,)) as sup:
        while not sup.wait(30):
            pass
    assert sup.failed() == [] and sup.results == [("set after the server started", 300)] * 2
    assert all(torch.equal(tensor, torch.full((2,), 2.0)) for tensor in tensors)  # both children's updates
    out = capfd.readouterr().out
    assert "child 0 says hello" in out and "child 1 says hello" in out
    assert_gone(sup.pids)
