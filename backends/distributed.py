"""Process helpers for synchronous replication over torch.distributed (gloo).

What the CLI / run integration needs:

* ``spawn_replicas(fn, R, *args, timeout_s=...)`` starts R processes with the ``spawn`` start method
  (``MASTER_ADDR=127.0.0.1``, a free ``MASTER_PORT``, ``OMP_NUM_THREADS=1``, and torchrun's ``RANK``,
  ``LOCAL_RANK``, ``WORLD_SIZE``), initialises the gloo process group in each (``init_process_group=True``),
  calls ``fn(rank, *args)`` there and returns the list of the values they returned (rank order; values
  travel through ``torch.save`` files, so return tensors/dicts, not open resources). ``fn`` and ``args``
  must be picklable (a module-level function). If a replica raises, the others are ended at once and
  :class:`ReplicaError` carries the replica's traceback; past ``timeout_s`` :class:`ReplicaTimeout`.
  ``group_timeout_s`` (``--replica-timeout-s``) bounds every collective: when a replica waits that long
  for one that never comes (hung, deadlocked), :class:`ReplicaTimeout` names the stuck replica and shows
  its Python stack. SIGINT/SIGTERM to the parent are passed on once to each replica (which run in process
  groups of their own, so a terminal's Ctrl-C does not reach them twice): the run saves its checkpoint
  and KeyboardInterrupt carries rank 0's message; a second signal ends them at once. No process outlives
  the call.
  ``accelbatch train --device cpu --replication-factor 2`` is then: ``spawn_replicas(train_main, 2, opts)``
  where ``train_main(rank, opts)`` builds the world on its shard and calls ``run`` (the backend's
  ``setup`` sees the initialised group and compiles a :class:`ReplicatedEngine`).
* ``init_from_env()`` joins the group when launched by torchrun (``RANK``/``WORLD_SIZE``/``LOCAL_RANK``
  set), so ``torchrun --nproc-per-node 2 -m accelbatch train ...`` takes the same path;
  :meth:`CPUBackend.setup` calls it when ``--replication-factor`` > 1.
* ``rank()``, ``world_size()``, ``is_main_process()`` (write the one checkpoint and the logs on rank 0),
  and each replica runs the rows ``ExecutionPlan.shard(batch, rank)`` gives it.
* ``reduce_metrics(metrics)`` sums metrics across processes: a mapping of numbers / tensors / lists /
  nested mappings (e.g. ``Metrics.state()``), or an object with ``state()`` and ``merge_state()`` (e.g.
  ``Metrics``), which comes back merged. Identity in a single process.
"""

from __future__ import annotations

import contextlib
import datetime
import faulthandler
import json
import logging
import math
import os
import re
import signal
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from multiprocessing import connection as mp_connection
from typing import Any, Callable, Iterator, Mapping

import torch
import torch.distributed as dist
import torch.multiprocessing as tmp


class ReplicaError(RuntimeError):
    """A replica process failed; the message holds its traceback (or how it died). When it raised,
    ``error_types`` names its exception's classes (``module.QualName``, most derived first) and
    ``error_message`` is ``str()`` of it, so a caller can tell, e.g., bad input from a crash."""

    def __init__(self, message: str, index: int | None = None, pid: int | None = None,
                 error_types: tuple[str, ...] = (), error_message: str | None = None):
        super().__init__(message)
        self.index = index
        self.pid = pid
        self.error_types = error_types
        self.error_message = error_message


class ReplicaTimeout(ReplicaError, TimeoutError):
    """The replicas did not finish within ``timeout_s``, or one of them never joined a collective within
    ``group_timeout_s`` (``--replica-timeout-s``; ``index`` is that stuck replica); they were ended."""


DEFAULT_GROUP_TIMEOUT_S = 300.0  # --replica-timeout-s: how long a collective waits for a late replica
_STACK_SIGNAL = signal.SIGUSR1    # a replica dumps its Python stacks (faulthandler) on this signal
_TIMEOUT_TEXT = re.compile(r"timed out|timeout", re.IGNORECASE)
_PEER_LOST = re.compile(r"closed by peer|reset by peer|broken pipe|connection refused", re.IGNORECASE)


@dataclass(frozen=True)
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
        try:
            dist.barrier()
        except Exception:  # noqa: BLE001 - a peer already gone: nothing left to wait for
            pass
    dist.destroy_process_group()


# --- metrics ---------------------------------------------------------------------------------
def _add(a: Any, b: Any) -> Any:
    if a is None:
        return b
    if isinstance(a, Mapping):
        out = dict(a)
        for k, v in b.items():
            out[k] = _add(out.get(k), v)
        return out
    if isinstance(a, (list, tuple)):
        return type(a)(_add(x, y) for x, y in zip(a, b))
    return a + b


def reduce_metrics(metrics: Any, group: Any = None) -> Any:
    """Sum metrics over the processes of the group (every process calls it; every one gets the sum).

    Keys present on some processes only are kept. Averages must be sent as sums and counts.
    """
    if not is_initialized() or dist.get_world_size(group) == 1:
        return metrics
    merge_obj = hasattr(metrics, "state") and hasattr(metrics, "merge_state")
    local = metrics.state() if merge_obj else _to_cpu(dict(metrics))
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    if merge_obj:
        out = type(metrics)()
        for state in gathered:
            out.merge_state(state)
        return out
    total: Any = None
    for state in gathered:
        total = _add(total, state)
    return total


def _to_cpu(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, Mapping):
        return {k: _to_cpu(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_to_cpu(v) for v in x)
    return x


# --- processes -------------------------------------------------------------------------------
@contextlib.contextmanager
def _env(changes: Mapping[str, str]) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in changes}
    os.environ.update(changes)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _replica_main(index: int, fn: Callable[..., Any], nprocs: int, port: int, result_dir: str,
                  init_group: bool, backend: str, group_timeout_s: float, args: tuple) -> None:
    os.environ.update({"RANK": str(index), "LOCAL_RANK": str(index), "WORLD_SIZE": str(nprocs),
                       "LOCAL_WORLD_SIZE": str(nprocs), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1") or 1))
    # a terminal's Ctrl-C reaches the parent only, which asks each replica once to save and stop: a second
    # signal (the terminal's, then the parent's) would make a replica stop at once, checkpoint unsaved
    os.setpgid(0, 0)
    stack_file = open(os.path.join(result_dir, f"{index}.stack"), "w")  # noqa: SIM115 - lives as long as the process
    faulthandler.register(_STACK_SIGNAL, file=stack_file, all_threads=True)
    failed, interrupted = True, False
    try:
        if init_group:
            dist.init_process_group(backend, init_method="env://", rank=index, world_size=nprocs,
                                    timeout=datetime.timedelta(seconds=group_timeout_s))
        result = fn(index, *args)
        failed = False
    except Exception:
        # when one replica fails its peers fail too (their collectives break); the parent reports the
        # replica that failed first, so each failure is stamped with its time
        with open(os.path.join(result_dir, f"{index}.err"), "w") as fh:
            exc = sys.exc_info()[1]
            json.dump({"time": time.time(), "trace": traceback.format_exc(), "message": str(exc),
                       "types": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__]}, fh)
        raise
    except KeyboardInterrupt as exc:  # SIGINT/SIGTERM: the run saved a checkpoint (its message says so)
        with open(os.path.join(result_dir, f"{index}.interrupt"), "w") as fh:
            fh.write(str(exc))
        interrupted = True
        raise
    finally:
        if failed and init_group and dist.is_initialized():
            # the replicas stop on a signal together: leave together, or gloo may abort a slower peer
            _leave_group(wait_for_peers=interrupted)
    if result is not None:
        path = os.path.join(result_dir, f"{index}.pt")
        torch.save(result, path + ".tmp")
        os.replace(path + ".tmp", path)
    if init_group and dist.is_initialized():
        # every replica has its result saved past this barrier; then leave without running C++ destructors:
        # tearing a gloo group down while its peer does the same aborts one of them now and then
        # ("terminate called without an active exception", SIGABRT), after the work is done
        try:
            dist.barrier()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)


def _end(processes: list[Any], grace_s: float = 3.0) -> None:
    """Terminate, then kill, every process still alive; reap them all."""
    for p in processes:
        if p.is_alive():
            p.terminate()
    deadline = time.monotonic() + grace_s
    for p in processes:
        p.join(max(0.0, deadline - time.monotonic()))
    for p in processes:
        if p.is_alive():
            p.kill()
        p.join()


def spawn_replicas(fn: Callable[..., Any], nprocs: int, *args: Any, timeout_s: float | None = None,
                   init_process_group: bool = True, backend: str = "gloo",
                   group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``nprocs`` spawned processes joined in one gloo group; return results.

    See the module docstring. ``group_timeout_s`` bounds each collective: a replica that does not join one
    in time (hung, deadlocked) ends the run with :class:`ReplicaTimeout` naming it and its stack. Raises
    :class:`ReplicaError` (a replica raised or died: its traceback is in the message) or
    :class:`ReplicaTimeout`; never leaves a child process behind.
    """
    if nprocs < 1:
        raise ValueError(f"nprocs must be at least 1, got {nprocs}")
    port = find_free_port()
    with tempfile.TemporaryDirectory(prefix="accelbatch-replicas-") as result_dir:
        env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        ctx = None
        try:
            with _env(env):
                ctx = tmp.start_processes(
                    _replica_main, nprocs=nprocs, join=False, start_method="spawn",
                    args=(fn, nprocs, port, result_dir, init_process_group, backend, group_timeout_s, args))
            with _quiet_spawn_log(), _StopRequests() as stop:
                _join(ctx, nprocs, timeout_s, result_dir, group_timeout_s, stop)
            _raise_if_interrupted(nprocs, result_dir, stop)
        finally:
            if ctx is not None:
                with _sigint_deferred():
                    _end(ctx.processes)
        results = []
        for index in range(nprocs):
            path = os.path.join(result_dir, f"{index}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else None)
        return results


class _StopRequests:
    """SIGINT/SIGTERM in the parent while the replicas run are recorded, not raised: :func:`_join` passes
    the first on to every replica (they save a checkpoint together and stop); a second ends them at once."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self.forwarded = False
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "_StopRequests":
        import threading

        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, lambda signum, frame: self.signals.append(signum))
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def check(self, ctx: Any, grace_s: float) -> float | None:
        """Act on the signals received so far; the deadline for the replicas to stop, if asked to."""
        if len(self.signals) > 1:
            raise KeyboardInterrupt(f"{signal.Signals(self.signals[1]).name} again: the replicas were ended "
                                    "without saving a checkpoint")
        if self.signals and not self.forwarded:
            self.forwarded = True
            for p in ctx.processes:
                if p.exitcode is None:
                    with contextlib.suppress(OSError):
                        os.kill(p.pid, self.signals[0])
            return time.monotonic() + grace_s
        return None


def _raise_if_interrupted(nprocs: int, result_dir: str, stop: _StopRequests) -> None:
    """KeyboardInterrupt with the first replica's message (e.g. where the checkpoint went) when the
    replicas stopped on a signal (the parent's, passed on, or one sent to them directly)."""
    for index in range(nprocs):
        with contextlib.suppress(OSError):
            with open(os.path.join(result_dir, f"{index}.interrupt")) as fh:
                raise KeyboardInterrupt(fh.read())
    if stop.signals:
        raise KeyboardInterrupt(f"{signal.Signals(stop.signals[0]).name}: the replicas stopped")


def _join(ctx: Any, nprocs: int, timeout_s: float | None, result_dir: str, group_timeout_s: float,
          stop: _StopRequests, stop_grace_s: float = 120.0) -> None:
    """Wait for every replica. The first failure ends them all (torch's join) and raises ReplicaError; a
    replica stuck in user code is found, and its stack taken, before the others are ended. A signal to
    this process is passed on to the replicas, which then have ``stop_grace_s`` to save and stop."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    stop_deadline = math.inf
    while True:
        stop_deadline = min(stop_deadline, stop.check(ctx, stop_grace_s) or math.inf)
        if time.monotonic() > stop_deadline:
            raise KeyboardInterrupt(f"the replicas did not stop within {stop_grace_s:g} s of "
                                    f"{signal.Signals(stop.signals[0]).name}; they were ended")
        running = [p.sentinel for p in ctx.processes if p.exitcode is None]
        wait = 0.5 if deadline is None else max(0.0, min(0.5, deadline - time.monotonic()))
        if running:
            mp_connection.wait(running, timeout=wait)
        failed = any(p.exitcode not in (None, 0) for p in ctx.processes)
        # the cause is judged before torch's join ends the other replicas (their deaths would blur it)
        cause = _failure_cause(ctx, nprocs, result_dir, group_timeout_s) if failed and not stop.forwarded else None
        try:
            if (failed or not running) and ctx.join(timeout=0.1, grace_period=1.0):
                return
        except tmp.ProcessRaisedException as exc:
            raise cause or _first_failure(exc, nprocs, result_dir, ctx) from None
        except tmp.ProcessExitedException as exc:
            if cause is not None:
                raise cause from None
            if stop.forwarded:  # died of the signal (no handler yet) or of a peer leaving: say what was saved
                _raise_if_interrupted(nprocs, result_dir, stop)
            if _read_failures(nprocs, result_dir):  # a peer raised first; this death followed (gloo aborts)
                raise _first_failure(exc, nprocs, result_dir, ctx) from None
            raise _death_error(exc.error_index, exc.error_pid, exc.exit_code, nprocs, []) from None
        if deadline is not None and time.monotonic() >= deadline:
            alive = [p.pid for p in ctx.processes if p.is_alive()]
            raise ReplicaTimeout(f"{nprocs} replicas did not finish within {timeout_s} s "
                                 f"(still running: pids {alive}); they were ended")


def _failure_cause(ctx: Any, nprocs: int, result_dir: str, group_timeout_s: float) -> "ReplicaError | None":
    """The replica at the root of a failure when it is not simply the first to raise: one stuck in user
    code (its peer timed out waiting), or one that died without a traceback (its peers then lost the
    connection, and their errors only say so); None otherwise."""
    stuck = _find_stuck(ctx, nprocs, result_dir, group_timeout_s)
    if stuck is not None:
        return stuck
    failures = _read_failures(nprocs, result_dir)
    recorded = {i for _, i, _ in failures}
    dead = [i for i, p in enumerate(ctx.processes) if p.exitcode not in (None, 0) and i not in recorded]
    if dead and all(_PEER_LOST.search(_last_line(trace)) for _, _, trace in failures):
        p = ctx.processes[dead[0]]
        return _death_error(dead[0], p.pid, p.exitcode, nprocs, failures)
    return None


def _death_error(index: int, pid: int, exitcode: int, nprocs: int,
                 failures: list[tuple[float, int, str]]) -> ReplicaError:
    """ReplicaError for a replica that died without a Python traceback; the peers' errors listed."""
    how = (f"was killed by {signal.Signals(-exitcode).name}" if exitcode < 0 else f"exited with code {exitcode}")
    also = ""
    if failures:
        also = ("\nAfter it died, these replicas failed too (as a consequence): "
                + "; ".join(f"replica {i}: {_last_line(t)}" for _, i, t in failures))
    return ReplicaError(f"replica {index} of {nprocs} (pid {pid}) {how} without a Python traceback (out of "
                        f"memory? killed?); the other replicas were ended{also}", index=index, pid=pid)


def _find_stuck(ctx: Any, nprocs: int, result_dir: str, group_timeout_s: float) -> "ReplicaTimeout | None":
    """When the first replica to fail timed out in a collective: the ReplicaTimeout naming the replicas
    still running that never joined it (with their stacks), else None."""
    failures = _read_failures(nprocs, result_dir)
    if not failures or not _TIMEOUT_TEXT.search(_last_line(failures[0][2])):
        return None
    failed = {i for _, i, _ in failures}
    stuck = [i for i, p in enumerate(ctx.processes) if i not in failed and p.exitcode is None]
    if not stuck:
        return None
    error = _stuck_error(stuck, failures[0][1], failures[0][2], nprocs, result_dir, ctx, group_timeout_s)
    for i in stuck:  # hung: no use asking it to stop (it would only start saving a checkpoint)
        ctx.processes[i].kill()
    return error


@contextlib.contextmanager
def _quiet_spawn_log() -> Iterator[None]:
    """Silence torch's "Terminating process ... via signal SIGTERM" warnings: the error we raise says it."""
    logger = logging.getLogger("torch.multiprocessing.spawn")
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)


def _read_failures(nprocs: int, result_dir: str) -> list[tuple[float, int, str]]:
    """(time, index, traceback) of every replica that recorded a failure, earliest first."""
    failures = []
    for index in range(nprocs):
        try:
            with open(os.path.join(result_dir, f"{index}.err")) as fh:
                record = json.load(fh)
            failures.append((float(record["time"]), index, str(record["trace"])))
        except (OSError, ValueError, KeyError):
            continue
    return sorted(failures)


def _last_line(trace: str) -> str:
    lines = trace.strip().splitlines()
    return lines[-1] if lines else "?"


def _first_failure(exc: Any, nprocs: int, result_dir: str, ctx: Any) -> ReplicaError:
    """The ReplicaError naming the replica that raised first, with its traceback; later ones listed."""
    failures = _read_failures(nprocs, result_dir)
    if not failures:
        trace, index = str(exc).split("terminated with the following error:\n", 1)[-1], exc.error_index
        others: list[tuple[float, int, str]] = []
    else:
        _, index, trace = failures[0]
        others = failures[1:]
    pid = ctx.processes[index].pid if ctx is not None else exc.error_pid
    also = ""
    if others:
        also = ("\nAfter it failed, these replicas failed too (most likely as a consequence): "
                + "; ".join(f"replica {i}: {_last_line(t)}" for _, i, t in others))
    record = _read_record(result_dir, index)
    return ReplicaError(f"replica {index} of {nprocs} (pid {pid}) raised first; the other replicas were "
                        f"ended. Its traceback:\n{trace}{also}", index=index, pid=pid,
                        error_types=tuple(record.get("types", ())), error_message=record.get("message"))


def _read_record(result_dir: str, index: int) -> dict[str, Any]:
    """What replica ``index`` recorded when it raised ({} if nothing)."""
    try:
        with open(os.path.join(result_dir, f"{index}.err")) as fh:
            return dict(json.load(fh))
    except (OSError, ValueError, TypeError):
        return {}


def _stuck_error(stuck: list[int], waiter: int, trace: str, nprocs: int, result_dir: str, ctx: Any,
                 group_timeout_s: float) -> ReplicaTimeout:
    """ReplicaTimeout naming the replicas that never joined the collective ``waiter`` timed out in, with
    their Python stacks (dumped by faulthandler) so the user sees where they hang."""
    names = ", ".join(str(i) for i in stuck)
    pids = [ctx.processes[i].pid for i in stuck]
    stacks = _dump_stacks(stuck, result_dir, ctx)
    return ReplicaTimeout(
        f"replica {names} of {nprocs} (pid {', '.join(map(str, pids))}) is stuck: replica {waiter} waited "
        f"--replica-timeout-s={group_timeout_s:g} s in a collective that it never joined "
        f"({_last_line(trace)}); all replicas were ended. It hangs (a deadlock, a blocking call) or is much "
        f"slower than the others; raise --replica-timeout-s if its steps really take that long."
        f"{stacks}", index=stuck[0], pid=pids[0])


def _dump_stacks(indices: list[int], result_dir: str, ctx: Any, wait_s: float = 2.0) -> str:
    """Ask replicas for their Python stacks (faulthandler on SIGUSR1); the text, or '' if none came."""
    for i in indices:
        with contextlib.suppress(OSError):
            os.kill(ctx.processes[i].pid, _STACK_SIGNAL)
    paths = {i: os.path.join(result_dir, f"{i}.stack") for i in indices}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and not all(_size(p) for p in paths.values()):
        time.sleep(0.05)
    time.sleep(0.05)  # let the last frames be written
    parts = []
    for i, path in paths.items():
        with contextlib.suppress(OSError):
            with open(path) as fh:
                text = fh.read().strip()
            if text:
                parts.append(f"\nWhere replica {i} is (its Python stack, most recent call first):\n{text}")
    return "".join(parts)


def _size(path: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


@contextlib.contextmanager
def _sigint_deferred() -> Iterator[None]:
    """Hold a second Ctrl-C while children are being ended, so cleanup finishes; re-raise it after."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        yield
        return
    pending: list[Any] = []
    old = signal.signal(signal.SIGINT, lambda *a: pending.append(a))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
        if pending:
            raise KeyboardInterrupt


__all__ = ["ReplicaError", "ReplicaTimeout", "DistInfo", "find_free_port", "env_info", "init_from_env",
           "is_initialized", "rank", "world_size", "is_main_process", "shutdown", "reduce_metrics",
           "spawn_replicas"]
