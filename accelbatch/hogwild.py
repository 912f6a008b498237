"""Hogwild on CPU: ``--numthreads N`` processes, each with its own copy of the world, one shared model.

ParlAI's semantics, in processes (started with ``spawn``):

* The main process builds the model agent once and moves its parameters and buffers into shared memory.
  Each child process rebuilds the world with ``create_world(opts with numthreads=1, agent=<class>)`` (a
  BatchWorld when the combined batch is > 1, so hogwild and batching combine) and then *aliases* its model's
  parameters and buffers to the shared tensors (``param.data = shared``). Every process keeps its own
  optimizer and engine; updates land in the one shared storage without locks (hogwild).
* :meth:`HogwildWorld.parley` releases one process to do one parley and returns without waiting: the parley
  goes to the free process with the fewest parleys queued (at most ``depth`` each, so the main loop cannot
  run away from the workers).
* :meth:`get_total_exs` reads a shared counter (one int64 slot per process), with no synchronisation.
* :meth:`report`, :meth:`reset_metrics` and :meth:`reset` reach every process: each process has its own
  ordered pipe, so it handles each control message exactly once, after the parleys queued before it; the
  main process waits for every answer (a barrier). :meth:`report` merges the processes' metric sums.
* Data: every teacher clone in every process reads one process-shared :class:`SharedEpisodeCursor` per task
  (indices in shared memory behind a lock; the same deterministic shuffle per epoch as
  :class:`~accelbatch.teachers.EpisodeCursor`), so evaluation serves each episode exactly once across all
  processes, and a training epoch is one pass over the data between them.
  Loader-fed worlds (dynamic batching, data workers, streaming) instead give each process its own shard
  of the data (``ShardSpec(num_processes=N, process_index=rank)``), which is exactly-once too.
* :meth:`epoch_done` (evaluation) is true when every process's world is done (the shared cursors exhausted
  and its episodes finished). Each process publishes its ``world.epoch_done()`` in a shared flag after every
  parley; the main process reads the flags (no waiting), sends the next parleys to the processes not yet
  done, and confirms with one round trip only when all flags are set: there is no barrier per step.
* Checkpoints: :meth:`HogwildWorld.data_position` (what ``data_position.world_position`` stores) drains the
  queued parleys (a ``drain`` round: every process answers after the parleys queued before it) and then
  gathers each process's own world position (shared cursors, teachers' episodes in progress, model
  agents' conversations, example count; a loader-fed process's loader position);
  :meth:`HogwildWorld.restore_data_position` puts a freshly built HogwildWorld back there, so ``--resume``
  serves the rest of the interrupted epoch exactly once. The weights are the shared model's (hogwild
  itself is not deterministic); the children's torch RNG states are not saved.
* A child's exception is raised in the main process as :class:`HogwildChildError` carrying the child's
  traceback; a child that dies or stops answering is detected (the main process waits on the children's
  pipes and process sentinels together, with timeouts), and then all children are stopped.
* :meth:`shutdown` stops and joins the children (idempotent); it also runs when the world is garbage
  collected and at interpreter exit. Children ignore SIGINT: on Ctrl-C the main process stops them, and a
  child whose main process vanished sees its pipe close and exits.
"""

from __future__ import annotations

import atexit
import os
import pickle
import random
import signal
import sys
import time
import traceback
import weakref
from multiprocessing import connection
from typing import Any, Sequence

import torch
import torch.multiprocessing as tmp

from accelbatch.agents import Agent
from accelbatch.hogwild_shared import (
    SharedEpisodeCursor,
    merge_world_states,
    model_module,
    multi_worlds,
    task_teachers,
    world_metric_states,
)
from accelbatch.opts import Opts
from accelbatch.teachers import EpisodeCursor, Teacher, is_training
from accelbatch.worlds import MultiWorld, World, create_world, world_rows

__all__ = ["HogwildWorld", "HogwildError", "HogwildChildError", "create_hogwild_world"]

_PARLEY = ("p",)
_STOP = ("stop",)


class HogwildError(RuntimeError):
    """The hogwild processes cannot go on (a child died or stopped answering, or the world is shut down)."""


class HogwildChildError(HogwildError):
    """An exception raised in a hogwild child process; the message holds the child's traceback.

    ``child_exception`` is the original exception when it could be sent back (also set as ``__cause__``),
    ``child_traceback`` the formatted traceback text, ``rank`` and ``pid`` name the process.
    """

    def __init__(self, message: str, *, rank: int, pid: int | None, child_traceback: str = "",
                 child_exception: BaseException | None = None):
        super().__init__(message)
        self.rank = rank
        self.pid = pid
        self.child_traceback = child_traceback
        self.child_exception = child_exception


# --------------------------------------------------------------------------------------------------------
# the child process
# --------------------------------------------------------------------------------------------------------
def _alias_model(agent: Agent, names: Sequence[str], params: Sequence[torch.Tensor],
                 buffer_names: Sequence[str], buffers: Sequence[torch.Tensor]) -> None:
    """Point the agent's parameters and buffers at the main process's shared tensors."""
    model = model_module(agent)
    if model is None:
        if params or buffers:
            raise HogwildError(f"{type(agent).__name__} has no torch model in this process, but the main "
                               "process shared one: build_model must not depend on the process")
        return
    own = list(model.named_parameters())
    if [n for n, _ in own] != list(names):
        raise HogwildError(f"{type(agent).__name__}: the model built in this process has parameters "
                           f"{[n for n, _ in own]}, the shared one {list(names)}; build_model must build the "
                           "same model in every process")
    for (name, param), shared in zip(own, params):
        if param.shape != shared.shape or param.dtype != shared.dtype:
            raise HogwildError(f"{type(agent).__name__}: parameter {name} is {tuple(param.shape)} "
                               f"{param.dtype} here but {tuple(shared.shape)} {shared.dtype} in the shared "
                               "model")
        param.data = shared
    for name, shared in zip(buffer_names, buffers):
        module_path, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_path) if module_path else model
        module._buffers[leaf] = shared


def _install_cursors(world: World, cursors: Sequence[SharedEpisodeCursor | None]) -> None:
    for group, cursor in zip(task_teachers(world), cursors):
        if cursor is None:
            continue
        for teacher in group:
            teacher.cursor = cursor


def build_process_world(opts: Opts, agent: Agent | type[Agent] | None, rows: int | None, rank: int,
                        numthreads: int) -> World:
    """Hogwild process ``rank``'s own world (``opts.numthreads`` is 1 here).

    Teacher-fed worlds are create_world's (their teachers get the shared cursors afterwards). Loader-fed
    worlds (dynamic batching, data workers, async modes, streaming) take this process's shard of the data
    instead, ``ShardSpec(num_processes=numthreads, process_index=rank)``, so the processes split every epoch.
    """
    from accelbatch.loader_world import LoaderWorld, uses_loader

    if not uses_loader(opts):
        return create_world(opts, agent=agent, rows=rows)
    from accelbatch.data import ShardSpec
    from accelbatch.plan import ExecutionPlan
    from accelbatch.worlds import make_agent

    model = make_agent(opts, agent)
    plan = ExecutionPlan.from_opts(opts, training=is_training(opts.datatype))
    shard = ShardSpec(num_processes=numthreads, process_index=rank)
    tasks = [t.strip() for t in opts.task.split(",") if t.strip()]
    # every process steps the whole combined batch (hogwild processes are not replicas of one step)
    per_step = plan.combined_batch if rows is None else rows
    worlds: list[World] = [LoaderWorld(opts.replace(task=t), model, per_step, shard, plan.factor) for t in tasks]
    return worlds[0] if len(worlds) == 1 else MultiWorld(opts, worlds, tasks)


def _child_main(rank: int, numthreads: int, opts: Opts, agent_cls: type[Agent] | None, rows: int,
                names: list[str], params: list[torch.Tensor], buffer_names: list[str],
                buffers: list[torch.Tensor], cursors: list[SharedEpisodeCursor | None], counts: torch.Tensor,
                done: torch.Tensor, conn: Any) -> None:
    """Entry point of one hogwild process: build the world, alias the model, serve the pipe."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process decides when we stop
    except ValueError:
        pass
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    world: World | None = None
    code = 0
    try:
        world = build_process_world(opts.replace(numthreads=1), agent_cls, rows, rank, numthreads)
        _alias_model(world.get_model_agent(), names, params, buffer_names, buffers)
        _install_cursors(world, cursors)
        torch.manual_seed(opts.seed * 1_000_003 + 7919 * (rank + 1))
        for i, multi in enumerate(multi_worlds(world)):
            multi.rng = random.Random(opts.seed * 1_000_003 + 7919 * (rank + 1) + i)
        conn.send(("ready", os.getpid()))
        _serve(rank, world, counts, done, not is_training(opts.datatype), conn)
    except EOFError:
        pass  # the main process went away: nothing to report to
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the main process
        _send_error(conn, rank, exc)
        code = 1
    finally:
        if world is not None:
            try:
                world.shutdown()
            except Exception:  # noqa: BLE001 - already stopping
                pass
        conn.close()
    _quick_exit(code)


def _quick_exit(code: int) -> None:
    """Leave without tearing the interpreter down (a second or more with torch loaded): run the exit hooks
    (multiprocessing's finalizers among them), flush, and exit."""
    try:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _serve(rank: int, world: World, counts: torch.Tensor, done: torch.Tensor, evaluating: bool,
           conn: Any) -> None:
    """Answer the main process's messages in order until told to stop (or its pipe closes)."""
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "p":
            world.parley()
            counts[rank] = world.get_total_exs()
            if evaluating:
                done[rank] = int(world.epoch_done())
            conn.send(("d",))
            continue
        if kind == "stop":
            return
        seq = msg[1]
        if kind == "report":
            answer: Any = world_metric_states(world)
        elif kind == "reset_metrics":
            world.reset_metrics()
            answer = None
        elif kind == "reset":
            world.reset()
            done[rank] = 0
            answer = None
        elif kind == "epoch_done":
            answer = bool(world.epoch_done())
        elif kind == "drain":  # the parleys queued before this one are done: nothing else to do
            answer = None
        elif kind == "position":
            from accelbatch.data_position import world_position

            answer = world_position(world)
        elif kind == "restore":
            from accelbatch.data_position import restore_world_position

            restore_world_position(world, msg[2])
            counts[rank] = world.get_total_exs()
            answer = None
        else:
            raise HogwildError(f"unknown control message {kind!r}")
        conn.send(("reply", seq, answer))


def _send_error(conn: Any, rank: int, exc: BaseException) -> None:
    text = traceback.format_exc()
    try:
        blob = pickle.dumps(exc)
        pickle.loads(blob)
    except Exception:  # noqa: BLE001 - some exceptions cannot travel; the text always can
        blob = None
    try:
        conn.send(("error", type(exc).__name__, str(exc), text, blob))
    except Exception:  # noqa: BLE001 - the main process is gone
        pass


# --------------------------------------------------------------------------------------------------------
# the main process
# --------------------------------------------------------------------------------------------------------
def _stop_children(procs: list[Any], conns: list[Any], grace: float) -> None:
    """Ask every child to stop, join, then terminate/kill the ones still alive. Never raises."""
    for conn in conns:
        try:
            conn.send(_STOP)
        except Exception:  # noqa: BLE001 - a dead child's pipe
            pass
    deadline = time.monotonic() + grace
    for proc in procs:
        try:
            proc.join(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001
            pass
    for proc in procs:
        try:
            if proc.is_alive():
                proc.terminate()
                proc.join(3.0)
            if proc.is_alive():
                proc.kill()
                proc.join(3.0)
        except Exception:  # noqa: BLE001
            pass
    for conn in conns:
        try:
            conn.close()
        except Exception:  # noqa: BLE001
            pass
    for proc in procs:
        try:
            if not proc.is_alive():
                proc.close()
        except Exception:  # noqa: BLE001
            pass


class HogwildWorld(World):
    """``numthreads`` processes parleying their own copies of the world on one shared-memory model.

    ``agent`` is None (``opts.model``), an Agent class, or an agent instance whose model the processes share
    (as with :func:`~accelbatch.worlds.create_world`). ``rows`` is each process's combined batch (default:
    the usual :func:`~accelbatch.worlds.world_rows`). ``depth`` bounds the parleys queued per process;
    ``timeout`` is how long to wait for a process that gives no sign of life before failing;
    ``start_timeout`` the same for start-up.
    """

    def __init__(self, opts: Opts, agent: Agent | type[Agent] | None = None, rows: int | None = None, *,
                 numthreads: int | None = None, depth: int = 2, timeout: float = 300.0,
                 start_timeout: float = 180.0, stop_grace: float = 30.0):
        n = opts.numthreads if numthreads is None else numthreads
        if n < 1:
            raise ValueError(f"--numthreads: must be at least 1, got {n}")
        if depth < 1:
            raise ValueError(f"depth: must be at least 1, got {depth}")
        single = opts.replace(numthreads=1)
        # the main process's world: the model agent (shared model), num_examples, the teachers' cursors
        self._world = create_world(single, agent=agent, rows=1)
        super().__init__(opts, self._world.get_agents())
        self.numthreads = n
        self.rows = world_rows(opts) if rows is None else rows
        self.depth = depth
        self.timeout = timeout
        self._training = is_training(opts.datatype)
        self._closed = False
        self._parleys = 0
        self._outstanding = [0] * n
        self._replies: list[tuple[int, Any] | None] = [None] * n
        self._prefer: set[int] = set()
        self._seq = 0
        self._pids: list[int] = []

        model_agent = self._world.get_model_agent()
        agent_cls = None if agent is None else (agent if isinstance(agent, type) else type(agent))
        model = model_module(model_agent)
        names: list[str] = []
        params: list[torch.Tensor] = []
        buffer_names: list[str] = []
        buffers: list[torch.Tensor] = []
        if model is not None:
            model.share_memory()
            for name, p in model.named_parameters():
                names.append(name)
                params.append(p.detach())
            for name, b in model.named_buffers():
                buffer_names.append(name)
                buffers.append(b.detach() if b.is_shared() else b.detach().share_memory_())

        from accelbatch.loader_world import uses_loader

        ctx = tmp.get_context("spawn")
        self._cursors: list[SharedEpisodeCursor | None] = []
        for group in task_teachers(self._world):
            cursor = getattr(group[0], "cursor", None)
            if isinstance(cursor, EpisodeCursor):
                self._cursors.append(SharedEpisodeCursor.like(cursor, ctx))
            elif self._training or uses_loader(single):
                self._cursors.append(None)  # loader-fed: each process reads its own shard
            else:
                raise ValueError(f"--numthreads {n} in evaluation needs teachers that serve episodes from an "
                                 f"EpisodeCursor (FixedTeacher) so every example is seen once; "
                                 f"{type(group[0]).__name__} has none: evaluate with --numthreads 1")
        self._counts = torch.zeros(n, dtype=torch.int64).share_memory_()
        self._done = torch.zeros(n, dtype=torch.int8).share_memory_()  # eval: world.epoch_done() per process

        self._procs: list[Any] = []
        self._conns: list[Any] = []
        self._finalizer = weakref.finalize(self, _stop_children, self._procs, self._conns, stop_grace)
        child_ends = []
        saved_env = {k: os.environ.get(k) for k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
        old_sigint = _ignore_sigint()
        try:
            os.environ["OMP_NUM_THREADS"] = "1"
            os.environ["MKL_NUM_THREADS"] = "1"
            for rank in range(n):
                parent_end, child_end = ctx.Pipe(duplex=True)
                self._conns.append(parent_end)
                child_ends.append(child_end)  # closed here once started: EOF then means the child is gone
                proc = ctx.Process(target=_child_main, name=f"hogwild-{rank}", daemon=False,
                                   args=(rank, n, opts, agent_cls, self.rows, names, params, buffer_names,
                                         buffers, self._cursors, self._counts, self._done, child_end))
                proc.start()
                self._procs.append(proc)
        except BaseException:
            self.shutdown()
            raise
        finally:
            for key, value in saved_env.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
            _restore_sigint(old_sigint)
            for end in child_ends:
                end.close()
        try:
            ready = self._wait_all("ready", start_timeout)
            self._pids = [int(pid) for pid in ready]
        except BaseException:
            self.shutdown()
            raise

    # --- what the run loop calls ---------------------------------------------------------------------
    def parley(self) -> None:
        """Release one process to do one parley of its world; returns without waiting for it."""
        self._check_open()
        self._poll()
        rank = self._free_process()
        if rank is None:
            last = time.monotonic()
            while rank is None:
                if self._pump(min(1.0, self.timeout)):
                    last = time.monotonic()
                elif time.monotonic() - last > self.timeout:
                    self._fail(HogwildError(f"no hogwild process finished a parley in {self.timeout:.0f}s "
                                            f"(processes {self._pids}); a parley is stuck"))
                rank = self._free_process()
        self._send(rank, _PARLEY)
        self._outstanding[rank] += 1
        self._parleys += 1

    def get_total_exs(self) -> int:
        """Examples parleyed by all processes so far (a shared counter; no waiting)."""
        return int(self._counts.sum())

    def report(self) -> dict[str, float]:
        """Metrics of every process merged (sums), after the parleys released before this call."""
        states = self._broadcast("report")
        return merge_world_states(states)

    def reset_metrics(self) -> None:
        self._broadcast("reset_metrics")

    def reset(self) -> None:
        """Reset every process's world (episodes, shared cursors rewound) before the next parley."""
        self._broadcast("reset")
        self._prefer = set()
        self.acts = [None] * len(self.agents)

    def epoch_done(self) -> bool:
        """Evaluation: every process's world is done (shared cursors exhausted, its episodes finished)."""
        if self._training:
            return False
        self._check_open()
        flags = self._done.tolist()  # each process's world.epoch_done() after its last parley: no waiting
        if not all(flags):
            self._prefer = {rank for rank, finished in enumerate(flags) if not finished}
            self._poll()
            return False
        done = self._broadcast("epoch_done")  # all say done: confirm once, after the parleys in flight
        self._prefer = {rank for rank, finished in enumerate(done) if not finished}
        return not self._prefer

    def data_position(self) -> dict[str, Any]:
        """Every process's data position, taken once all of them are idle (JSON data, for a checkpoint;
        :func:`~accelbatch.data_position.world_position` calls it).

        Two rounds: ``drain`` (each process answers after the parleys queued before it, so once all have
        answered no parley is in flight and the shared cursors stand still), then ``position`` (each
        process's own ``world_position``, which holds the shared cursors, its teachers' episodes in
        progress, its model agents' conversations and its example count). Call it between parleys, from
        the main process, as the run loop does. ``{"total_exs", "hogwild": {"numthreads", "cursors",
        "children"}, "unsupported": [...]}`` (a process's unsupported reasons, e.g. streamed data).
        """
        from accelbatch.data_position import cursor_state

        self._broadcast("drain")
        children = self._broadcast("position")
        unsupported = [f"hogwild process {rank}: {reason}" for rank, child in enumerate(children)
                       for reason in child.get("unsupported") or []]
        return {"total_exs": self.get_total_exs(),
                "hogwild": {"numthreads": self.numthreads,
                            "cursors": [None if c is None else cursor_state(c) for c in self._cursors],
                            "children": children},
                "unsupported": unsupported}

    def restore_data_position(self, position: dict[str, Any]) -> None:
        """Put this HogwildWorld (freshly built with the same options, before any parley) at a
        :meth:`data_position`: the shared cursors, then each process's world (teachers, conversations,
        example count)."""
        from accelbatch.checkpoint import CheckpointError
        from accelbatch.data_position import restore_cursor

        data = position.get("hogwild")
        if not isinstance(data, dict):
            raise CheckpointError(f"data position: the checkpoint was taken with a {position.get('world')} "
                                  f"world, this run is hogwild (--numthreads {self.numthreads}); resume with "
                                  "the same --numthreads, or start afresh without --resume")
        children = data.get("children") or []
        if len(children) != self.numthreads:
            raise CheckpointError(f"data position: the checkpoint has {len(children)} hogwild processes, "
                                  f"this run {self.numthreads}; resume with the same --numthreads, or start "
                                  "afresh without --resume")
        saved_cursors = data.get("cursors") or []
        if len(saved_cursors) != len(self._cursors):
            raise CheckpointError(f"data position: the checkpoint has {len(saved_cursors)} tasks, this run "
                                  f"{len(self._cursors)}; resume with the same -t, or start afresh")
        for cursor, saved in zip(self._cursors, saved_cursors):
            if (cursor is None) != (saved is None):
                raise CheckpointError("data position: the checkpointed hogwild run read its data otherwise "
                                      "(shared cursor vs. per-process shards); resume with the same options")
            if cursor is not None:
                restore_cursor(cursor, saved)
        try:
            self._broadcast("restore", children)
        except HogwildChildError as err:
            if isinstance(err.child_exception, CheckpointError):
                raise err.child_exception from None
            raise

    def num_examples(self) -> int:
        return self._world.num_examples()

    def num_episodes(self) -> int:
        return self._world.num_episodes()

    def get_agents(self) -> list[Agent]:
        return self._world.get_agents()

    def get_task_agent(self) -> Teacher:
        return self._world.get_task_agent()

    def get_model_agent(self) -> Agent:
        """The main process's model agent: the same shared model (save it, validate with it)."""
        return self._world.get_model_agent()

    def clone(self) -> "World":
        raise NotImplementedError("a HogwildWorld cannot be cloned; build another with create_hogwild_world")

    # --- introspection --------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """The child processes' ids."""
        return list(self._pids)

    @property
    def parleys(self) -> int:
        """Parleys released so far."""
        return self._parleys

    def exs_per_process(self) -> list[int]:
        return [int(x) for x in self._counts.tolist()]

    @property
    def closed(self) -> bool:
        return self._closed

    # --- shutting down --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop and join the children; release shared resources. Safe to call more than once."""
        self._closed = True
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None and finalizer.alive:
            finalizer()
        self._cursors = []  # drops the cursor locks (their semaphores are unlinked with them)
        world = getattr(self, "_world", None)
        if world is not None and not getattr(self, "_world_shut", False):
            self._world_shut = True
            world.shutdown()

    def __del__(self) -> None:
        try:
            self.shutdown()
        except Exception:  # noqa: BLE001 - at interpreter exit anything may be gone
            pass

    def __enter__(self) -> "HogwildWorld":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # --- plumbing -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise HogwildError("this HogwildWorld has been shut down (or a process failed); build a new one")

    def _free_process(self) -> int | None:
        pool = [r for r in self._prefer if self._outstanding[r] < self.depth] if self._prefer else []
        if not pool:
            pool = [r for r in range(self.numthreads) if self._outstanding[r] < self.depth]
        if not pool:
            return None
        return min(pool, key=lambda r: (self._outstanding[r], r))

    def _send(self, rank: int, msg: tuple) -> None:
        try:
            self._conns[rank].send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            self._pump(0.5)
            self._fail(self._dead_error(rank))

    def _poll(self) -> None:
        """Read whatever the children have sent, without waiting."""
        for rank, conn in enumerate(self._conns):
            self._drain(rank, conn)

    def _drain(self, rank: int, conn: Any) -> bool:
        got = False
        try:
            while conn.poll():
                self._handle(rank, conn.recv())
                got = True
        except (EOFError, OSError):
            self._fail(self._dead_error(rank))
        return got

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a message or a child's death; handle it. True if a message came."""
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self._procs)}
        ready = connection.wait(list(self._conns) + list(sentinels), timeout)
        got = False
        for rank, conn in enumerate(self._conns):
            got |= self._drain(rank, conn)
        for obj in ready:
            if obj in sentinels:
                rank = sentinels[obj]
                self._drain(rank, self._conns[rank])
                self._fail(self._dead_error(rank))
        return got

    def _handle(self, rank: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "d":
            self._outstanding[rank] -= 1
        elif kind in ("reply", "ready"):
            self._replies[rank] = (msg[1], msg[2]) if kind == "reply" else (-1, msg[1])
        elif kind == "error":
            _, type_name, text, tb, blob = msg
            original = None
            if blob is not None:
                try:
                    original = pickle.loads(blob)
                except Exception:  # noqa: BLE001
                    original = None
            pid = self._procs[rank].pid
            err = HogwildChildError(
                f"hogwild process {rank} (pid {pid}) raised {type_name}: {text}\n\n"
                f"traceback in the child process:\n{tb.rstrip()}",
                rank=rank, pid=pid, child_traceback=tb, child_exception=original)
            self._fail(err, cause=original)
        else:
            self._fail(HogwildError(f"hogwild process {rank} sent an unknown message {kind!r}"))

    def _dead_error(self, rank: int) -> HogwildError:
        proc = self._procs[rank]
        try:
            proc.join(1.0)
            code = proc.exitcode
        except Exception:  # noqa: BLE001
            code = None
        how = (f"was killed by signal {-code}" if code is not None and code < 0 else
               f"exited with code {code}" if code is not None else "stopped answering (its pipe closed)")
        return HogwildError(f"hogwild process {rank} (pid {proc.pid}) {how} without reporting an error; "
                            "all hogwild processes were stopped")

    def _fail(self, err: HogwildError, cause: BaseException | None = None) -> None:
        self.shutdown()
        if cause is not None:
            raise err from cause
        raise err

    def _wait_all(self, what: str, timeout: float, seq: int = -1) -> list[Any]:
        """Wait until every process has answered ``seq``; fail on death, error or ``timeout`` of silence."""
        last = time.monotonic()
        while True:
            missing = [r for r in range(self.numthreads)
                       if self._replies[r] is None or self._replies[r][0] != seq]
            if not missing:
                break
            if self._pump(min(1.0, timeout)):
                last = time.monotonic()
            elif time.monotonic() - last > timeout:
                pids = [self._procs[r].pid for r in missing]
                self._fail(HogwildError(f"hogwild processes {missing} (pids {pids}) gave no answer to "
                                        f"{what!r} in {timeout:.0f}s; all hogwild processes were stopped"))
        answers = [reply[1] for reply in self._replies]  # type: ignore[index]
        self._replies = [None] * self.numthreads
        return answers

    def _broadcast(self, kind: str, payloads: Sequence[Any] | None = None) -> list[Any]:
        """Send a control message to every process (``payloads[rank]`` with it, when given); return their
        answers (each handles it once, after the parleys queued before it)."""
        self._check_open()
        self._seq += 1
        for rank in range(self.numthreads):
            self._send(rank, (kind, self._seq) if payloads is None else (kind, self._seq, payloads[rank]))
        return self._wait_all(kind, self.timeout, self._seq)


def _ignore_sigint() -> Any:
    """Ignore SIGINT while children start (they inherit SIG_IGN, so Ctrl-C never hits their start-up)."""
    try:
        return signal.signal(signal.SIGINT, signal.SIG_IGN)
    except ValueError:  # not the main thread
        return None


def _restore_sigint(old: Any) -> None:
    if old is not None:
        try:
            signal.signal(signal.SIGINT, old)
        except ValueError:
            pass


def create_hogwild_world(opts: Opts, agent: Agent | type[Agent] | None = None,
                         rows: int | None = None, **kwargs: Any) -> HogwildWorld:
    """The world for ``--numthreads N > 1``: N hogwild processes (cpu only). See :class:`HogwildWorld`."""
    if opts.device != "cpu":
        raise ValueError(f"--numthreads {opts.numthreads} (hogwild) runs on --device cpu only, not "
                         f"--device {opts.device}; use --numthreads 1 with --device {opts.device}, or "
                         "--replication-factor for data parallelism")
    return HogwildWorld(opts, agent=agent, rows=rows, **kwargs)
