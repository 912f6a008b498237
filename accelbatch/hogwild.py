"""Hogwild on CPU: ``--numthreads N`` processes, each with its own world, one model in shared memory.

ParlAI's semantics, in processes (forked from the forkserver under :class:`accelbatch.procs.Supervisor`):

* The main process's model agent (built and compiled by the factory) has its parameters and buffers moved to
  shared memory. Each child builds its own world with the ``build_child`` the factory hands in (its own
  agent of the same class, its own engine on the CPU, its share of the episodes: process ``rank`` of ``N``
  serves episodes ``rank, rank + N, ...``; in training pass by pass, :mod:`accelbatch.hogwild_passes`) and
  points its model's parameters and buffers at the shared tensors. Updates land in the one shared storage
  without locks (hogwild).
* :meth:`HogwildWorld.parley` releases one process to do one parley and returns without waiting: the parley
  goes to the free process with the fewest parleys queued (at most ``depth`` each).
* :meth:`get_total_exs` reads a shared counter (one int64 slot per process: the rows trained), with no
  synchronisation. In training :meth:`passes` counts the passes of the parleys released (each process sends
  its place in its shard's passes with each parley done; none is sent a parley past the pass of the last):
  -ne N is exact, each process training its shard once per pass.
* :meth:`report`, :meth:`reset_metrics` and :meth:`reset` reach every process: each has its own ordered pipe,
  so it handles each control message once, after the parleys queued before it; the main process waits for
  every answer. :meth:`report` merges the processes' metric sums.
* Evaluation serves every example once across the processes (each serves its shard); :meth:`epoch_done` is
  true when every process's world is done: each publishes its ``world.epoch_done()`` in a shared flag after
  every parley, and the main process confirms with one round trip once all flags are set.
* Checkpoints: :meth:`state_dict` drains the queued parleys (every process answers after the parleys queued
  before it) and gathers each process's ``world.state_dict()``; :meth:`load_state_dict` puts a freshly built
  HogwildWorld back there, so ``--resume`` serves the rest of the interrupted epoch exactly once. The weights
  are the shared model's (hogwild itself is not deterministic).
* A child's exception is raised with its own type (its traceback as a note, the ProcessRaised naming the process as
  its cause; that ProcessRaised itself when the exception does not unpickle here, or is a KeyboardInterrupt), a child
  that dies ProcessDied, one that stops answering ProcessTimeout (with its Python stack), all from
  :mod:`accelbatch.procs`; then all are stopped. :meth:`shutdown` stops them (idempotent; also at exit). Children
  ignore SIGINT in a process group of their own: a Ctrl-C or SIGTERM to the run's group (a terminal, timeout(1), a
  job scheduler) reaches the main process, which saves and stops them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import re
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from accelbatch.agents import Agent
from accelbatch.hogwild_metrics import merge_metric_states, metric_states
from accelbatch.hogwild_passes import pass_share, serve_passes
from accelbatch.multi_world import MultiWorld
from accelbatch.opts import OptionError, Opts
from accelbatch.procs import ChildSpec, ProcessFailure, Supervisor, raised_as
from accelbatch.teachers import FixedTeacher, Teacher, is_training
from accelbatch.worlds import BatchWorld, World

__all__ = ["HogwildError", "HogwildWorld"]

BuildChild = Callable[[Opts, "type[Agent] | None", int, int, "int | None"], World]
_PARLEY = ("p",)
_CHILDREN = ChildSpec(role="hogwild process", pipe=True, ignore_sigint=True, own_process_group=True,
                      process_name="hogwild-{index}", env={"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"},
                      stack_dumps=True, stop_request=("stop",), died_hint=" without reporting an error; all hogwild "
                      "processes were stopped")


class HogwildError(RuntimeError):
    """The hogwild world cannot be used: it is shut down, or a process built a different model. (A child
    process's failure is a :class:`~accelbatch.procs.ProcessFailure`.)"""


@contextlib.contextmanager
def _shm_as_usage_error(opts: Opts) -> Iterator[None]:
    """Torch failing to move tensors to shared memory (/dev/shm full, too small, read-only) as a usage error."""
    try:
        yield
    except (RuntimeError, OSError) as exc:
        if not isinstance(exc, OSError) and not re.search("shared memory|shm", str(exc)):
            raise  # another RuntimeError: a bug, which keeps its traceback
        why = getattr(exc, "strerror", None) or re.sub(r"\s*\(\d+\)$", "", str(exc).rsplit(": ", 1)[-1])
        raise OptionError(f"-nt/--numthreads {opts.numthreads}: the model could not be put in shared memory "
                          f"(/dev/shm: {why}): free space there or enlarge it (Docker: --shm-size), or "
                          f"{'train' if is_training(opts.datatype) else 'evaluate'} in one process (-nt 1)") from exc


# --- the child process -----------------------------------------------------------------------------------
def _alias_model(agent: Agent, names: Sequence[str], params: Sequence[torch.Tensor],
                 buffer_names: Sequence[str], buffers: Sequence[torch.Tensor]) -> None:
    """Point the agent's parameters and buffers at the main process's shared tensors."""
    model = getattr(agent, "model", None)
    if not isinstance(model, torch.nn.Module):
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


def _child_main(rank: int, conn: Any, numthreads: int, opts: Opts, agent_cls: type[Agent] | None,
                rows: int | None, build_child: BuildChild, names: list[str], params: list[torch.Tensor],
                buffer_names: list[str], buffers: list[torch.Tensor], counts: torch.Tensor, done: torch.Tensor) -> None:
    """One hogwild process (under the supervisor's entry wrapper, which sets it up and reports an
    exception): build its world, point the model at the shared tensors, serve the pipe."""
    world: World | None = None
    try:
        world = build_child(opts.replace(numthreads=1), agent_cls, rank, numthreads, rows)
        _alias_model(world.get_model_agent(), names, params, buffer_names, buffers)
        where = serve_passes(world)
        seed = opts.seed * 1_000_003 + 7919 * (rank + 1)
        torch.manual_seed(seed)
        base = world.world if isinstance(world, BatchWorld) else world
        for i, multi in enumerate(w for w in [base, *getattr(world, "worlds", [])] if isinstance(w, MultiWorld)):
            multi.rng = random.Random(seed + i)
        conn.send(("ready", where()))
        _serve(rank, world, where, counts, done, not is_training(opts.datatype), conn)
    except EOFError:
        pass  # the main process went away: nothing to report to
    finally:
        if world is not None:
            with contextlib.suppress(Exception):  # already stopping
                world.shutdown()


def _serve(rank: int, world: World, where: Callable[[], Any], counts: torch.Tensor, done: torch.Tensor,
           evaluating: bool, conn: Any) -> None:
    """Answer the main process's messages in order until told to stop (or its pipe closes); ``where``: the
    process's place in its shard's passes (None: unknown)."""
    controls: dict[str, Callable[[Any], Any]] = {
        "report": lambda _: metric_states(world), "reset_metrics": lambda _: world.reset_metrics(),
        "reset": lambda _: (world.reset(), done.__setitem__(rank, 0), counts.__setitem__(rank, 0)) and None,
        "epoch_done": lambda _: bool(world.epoch_done()),
        "drain": lambda _: None,  # the parleys queued before this one are done: nothing else to do
        "state": lambda _: world.state_dict(),
        "restore": lambda state: (world.load_state_dict(state), counts.__setitem__(rank, world.get_total_exs()))
        and where(),
    }
    while True:
        msg = conn.recv()
        kind = msg[0]
        if kind == "p":
            world.parley()
            counts[rank] = world.get_total_exs()
            if evaluating:
                done[rank] = int(world.epoch_done())
            conn.send(("d", where()))
            continue
        if kind == "stop":
            return
        if kind not in controls:
            raise HogwildError(f"unknown control message {kind!r}")
        conn.send(("reply", msg[1], controls[kind](msg[2] if len(msg) > 2 else None)))


# --- the main process ------------------------------------------------------------------------------------
class HogwildWorld(World):
    """``numthreads`` processes parleying their own worlds on one shared-memory model.

    ``main`` is this process's world (its model agent holds the shared model: save it, validate with it; its
    teacher gives the examples count); ``build_child(opts, agent_class, rank, numthreads, rows)`` builds each
    process's world there (``rows``: each process's combined batch; None: the plan's). ``depth`` bounds the
    parleys queued per process; ``timeout`` is how long to wait for a process that gives no sign of life;
    ``start_timeout`` the same for start-up."""

    def __init__(self, opts: Opts, main: World, build_child: BuildChild, agent_cls: type[Agent] | None = None,
                 rows: int | None = None, *, depth: int = 2, timeout: float = 300.0, start_timeout: float = 180.0,
                 stop_grace: float = 1.0, exs_per_parley: int | None = None):
        n = opts.numthreads
        if depth < 1:
            raise ValueError(f"depth: must be at least 1, got {depth}")
        self._world = main
        super().__init__(opts, main.get_agents())
        teacher = main.get_task_agent()
        if not is_training(opts.datatype) and not isinstance(teacher, FixedTeacher):
            raise OptionError(f"--numthreads {n} in evaluation needs FixedTeacher tasks (each process serves its "
                             f"share of the episodes, so every example is seen once); {type(teacher).__name__} "
                             "is not one: evaluate with --numthreads 1")
        self.numthreads, self.depth, self.timeout = n, depth, timeout
        self._training = is_training(opts.datatype)
        # training with a fixed number of rows per parley where the processes' passes are unknown: a released
        # parley's examples count at once, so the run loop stops releasing at its target rather than after the
        # parleys in flight (which would train examples past it)
        self._exs_per_parley = exs_per_parley if self._training else None
        self._released_from = 0  # parleys released before a restore, counted in the restored total
        self._closed, self._parleys = False, 0
        self._outstanding, self._progress = [0] * n, [0.0] * n  # parleys queued; when each last made progress
        self._replies: list[tuple[int, Any] | None] = [None] * n
        self._prefer: set[int] = set()
        self._seq = 0
        self._at: list[tuple[Any, ...] | None] = [None] * n  # plan_position (or ShardPasses.position) of each
        self._children: Supervisor | None = None
        try:
            model = getattr(main.get_model_agent(), "model", None)
            with _shm_as_usage_error(opts):  # the model's tensors and the counters, for the children to alias
                shared = model.share_memory() if isinstance(model, torch.nn.Module) else torch.nn.Module()
                named, named_buffers = dict(shared.named_parameters()), dict(shared.named_buffers())
                names, params, buffer_names = list(named), [p.detach() for p in named.values()], list(named_buffers)
                buffers = [b.detach() if b.is_shared() else b.detach().share_memory_() for b in named_buffers.values()]
                self._counts = torch.zeros(n, dtype=torch.int64).share_memory_()
                self._done = torch.zeros(n, dtype=torch.int8).share_memory_()  # eval: epoch_done() per process
            spec = dataclasses.replace(_CHILDREN, stop_grace_s=stop_grace)
            self._children = Supervisor(spec, _child_main, n, args=(
                n, opts, agent_cls, rows, build_child, names, params, buffer_names, buffers, self._counts, self._done))
            self._at = self._wait_all("ready", start_timeout)
        except BaseException:
            self.shutdown()
            raise

    # --- what the run loop calls ---------------------------------------------------------------------
    def parley(self) -> None:
        """Release one process to do one parley of its world; returns without waiting for it."""
        self._check_open()
        self._pump(0)  # what the children have sent, without waiting
        rank = self._free_process()
        while rank is None:
            self._pump(min(1.0, self.timeout))
            self._check_progress()
            rank = self._free_process()
        self._check_progress()  # also while others parley on (an evaluation's done processes parley padding)
        if not self._outstanding[rank]:
            self._progress[rank] = time.monotonic()
        self._send(rank, _PARLEY)
        self._outstanding[rank] += 1
        self._parleys += 1
        self.total_parleys += 1

    def get_total_exs(self) -> int:
        """Examples parleyed by all processes so far (a shared counter; no waiting); in training with a fixed
        number of rows per parley and no passes known, those of every parley released (the ones in flight will
        have trained them when anything reads their results)."""
        if self._exs_per_parley is not None and None in self._at:
            return self._released_from + self._parleys * self._exs_per_parley
        return int(self._counts.sum())

    def passes(self) -> float | None:
        """On a batch plan: the passes of the parleys released (the processes', weighted by their shards)."""
        released, shards = self._released(), [at[3] for at in self._at if at is not None]
        return None if released is None else sum(n * p for n, p in zip(shards, released)) / max(1, sum(shards))

    def _released(self) -> list[float] | None:
        """On a batch plan: each process's passes over its shard with the parleys released to it."""
        if not self._training or None in self._at:
            return None
        return [pass_share(at, out) for at, out in zip(self._at, self._outstanding)]  # type: ignore[arg-type]

    def report(self) -> dict[str, float]:
        """Metrics of every process merged (sums), after the parleys released before this call."""
        return merge_metric_states(self._broadcast("report"))

    def reset_metrics(self) -> None:
        self._broadcast("reset_metrics")

    def reset(self) -> None:
        """Reset every process's world (its episodes rewound) before the next parley."""
        self._broadcast("reset")
        self._prefer = set()
        self.acts, self.total_parleys = [None] * len(self.agents), 0

    def epoch_done(self) -> bool:
        """Evaluation: every process's world is done (its share of the episodes served)."""
        if self._training:
            return False
        self._check_open()
        flags = self._done.tolist()  # each process's world.epoch_done() after its last parley: no waiting
        if not all(flags):
            self._prefer = {rank for rank, finished in enumerate(flags) if not finished}
            self._pump(0)
            return False
        done = self._broadcast("epoch_done")  # all say done: confirm once, after the parleys in flight
        self._prefer = {rank for rank, finished in enumerate(done) if not finished}
        return not self._prefer

    def finish_parleys(self) -> None:
        """A ``drain`` round: each process answers after the parleys queued before it, so the shared model
        holds every update released so far (validate and save it then, not while processes still write)."""
        self._broadcast("drain")

    def state_dict(self) -> dict[str, Any]:
        """Every process's world state, taken once all are idle (:meth:`finish_parleys`), then each process's
        ``world.state_dict()``. Between parleys, from the main process, as the run loop calls it."""
        self.finish_parleys()
        return {"total_exs": self.get_total_exs(), "numthreads": self.numthreads,
                "processes": self._broadcast("state")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put this HogwildWorld (freshly built with the same options, before any parley) at a
        :meth:`state_dict`: each process's world."""
        processes = state.get("processes") or []
        if len(processes) != self.numthreads:
            raise ValueError(f"the checkpoint has {len(processes)} hogwild processes, this run {self.numthreads}; "
                             "resume with the same --numthreads, or start afresh without --resume")
        self._at = self._broadcast("restore", processes)  # a child's ValueError (a bad state) as itself
        self._released_from, self._parleys = int(self._counts.sum()), 0

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

    def clone(self) -> World:
        raise NotImplementedError("a HogwildWorld cannot be cloned; build another with create_world")

    # --- introspection --------------------------------------------------------------------------------
    @property
    def pids(self) -> list[int]:
        """The child processes' ids."""
        return list(self._children.pids) if self._children is not None else []

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
        children = getattr(self, "_children", None)
        if children is not None:
            children.stop()
        world = getattr(self, "_world", None)
        if world is not None and not getattr(self, "_world_shut", False):
            self._world_shut = True
            world.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit anything may be gone
            self.shutdown()

    def __enter__(self) -> "HogwildWorld":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # --- plumbing -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed:
            raise HogwildError("this HogwildWorld has been shut down (or a process failed); build a new one")

    def _free_process(self) -> int | None:
        """The free process with the fewest parleys queued; on a batch plan none past the last one's pass."""
        released = self._released()
        ahead = math.floor(min(released)) + 1 if released else math.inf
        free = [r for r in range(self.numthreads)
                if self._outstanding[r] < self.depth and (released is None or released[r] < ahead)]
        pool = [r for r in self._prefer if r in free] or free
        return min(pool, key=lambda r: (self._outstanding[r], r)) if pool else None

    def _send(self, rank: int, msg: tuple) -> None:
        try:
            self._children.send(rank, msg)
        except ProcessFailure as err:
            self._fail(err)

    def _pump(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for a message and handle it with any others that came; a child's failure
        stops them all and is raised. True if a message came."""
        got = False
        try:
            item = self._children.receive(timeout)
            while item is not None:
                got = True
                self._handle(*item)
                item = self._children.receive(0)
        except ProcessFailure as err:
            self._fail(err)
        return got

    def _handle(self, rank: int, msg: tuple) -> None:
        kind = msg[0]
        if kind == "d":
            self._outstanding[rank] -= 1
            self._progress[rank] = time.monotonic()
            self._at[rank] = msg[1]  # with the count above: what passes() adds up stays consistent
        elif kind in ("reply", "ready"):
            self._replies[rank] = (msg[1], msg[2]) if kind == "reply" else (-1, msg[1])
        else:
            self._fail(HogwildError(f"hogwild process {rank} sent an unknown message {kind!r}"))

    def _check_progress(self) -> None:
        """Fail naming the processes that have had a parley queued and finished none for ``timeout``."""
        now, n = time.monotonic(), self.numthreads
        stuck = [r for r in range(n) if self._outstanding[r] and now - self._progress[r] > self.timeout]
        if stuck:
            self._fail(self._stuck(f"hogwild processes {stuck} (pids {[self.pids[r] for r in stuck]}) finished no "
                                   f"parley in {self.timeout:.0f}s (--replica-timeout-s); a parley is stuck", stuck))

    def _stuck(self, message: str, ranks: Sequence[int]) -> ProcessFailure:
        """ProcessTimeout for ``ranks`` that gave no sign of life, with their Python stacks."""
        return self._children.timeout_error(message + "; all hogwild processes were stopped", ranks)

    def _fail(self, err: Exception) -> None:
        """Stop every process, then raise ``err``; a child's failure as the exception it raised, its own type
        (:func:`~accelbatch.procs.raised_as`), as the same code raises it in one process."""
        self.shutdown()
        raise raised_as(err) if isinstance(err, ProcessFailure) else err

    def _wait_all(self, what: str, timeout: float, seq: int = -1) -> list[Any]:
        """Wait until every process has answered ``seq``; fail on death, error or ``timeout`` of silence of a
        process that has not answered (its parleys done count: it works through those queued before)."""
        start = time.monotonic()
        while True:
            missing = [r for r in range(self.numthreads)
                       if self._replies[r] is None or self._replies[r][0] != seq]
            if not missing:
                break
            self._pump(min(1.0, timeout))
            now = time.monotonic()
            silent = [r for r in missing if now - max(start, self._progress[r]) > timeout]
            if silent:
                option = " (--replica-timeout-s)" if timeout == self.timeout else ""
                self._fail(self._stuck(f"hogwild processes {silent} (pids {[self.pids[r] for r in silent]}) gave "
                                       f"no answer to {what!r} in {timeout:.0f}s{option}", silent))
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
