"""The Backend interface, the Engine it compiles, and the registry of backends by name."""

from __future__ import annotations

import importlib
import inspect
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Iterable

import torch

if TYPE_CHECKING:
    from accelbatch.opts import Opts

TensorBatch = dict[str, torch.Tensor]

# name -> "module:Class", imported only when asked for, so the core never imports torch.cuda or poptorch.
BACKEND_PATHS: dict[str, str] = {
    "cpu": "accelbatch.backends.cpu:CPUBackend",
    "cuda": "accelbatch.backends.cuda:CUDABackend",
    "ipu": "accelbatch.backends.ipu:IPUBackend",
}


class NonFiniteLoss(RuntimeError):
    """A training loss was NaN or infinite; the message says where and how to skip such steps."""


class BackendUnavailable(RuntimeError):
    """The named backend cannot run here; the message says why and lists those that can."""


@dataclass
class StepResult:
    """What one host call returns.

    ``outputs`` holds the per-row outputs the plan's output mode selected, ``rows`` the indices of the
    call's input rows they belong to (``None`` when outputs are not per row, as with Sum), ``loss`` the
    mean loss over the call's micro-batches, ``updates`` the weight updates done.
    """

    outputs: dict[str, torch.Tensor]
    rows: torch.Tensor | None
    loss: float | None
    updates: int = 0
    extras: dict[str, Any] = field(default_factory=dict)


class Engine(ABC):
    """A model (and optimizer) compiled for one execution plan on one backend."""

    model: torch.nn.Module

    @abstractmethod
    def train_step(self, batch: TensorBatch) -> StepResult:
        """Forward, backward and weight updates over one combined batch."""

    @abstractmethod
    def eval_step(self, batch: TensorBatch) -> StepResult:
        """Forward only; returns every row's outputs, whatever the output mode."""

    def host_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer whose state a checkpoint holds (None: weights only)."""
        return getattr(self, "optimizer", None)

    def state_dict(self) -> dict[str, Any]:
        state = {"model": self.model.state_dict()}
        optimizer = self.host_optimizer()
        if optimizer is not None:
            state["optimizer"] = optimizer.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        optimizer = self.host_optimizer()
        if optimizer is not None and "optimizer" in state:
            optimizer.load_state_dict(state["optimizer"])


class Backend(ABC):
    """Sets up a device, compiles models into engines, reduces metrics, tears down."""

    name: ClassVar[str]

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str]:
        """(True, "") when usable here, else (False, reason the user can act on).

        A backend whose availability depends on the options (the IPU backend's emulator switch) may
        take them: ``is_available(cls, opts=None)``; :func:`get_backend` passes them when given.
        """

    def setup(self, opts: "Opts") -> None:
        """Start whatever the backend needs (processes, devices)."""

    @property
    def rank(self) -> int:
        """This process's replica index (0 without replication processes)."""
        return 0

    @property
    def world_size(self) -> int:
        """Replica processes taking part (1 in a single process)."""
        return 1

    def is_main_process(self) -> bool:
        """True on the process that writes checkpoints and logs (rank 0)."""
        return self.rank == 0

    def make_loader(self, batches: Iterable[TensorBatch], plan: Any) -> Iterable[TensorBatch]:
        """Wrap an iterable of combined batches for this device (pinned memory, prefetch, poptorch's
        DataLoader...); the default hands them over unchanged."""
        return batches

    @abstractmethod
    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, plan: Any) -> Engine:
        """Wrap model and optimizer into an engine running the given execution plan."""

    def reduce_metrics(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Combine metrics across replicas/processes; identity for a single process."""
        return metrics

    def teardown(self) -> None:
        """Release processes and devices; safe to call twice."""


def _load(name: str) -> type[Backend]:
    module_name, _, cls_name = BACKEND_PATHS[name].partition(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and exc.name.startswith("accelbatch.backends"):
            raise BackendUnavailable(f"--device {name}: this backend is not built yet") from None
        raise
    return getattr(module, cls_name)


def _check_available(cls: type[Backend], opts: "Opts | None") -> tuple[bool, str]:
    """``cls.is_available(opts)`` when it takes the options (and they are given), else ``is_available()``."""
    if opts is not None and _takes_options(cls):
        return cls.is_available(opts)  # type: ignore[call-arg]
    return cls.is_available()


def _takes_options(cls: type[Backend]) -> bool:
    try:
        return len(inspect.signature(cls.is_available).parameters) >= 1
    except (TypeError, ValueError):
        return False


def available_backends(opts: "Opts | None" = None) -> dict[str, str]:
    """Each registered backend name -> "" if usable here (with ``opts``, if given), else the reason it is not."""
    out = {}
    for name in BACKEND_PATHS:
        try:
            ok, why = _check_available(_load(name), opts)
        except BackendUnavailable as exc:
            ok, why = False, str(exc).split(": ", 1)[-1]
        out[name] = "" if ok else why
    return out


def get_backend(name: str, opts: "Opts | None" = None) -> type[Backend]:
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
