"""Process helpers for synchronous replication over torch.distributed (gloo).

What the CLI / run integration needs:

* ``spawn_replicas(fn, R, *args, timeout_s=...)`` starts R processes (forked from the forkserver where there is
  one, :mod:`accelbatch.forkserver`, else spawned; ``start_method="spawn"`` spawns them) with
  (``MASTER_ADDR=127.0.0.1``, ``OMP_NUM_THREADS=1``, and torchrun's ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``;
  ``MASTER_PORT`` is a rendezvous store the parent holds for the whole call, as torchrun's agent does, so no other
  process can take the port between its choice and the group's start), initialises the gloo process group in each
  (``init_process_group=True``), calls ``fn(rank, *args)`` there and returns the list of the values they returned
  (rank order; values travel pickled, so return tensors/dicts, not open resources). ``fn`` and ``args`` must be
  picklable (a module-level function). The replicas run under :class:`accelbatch.procs.Supervisor`: if one raises,
  the others are ended at once and :class:`~accelbatch.procs.ProcessRaised` carries the traceback of the replica
  that raised first; one that dies without a traceback is :class:`~accelbatch.procs.ProcessDied`; past ``timeout_s``
  :class:`~accelbatch.procs.ProcessTimeout`. A replica aborted without a traceback (SIGABRT: NCCL's watchdog ends a
  replica whose collective timed out) while a peer keeps running is ``ProcessTimeout`` naming that stuck peer, with
  its stack; when all abort, ``ProcessDied`` says what SIGABRT means there. A group ``fn`` joined itself
  (accelerate's NCCL group) and left up is left after ``fn`` returns. ``group_timeout_s`` (``--replica-timeout-s``)
  bounds every collective: when a replica waits that long for one that never comes (hung, deadlocked),
  ``ProcessTimeout`` names the stuck replica and shows its Python stack. SIGINT/SIGTERM to the parent are passed on
  once to each replica (which run in process groups of their own, so a terminal's Ctrl-C does not reach them twice):
  the run saves its checkpoint and KeyboardInterrupt carries rank 0's message; a second signal ends them at once. A
  replica the signal reaches while it starts (before its run takes signals: it joins the group first) stops with
  nothing to say, and the others are ended at once ("SIGINT: the replicas stopped"). No process outlives the call.
  ``accelbatch train --device cpu --replication-factor 2`` is then: ``spawn_replicas(train_main, 2, opts)`` where
  ``train_main(rank, opts)`` builds the world on its shard and calls ``run`` (the backend's ``setup`` sees the
  initialised group and compiles a :class:`ReplicatedEngine`).
* ``init_from_env()`` joins the group when launched by torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
  set), so ``torchrun --nproc-per-node 2 -m accelbatch train ...`` takes the same path;
  :meth:`CPUBackend.setup` calls it when ``--replication-factor`` > 1.
* ``rank()``, ``world_size()``, ``is_main_process()`` (write the one checkpoint and the logs on rank 0),
  and each replica runs the rows ``ExecutionPlan.shard(batch, rank)`` gives it.
* The replicas' reports merge into the report of all their examples (``accelbatch.run.reduce_report`` over
  :meth:`accelbatch.backends.base.Backend.reduce_metrics`): counts summed (Metrics.add's too), averages
  weighted as :func:`accelbatch.metrics.report_weights` says, a count of the shared updates (skipped_updates)
  kept once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch.distributed as dist

from accelbatch.cores import check_process_count
from accelbatch.procs import (
    ChildSpec,
    FailureRecord,
    ProcessDied,
    ProcessFailure,
    ProcessTimeout,
    Supervisor,
    describe_exit,
)
from accelbatch.run_control import DOUBLE_DELIVERY_S

DEFAULT_GROUP_TIMEOUT_S = 300.0  # --replica-timeout-s: how long a collective waits for a late replica
ABORT_SETTLE_S = 5.0  # after a replica's SIGABRT: how long its peers have to end before one counts as stuck
_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused", re.IGNORECASE)


@dataclasses.dataclass(frozen=True)
class DistInfo:
    rank: int
    world_size: int
    local_rank: int


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, 0))
        return int(s.getsockname()[1])


def env_info(env: Mapping[str, str] | None = None) -> DistInfo | None:
    """Rank, world size and local rank from torchrun's environment; None when not launched that way."""
    env = os.environ if env is None else env
    if "RANK" not in env or "WORLD_SIZE" not in env:
        return None
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        local = int(env.get("LOCAL_RANK", rank))
    except ValueError:
        raise ValueError(f"RANK={env.get('RANK')!r}, WORLD_SIZE={env.get('WORLD_SIZE')!r}, "
                         f"LOCAL_RANK={env.get('LOCAL_RANK')!r}: expected integers (as torchrun sets)") from None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return DistInfo(rank=rank, world_size=world, local_rank=local)


def init_from_env(backend: str = "gloo", timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> DistInfo | None:
    """Join the process group described by torchrun's environment (no-op if already joined).

    Returns None when the environment names no rank (a plain single-process run). ``timeout_s`` bounds
    every collective (``--replica-timeout-s``).
    """
    info = env_info()
    if info is None:
        return None
    if not is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            raise RuntimeError("RANK/WORLD_SIZE are set but MASTER_PORT is not: launch with torchrun or "
                               "spawn_replicas, which set it")
        dist.init_process_group(backend, init_method="env://", rank=info.rank, world_size=info.world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
    return info


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def is_main_process() -> bool:
    """True on rank 0 (or without a process group): the process that writes checkpoints and logs."""
    return rank() == 0


def shutdown() -> None:
    if is_initialized():
        _leave_group(wait_for_peers=True)


def _leave_group(wait_for_peers: bool) -> None:
    """Destroy the process group; first a barrier, so no peer is still inside its last collective when
    this process closes its connections (gloo's threads abort the peer with SIGABRT otherwise)."""
    if wait_for_peers:
        with contextlib.suppress(Exception):  # a peer already gone: nothing left to wait for
            dist.barrier()
    dist.destroy_process_group()


# --- processes -------------------------------------------------------------------------------
_REPLICAS = ChildSpec(role="replica", label="replica {index} of {n} (pid {pid})", own_process_group=True,
                      stack_dumps=True, stop_grace_s=1.0)


def _replica_main(index: int, fn: Callable[..., Any], nprocs: int, port: int, init_group: bool, backend: str,
                  group_timeout_s: float, args: tuple) -> Any:
    """One replica (under the supervisor's entry wrapper, which reports its result, exception or interrupt;
    a terminal's Ctrl-C reaches the parent only, which asks each replica once to save and stop)."""
    os.environ.update({"RANK": str(index), "LOCAL_RANK": str(index), "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                       _AGENT_STORE: "True"})
    try:
        if init_group:
            # a stop signal waits until the group is up: torch's store would print a C++ stack on it, and
            # could not be interrupted anyway (it raises here, then the replicas leave together)
            blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                dist.init_process_group(backend, init_method="env://", rank=index, world_size=nprocs,
                                        timeout=datetime.timedelta(seconds=group_timeout_s))
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        result = fn(index, *args)
    except KeyboardInterrupt:  # SIGINT/SIGTERM: the run saved a checkpoint (its message says so)
        if init_group and dist.is_initialized():  # they stop together: leave together (or gloo may abort one)
            _leave_group(wait_for_peers=True)
        raise
    if init_group and dist.is_initialized():
        # every replica is past its last collective; the wrapper then leaves without running C++ destructors
        # (tearing a gloo group down while its peer does the same aborts one of them now and then)
        dist.barrier()
    elif dist.is_initialized():
        # a group ``fn`` joined and left up (accelerate's NCCL group): left here, after a barrier, so that
        # no replica exits with a live NCCL communicator (its watchdog may abort a peer still inside one)
        _leave_group(wait_for_peers=True)
    return result


def spawn_replicas(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float | None = None,
                   init_process_group: bool = True, backend: str = "gloo",
                   group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, start_method: str | None = None) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` processes joined in one gloo group; return their results.

    See the module docstring. ``group_timeout_s`` bounds each collective: a replica that does not join one
    in time (hung, deadlocked) ends the run with :class:`~accelbatch.procs.ProcessTimeout` naming it and
    showing its stack. Raises :class:`~accelbatch.procs.ProcessRaised` (a replica raised first: its
    traceback is in the message), :class:`~accelbatch.procs.ProcessDied` or ``ProcessTimeout``; never
    leaves a child process behind.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    check_process_count("-rf/--replication-factor", nprocs, "replica processes")
    store = _rendezvous_store(group_timeout_s)
    port = store.port
    spec = dataclasses.replace(_REPLICAS, env={"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                                               _AGENT_STORE: "True", "OMP_NUM_THREADS": "1"},
                               start_method=start_method or _REPLICAS.start_method)
    replicas = Supervisor(spec, _replica_main, nprocs,
                          args=(fn, nprocs, port, init_process_group, backend, group_timeout_s, args))
    try:
        with _StopRequests() as stop:
            _join(replicas, timeout_s, group_timeout_s, stop)
        _raise_if_interrupted(replicas, stop)
    finally:
        replicas.stop()
        del store  # the last reference: its server stops and the port is free again
    return replicas.results


# torch's env:// rendezvous connects every rank as a client to a store someone else hosts when this is "True"
_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


def _rendezvous_store(timeout_s: float) -> dist.TCPStore:
    """A TCP store hosted by this process on a port the OS picks, for the replicas' env:// rendezvous."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=timeout_s))


class _StopRequests:
    """SIGINT/SIGTERM in the parent while the replicas run are recorded, not raised: :func:`_join` passes
    the first on to every replica (they save a checkpoint together and stop); a second ends them at once."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.forwarded = False
        self._previous: dict[int, Any] = {}
        self._first_at = 0.0

    def record(self, signum: int, frame: Any = None) -> None:
        """The signal handler: the first signal again within DOUBLE_DELIVERY_S is that one delivered twice."""
        now = time.monotonic()
        if self.signals == [signum] and now - self._first_at < DOUBLE_DELIVERY_S:
            return
        if not self.signals:
            self._first_at = now
        self.signals.append(signum)

    def __enter__(self) -> "_StopRequests":
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self.record)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def check(self, replicas: Supervisor) -> bool:
        """Act on the signals received so far; True when the first was just passed on."""
        if len(self.signals) > 1:  # passed on too: a replica stops at once on its second signal
            replicas.signal(self.signals[1])
            raise KeyboardInterrupt(f"{signal.Signals(self.signals[1]).name} again: the replicas were ended "
                                    "without saving a checkpoint")
        if self.signals and not self.forwarded:
            self.forwarded = True
            replicas.signal(self.signals[0])
            return True
        return False


def _raise_if_interrupted(replicas: Supervisor, stop: _StopRequests) -> None:
    """KeyboardInterrupt with the first replica's message (e.g. where the checkpoint went) when the
    replicas stopped on a signal (the parent's, passed on, or one sent to them directly). A replica
    interrupted while it started (before its run could say anything) has none: the signal is named."""
    for index in range(replicas.nprocs):
        if replicas.interrupts.get(index):
            raise KeyboardInterrupt(replicas.interrupts[index])
    if stop.signals:
        raise KeyboardInterrupt(f"{signal.Signals(stop.signals[0]).name}: the replicas stopped")
    if replicas.interrupts:
        raise KeyboardInterrupt("")


def _join(replicas: Supervisor, timeout_s: float | None, group_timeout_s: float, stop: _StopRequests,
          stop_grace_s: float = 120.0) -> None:
    """Wait for every replica. The first failure is judged before the others are ended (a replica stuck in
    user code is found and its stack taken). A signal to this process is passed on to the replicas, which
    then have ``stop_grace_s`` to save and stop."""
    deadline = math.inf if timeout_s is None else time.monotonic() + timeout_s
    stop_deadline = math.inf
    while True:
        if stop.check(replicas):
            stop_deadline = time.monotonic() + stop_grace_s
        if time.monotonic() > stop_deadline:
            raise KeyboardInterrupt(f"the replicas did not stop within {stop_grace_s:g} s of "
                                    f"{signal.Signals(stop.signals[0]).name}; they were ended")
        done = replicas.wait(max(0.0, min(0.5, deadline - time.monotonic())))
        if _settled(replicas, replicas.failed()):
            if stop.forwarded and not replicas.records:  # died of the signal, or of a peer leaving
                _raise_if_interrupted(replicas, stop)
            raise _failure(replicas, group_timeout_s, judge=not stop.forwarded)
        if any(not said for said in replicas.interrupts.values()):
            # one was interrupted before its run could take the signal (while it started: it says nothing);
            # the others cannot go on without it (one may wait for it in init_process_group): they are ended
            _raise_if_interrupted(replicas, stop)
        if done:
            return
        if time.monotonic() >= deadline:
            alive = [pid for pid, code in zip(replicas.pids, replicas.exitcodes) if code is None]
            raise ProcessTimeout(f"{replicas.nprocs} replicas did not finish within {timeout_s} s (still "
                                 f"running: pids {alive}); they were ended", role="replica")


def _settled(replicas: Supervisor, failed: list[int], settle_s: float = 2.0) -> bool:
    """Whether a failure can be judged: a failing replica has ended (the one it failed after, if any, has
    ended before it: a killed peer is seen as such), or ``settle_s`` have passed since the first report."""
    codes = replicas.exitcodes
    return bool(failed) and (any(codes[i] is not None for i in failed)
                             or time.time() > min(r.time for r in replicas.records.values()) + settle_s)


def _failure(replicas: Supervisor, group_timeout_s: float, judge: bool) -> ProcessFailure:
    """The error naming the replica at the root of a failure: one stuck in user code (its peer timed out
    waiting), one that died without a traceback (its peers then only lost the connection), else the one
    that raised first; ``judge=False`` skips the first two (the replicas had been asked to stop)."""
    records = sorted(replicas.records.items(), key=lambda item: item[1].time)
    if judge and records and _TIMEOUT_TEXT.search(_last_line(records[0][1].traceback)):
        stuck = [i for i, code in enumerate(replicas.exitcodes) if code is None and i not in replicas.records]
        if stuck:
            return _stuck_error(replicas, stuck, records[0], group_timeout_s)
    dead = [i for i in replicas.failed() if i not in replicas.records]
    aborted = [i for i in dead if replicas.exitcodes[i] == -signal.SIGABRT]
    if judge and aborted and not records:
        stuck = _still_running(replicas, ABORT_SETTLE_S)
        if stuck:
            return _aborted_waiting_error(replicas, stuck, aborted[0], group_timeout_s)
    peers_lost = all(_PEER_LOST.search(_last_line(record.traceback)) for _, record in records)
    if dead and (not records or (judge and peers_lost)):
        index, code = dead[0], replicas.exitcodes[dead[0]]
        killed = code is not None and -code in signal.valid_signals()
        how = f"was killed by {signal.Signals(-code).name}" if killed else describe_exit(code)
        why = (f"(a C++ abort: NCCL's watchdog aborts a replica whose collective waited past "
               f"--replica-timeout-s={group_timeout_s:g} s or whose peer failed, raise that option if steps "
               "really take that long; gloo aborts when the replicas' collectives do not match, e.g. tensors of "
               "other sizes; NCCL_DEBUG=INFO or TORCH_DISTRIBUTED_DEBUG=DETAIL says more)" if index in aborted
               else "(out of memory? killed?)" if killed
               else "(an exit of its own, or an error before it started: what it printed above says which)")
        return ProcessDied(f"replica {index} of {replicas.nprocs} (pid {replicas.pids[index]}) {how} without "
                           f"a Python traceback {why}; the other replicas were ended"
                           + _consequences("died, these replicas failed too (as a consequence)", records),
                           role="replica", index=index, pid=replicas.pids[index], exitcode=code)
    (index, record), pid = records[0], replicas.pids[records[0][0]]
    if any(kind.endswith(".ProcessFailure") for kind in record.error_types):  # a child of its own (a data
        # worker) died or hung: the child is named; the replica's stack where it noticed tells nothing more
        head = f"replica {index} of {replicas.nprocs} (pid {pid}): {record.error_message}; the other replicas " \
               "were ended"
    else:
        head = f"replica {index} of {replicas.nprocs} (pid {pid}) raised first; the other replicas were ended. " \
               f"Its traceback:\n{record.traceback}"
    return record.to_error("replica", index, pid, message=(
        head
        + _consequences("failed, these replicas failed too (most likely as a consequence)", records[1:])))


def _consequences(what: str, records: list[tuple[int, FailureRecord]]) -> str:
    """The other replicas' failures, one line: "After it <what>: replica 0: <last line>; ..."."""
    listed = "; ".join(f"replica {i}: {_last_line(record.traceback)}" for i, record in records)
    return f"\nAfter it {what}: {listed}" if listed else ""


def _stuck_error(replicas: Supervisor, stuck: list[int], first: tuple[int, FailureRecord],
                 group_timeout_s: float) -> ProcessTimeout:
    """ProcessTimeout naming the replicas that never joined the collective the first failing replica timed
    out in, with their Python stacks, so the user sees where they hang; the stuck ones are killed (asking
    them to stop would only start a checkpoint)."""
    waiter, record = first
    names, pids = ", ".join(map(str, stuck)), ", ".join(str(replicas.pids[i]) for i in stuck)
    error = replicas.timeout_error(
        f"replica {names} of {replicas.nprocs} (pid {pids}) is stuck: replica {waiter} waited "
        f"--replica-timeout-s={group_timeout_s:g} s in a collective that it never joined "
        f"({_last_line(record.traceback)}); all replicas were ended. It hangs (a deadlock, a blocking call) "
        f"or is much slower than the others; raise --replica-timeout-s if its steps really take that long.",
        stuck)
    replicas.signal(signal.SIGKILL, stuck)
    return error


def _still_running(replicas: Supervisor, settle_s: float) -> list[int]:
    """The replicas still running, without a failure report, ``settle_s`` after the call (or at once when
    all others have ended): aborted peers end within moments of each other, a stuck one does not."""
    deadline = time.monotonic() + settle_s
    while not replicas.wait(max(0.0, min(0.5, deadline - time.monotonic()))) and time.monotonic() < deadline:
        pass
    return [i for i, code in enumerate(replicas.exitcodes) if code is None and i not in replicas.records]


def _aborted_waiting_error(replicas: Supervisor, stuck: list[int], aborted: int,
                           group_timeout_s: float) -> ProcessTimeout:
    """ProcessTimeout naming the replicas that stayed up while a peer was aborted (SIGABRT, as NCCL's
    watchdog ends a replica whose collective timed out): they never joined that collective."""
    names, pids = ", ".join(map(str, stuck)), ", ".join(str(replicas.pids[i]) for i in stuck)
    error = replicas.timeout_error(
        f"replica {names} of {replicas.nprocs} (pid {pids}) is stuck: replica {aborted} was aborted (SIGABRT) "
        f"without a Python traceback while replica {names} kept running, as NCCL's watchdog aborts a replica "
        f"whose collective waited past --replica-timeout-s={group_timeout_s:g} s for one that never joined "
        f"it; all replicas were ended. It hangs (a deadlock, a blocking call) or is much slower than the "
        f"others; raise --replica-timeout-s if its steps really take that long.", stuck)
    replicas.signal(signal.SIGKILL, stuck)
    return error


def lost_peer(exc: BaseException) -> str | None:
    """The one line for a collective of a replica started by torchrun that failed because another replica went
    away (gloo: "Connection closed/reset by peer"): the traceback would only show where this one waited, and
    torchrun's summary names the replica that failed. None for any other error (a bug keeps its traceback)."""
    info = env_info()
    if info is None or info.world_size < 2 or not isinstance(exc, RuntimeError) or not _PEER_LOST.search(str(exc)):
        return None
    return (f"replica {info.rank} of {info.world_size}: another replica went away during a collective (it failed "
            f"or was killed; torchrun's summary names it): {str(exc).strip().splitlines()[0]}")


def _last_line(trace: str) -> str:
    lines = trace.strip().splitlines()
    return lines[-1] if lines else "?"


__all__ = ["DistInfo", "env_info", "find_free_port", "init_from_env", "is_initialized", "is_main_process",
           "lost_peer", "rank", "shutdown", "spawn_replicas", "world_size"]
