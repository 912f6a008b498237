"""The Backend interface, the Engine it compiles, the Hooks a device gives the one engine loop
(:mod:`accelbatch.backends.engine`), and the registry of backends by name.

A backend owns its device and its collectives (as Lightning Fabric's strategies do): :meth:`Backend.setup`
returns this process's :class:`Topology`, and :meth:`Backend.barrier`, :meth:`Backend.all_gather_object`,
:meth:`Backend.decide` and :meth:`Backend.reduce_metrics` work across the replica processes with tensors
on :meth:`Backend.collective_device` (the device the process group's backend supports: the GPU for NCCL).
In a single process they do nothing (or return what they were given).
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import logging
import pickle
from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Dict

import torch
import torch.distributed as dist

from accelbatch.plan import ExecutionPlan, PlanError

from .prefetch import Copier, map_tensors

if TYPE_CHECKING:
    from accelbatch.opts import Opts

TensorBatch = Dict[str, torch.Tensor]
log = logging.getLogger("accelbatch")

# name -> "module:Class", imported only when asked for, so the core never imports torch.cuda or poptorch.
BACKEND_PATHS: dict[str, str] = {
    "cpu": "accelbatch.backends.cpu:CPUBackend",
    "cuda": "accelbatch.backends.cuda:CUDABackend",
    "ipu": "accelbatch.backends.ipu:IPUBackend",
}

MIXED_PRECISION = ("no", "bf16", "fp16")


class NonFiniteLoss(RuntimeError):
    """A training loss was NaN or infinite; the message says where and how to skip such steps."""


class BackendUnavailable(RuntimeError):
    """The named backend cannot run here; the message says why and lists those that can."""


@dataclass(frozen=True)
class Topology:
    """Where this process sits among the replica processes of a run (one process: rank 0 of 1)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        """True on the process that writes checkpoints and logs."""
        return self.rank == 0


@dataclass(frozen=True)
class EngineOptions:
    """Run options an engine needs beyond its plan: ``--skip-nan``, ``--mixed-precision``, ``--compile``,
    ``--ddp-static-graph``."""

    skip_nan: bool = False
    mixed_precision: str = "no"
    compile: bool = False
    ddp_static_graph: bool = False

    def __post_init__(self) -> None:
        if self.mixed_precision not in MIXED_PRECISION:
            raise PlanError(f"--mixed-precision: {self.mixed_precision!r} is not one of "
                            f"{', '.join(MIXED_PRECISION)}")

    @classmethod
    def from_opts(cls, opts: Any) -> EngineOptions:
        return cls(skip_nan=bool(getattr(opts, "skip_nan", False)),
                   mixed_precision=getattr(opts, "mixed_precision", None) or "no",
                   compile=bool(getattr(opts, "compile", False)),
                   ddp_static_graph=bool(getattr(opts, "ddp_static_graph", False)))


@dataclass(frozen=True)
class Replicas:
    """This process among R replica processes (rank 0 of 1 runs every replica's micro-batches itself).

    ``inputs``: "shard" (a process is given its replica's rows, ``plan.shard(batch, rank)``) or "full" (it
    is given the whole call and keeps its rows). ``gather_outputs``: every rank returns the whole call's
    outputs in the plan's order (else its own micro-batches', ``rows`` indexing what it was given).
    """

    rank: int = 0
    world_size: int = 1
    group: Any = None
    inputs: str = "shard"
    gather_outputs: bool = False

    def check(self, plan: ExecutionPlan) -> None:
        if self.inputs not in ("shard", "full"):
            raise PlanError(f"inputs={self.inputs!r}: expected 'shard' (each process gets its replica's "
                            "rows) or 'full' (each process gets the whole combined batch)")
        if plan.input_group_size > 1:
            raise PlanError(f"input replica grouping (--ipu-input-replica-grouping {plan.input_group_size}) is an "
                            "IPU placement: run the plan on --device ipu, or give the cpu/cuda engine the plan "
                            "without it (its R / N groups as the replication factor)")
        if self.world_size > 1 and plan.replication_factor != self.world_size:
            raise PlanError(f"--replication-factor {plan.replication_factor} but {self.world_size} processes "
                            f"are running (one per replica): start {plan.replication_factor} "
                            f"(torchrun --nproc-per-node {plan.replication_factor}) or change the option")


class Hooks:
    """What the engine loop (:mod:`accelbatch.backends.engine`) asks of a device; these defaults run one
    CPU process.

    ``forward(batch, bare)``: ``bare`` runs the module without replication wrappers (tails, eval);
    ``no_sync``: the context of a micro-batch whose gradients must not be all-reduced yet; ``loss_factor``:
    an extra loss scale (DDP averages over R); ``reduce``: all-reduce an update's gradients and loss sum,
    returning the summed loss; ``step``: apply an update whose loss the host saw finite;
    ``host_check``: read this update's NaN flag on the host now, else
    ``step_unless(flag, update)`` steps where the device-side flag is clear and ``rollback(update)`` undoes
    what such steps left off the device before the call raises; ``to_host``: the call's one host wait.
    """

    device = torch.device("cpu")
    copier: Copier | None = None   # None: batches are used where they are
    prefetch = True                # copy update by update (else the whole call at once)

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None):
        self.model, self.module, self.optimizer = model, model, optimizer

    def set_training(self, training: bool) -> None:
        if self.module.training != training:
            self.module.train(training)

    def forward(self, batch: TensorBatch, bare: bool) -> Mapping[str, torch.Tensor]:
        return self.model(batch)

    def generator(self) -> torch.Generator | None:
        """The generator the model's random ops (dropout) draw from, seeded per micro-batch
        (:mod:`accelbatch.streams`)."""
        return torch.default_generator

    def no_sync(self, last: bool, bare: bool) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def loss_factor(self, bare: bool) -> float:
        return 1.0

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def reduce(self, loss_sum: torch.Tensor, bare: bool) -> torch.Tensor:
        return loss_sum

    def step(self) -> int:
        """Apply the update (the host has seen its loss finite); the host reads it made (0 or more)."""
        self.optimizer.step()
        return 0

    def host_check(self) -> bool:
        return True

    def step_unless(self, flag: torch.Tensor, update: int) -> None:
        raise NotImplementedError

    def rollback(self, update: int) -> None:
        pass

    def on_device(self, batch: Any) -> bool:
        return True

    def to_host(self, tree: Any) -> Any:
        return tree


@dataclass
class StepResult:
    """What one host call returns.

    ``outputs`` holds the per-row outputs the plan's output mode selected, ``rows`` the indices of the
    call's input rows they belong to (``None`` when outputs are not per row, as with Sum), ``loss`` the
    mean loss over the micro-batches the output mode returns (all of them for Sum) in the applied updates,
    as an IPU returns them, so every backend reports the same figure for the same plan, and ``loss_parts``
    those micro-batches' (first row, end row, mean loss) in the rows given, where the engine has them (an
    agent weighs each by its labelled rows: one of context turns alone has loss 0); ``updates`` the
    weight updates applied (``extras["skipped_updates"]`` counts those --skip-nan skipped).
    """

    outputs: dict[str, torch.Tensor]
    rows: torch.Tensor | None
    loss: float | None
    updates: int = 0
    extras: dict[str, Any] = field(default_factory=dict)
    loss_parts: tuple[tuple[int, int, float], ...] | None = None


class Engine(ABC):
    """A model (and optimizer) compiled for one execution plan on one backend."""

    model: torch.nn.Module
    # a training run's steps (run() sets it around them, not its evaluations): replicas then decide together
    # whether a call trains (:meth:`trains`)
    train_together: bool = False

    def trains(self, labelled: bool) -> bool:
        """Whether a call trains: its rows have labels. Replicas of a training run decide together (see
        :class:`~accelbatch.backends.engine.LayoutEngine`); one process alone decides by its rows."""
        return labelled

    @abstractmethod
    def train_step(self, batch: TensorBatch) -> StepResult:
        """Forward, backward and weight updates over one combined batch."""

    @abstractmethod
    def eval_step(self, batch: TensorBatch) -> StepResult:
        """Forward only; returns every row's outputs, whatever the output mode."""

    @property
    def stages(self) -> bool:
        """Whether :meth:`stage` does anything (a device batches are copied to): callers look ahead only then."""
        return False

    def stage(self, batch: TensorBatch) -> None:
        """Start moving ``batch`` to the device ahead of the step that will be given this very object;
        call it one batch ahead, before stepping the current one. Engines that need no copy ignore it."""

    def host_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose state a checkpoint holds (None: weights only)."""
        return getattr(self, "optimizer", None)

    def loss_scaler(self) -> Any:
        """The fp16 loss scaler (a ``GradScaler``) whose state a checkpoint holds; None without one."""
        return getattr(getattr(self, "hooks", None), "scaler", None)

    def state_dict(self) -> dict[str, Any]:
        """``{"model", "optimizer"?, "scaler"?}``: the scaler's scale and growth tracker with fp16, so that
        a resume goes on at the scale it had reached (not at the initial 65536)."""
        state = {"model": self.model.state_dict()}
        optimizer = self.host_optimizer()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        scaler = self.loss_scaler()
        if scaler is not None and scaler.is_enabled():
            state["scaler"] = scaler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        optimizer = self.host_optimizer()
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])
            if "ipu_state" in state["optimizer"]:  # what the IPU kept: its own format, no torch state beside it
                log.warning(f"the checkpoint's {type(optimizer).__name__} state was kept by an IPU (the "
                            "device's format), which this device cannot read: it starts afresh (resume with "
                            "--device ipu to continue it)")
        scaler = self.loss_scaler()
        if scaler is not None and scaler.is_enabled() and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])


class Backend(ABC):
    """Sets up a device, compiles models into engines, runs collectives across replicas, tears down."""

    name: ClassVar[str]
    # whether a training call whose rows are not a multiple of D x R x G (--no-drop-last's tail) can run
    runs_partial_tails: ClassVar[bool] = True
    topology: Topology = Topology()     # replaced by setup(); immutable, so the shared default is safe
    options: EngineOptions = EngineOptions()

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, "") when usable here, else (False, reason the user can act on).

        A backend whose availability depends on the options (the IPU backend's emulator switch) may
        take them: ``is_available(cls, opts=None)``; :func:`get_backend` passes them when given.
        """

    def setup(self, opts: Opts) -> Topology:
        """Start what the backend needs (processes, devices); keep the engine options (``--skip-nan``,
        ``--mixed-precision``) for :meth:`compile`; return this process's topology (also kept as
        ``self.topology``)."""
        self.options = EngineOptions.from_opts(opts)
        self.topology = Topology()
        return self.topology

    @property
    def rank(self) -> int:
        """This process's replica index (0 without replication processes)."""
        return self.topology.rank

    @property
    def world_size(self) -> int:
        """Replica processes taking part (1 in a single process)."""
        return self.topology.world_size

    def is_main_process(self) -> bool:
        """True on the process that writes checkpoints and logs (rank 0)."""
        return self.topology.is_main

    @abstractmethod
    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: Any) -> Engine:
        """Wrap model and optimizer into an engine running the given execution plan."""

    def begin_run(self) -> None:
        """A run of ``accelbatch.run`` starts: what :meth:`report_extras` counts starts from here."""

    def report_extras(self) -> dict[str, Any]:
        """Entries this backend adds to the run's report (the IPU's compilations, for one); none here."""
        return {}

    # --- collectives (every replica calls them in the same order) ------------------------------------
    def collective_device(self) -> torch.device:
        """Where the tensors of the collectives live: a device the process group's backend supports."""
        return torch.device("cpu")

    def barrier(self) -> None:
        """Wait until every replica has reached this call."""
        if self.world_size > 1:
            token = torch.ones(1, device=self.collective_device())
            dist.all_reduce(token)
            token.tolist()  # the host waits for the all-reduce, which completes once every replica joined

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every replica's ``obj`` (picklable; tensors in it come back on the CPU), in rank order."""
        if self.world_size == 1:
            return [obj]
        device, world = self.collective_device(), self.world_size
        data = pickle.dumps(map_tensors(obj, lambda t: t.detach().cpu()))
        size = torch.tensor([len(data)], dtype=torch.int64, device=device)
        sizes = [torch.zeros_like(size) for _ in range(world)]
        dist.all_gather(sizes, size)
        lengths = [int(n) for n in torch.cat(sizes).tolist()]
        payload = torch.zeros(max(lengths), dtype=torch.uint8, device=device)
        payload[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device)
        parts = [torch.empty_like(payload) for _ in range(world)]
        dist.all_gather(parts, payload)
        return [pickle.loads(part[:n].cpu().numpy().tobytes()) for part, n in zip(parts, lengths)]

    def decide(self, *flags: bool) -> tuple[bool, ...]:
        """Each flag True on every replica when it is True on any (one all-reduce for all of them), so that
        "save now" or "stop now" happens at the same step everywhere."""
        if self.world_size == 1 or not flags:
            return tuple(bool(f) for f in flags)
        value = torch.tensor([1.0 if f else 0.0 for f in flags], device=self.collective_device())
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return tuple(v > 0 for v in value.tolist())

    def reduce_metrics(self, metrics: Any) -> Any:
        """Sum metrics over the replicas: a mapping of numbers / tensors / lists / nested mappings, or an
        object with ``state()`` and ``merge_state()`` (merged). Keys present on some replicas only are
        kept; send averages as sums and counts. Identity in a single process."""
        if self.world_size == 1:
            return metrics
        if hasattr(metrics, "state") and hasattr(metrics, "merge_state"):
            merged = type(metrics)()
            for state in self.all_gather_object(metrics.state()):
                merged.merge_state(state)
            return merged
        total: Any = None
        for part in self.all_gather_object(dict(metrics)):
            total = _add(total, part)
        return total

    def teardown(self) -> None:
        """Release processes and devices; safe to call twice."""


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


def _load(name: str) -> type[Backend]:
    module_name, _, cls_name = BACKEND_PATHS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise BackendUnavailable(f"--device {name}: its module {module_name} does not import "
                                 f"({type(exc).__name__}: {exc})") from exc
    return getattr(module, cls_name)


def _check_available(cls: type[Backend], opts: Opts | None) -> tuple[bool, str]:
    """``cls.is_available(opts)`` when it takes the options (and they are given), else ``is_available()``."""
    if opts is not None and _takes_options(cls):
        return cls.is_available(opts)  # type: ignore[call-arg]
    return cls.is_available()


def _takes_options(cls: type[Backend]) -> bool:
    try:
        return len(inspect.signature(cls.is_available).parameters) >= 1
    except (TypeError, ValueError):
        return False


def available_backends(opts: Opts | None = None) -> dict[str, str]:
    """Each registered backend name -> "" if usable here (with ``opts``, if given), else why it is not."""
    out = {}
    for name in BACKEND_PATHS:
        try:
            ok, why = _check_available(_load(name), opts)
        except BackendUnavailable as exc:
            ok, why = False, str(exc).split(": ", 1)[-1]
        out[name] = "" if ok else why
    return out


def get_backend(name: str, opts: Opts | None = None) -> type[Backend]:
    """The backend class registered as ``name``; a clear error listing the usable ones otherwise.

    ``opts`` (optional) lets a backend's availability depend on the options, e.g. ``--ipu-emulator``.
    """
    if name not in BACKEND_PATHS:
        raise BackendUnavailable(
            f"--device {name!r} is unknown; known devices: {', '.join(BACKEND_PATHS)}")
    cls = _load(name)
    ok, why = _check_available(cls, opts)
    if not ok:
        usable = [n for n, reason in available_backends(opts).items() if not reason]
        raise BackendUnavailable(f"--device {name}: {why}. Usable here: {', '.join(usable) or 'none'} "
                                 "(pick one with --device)")
    return cls
