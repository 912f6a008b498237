"""``--device ipu``: the execution plan on Graphcore IPUs through poptorch, or on its CPU emulator.

Which poptorch runs (:func:`select_poptorch`):

1. the emulator (:mod:`accelbatch.backends.poptorch_emulator`) when the user asks for it:
   ``--ipu-emulator`` (``Opts.ipu_emulator``) or ``ACCELBATCH_IPU_EMULATOR=1``;
2. otherwise the real ``poptorch`` when it imports (it ships with Graphcore's Poplar SDK);
3. otherwise ``--device ipu`` is unavailable, with a one-line reason naming the SDK and the switch.

An explicit request for the emulator wins over an installed poptorch, so the same command checks IPU code
on the CPU on an SDK machine too. :attr:`IPUBackend.implementation` says which one ran (``"poptorch"`` or
``"poptorch-emulator"``), :meth:`IPUBackend.describe` says it in words with the version, and
:attr:`IPUBackend.compilations` counts the graphs compiled by the engines this backend made.

The engine (:class:`~accelbatch.backends.ipu_engine.IPUEngine`) maps the plan to ``poptorch.Options`` and
runs ``trainingModel`` / ``inferenceModel`` (split over IPUs with ``--pipeline``, :mod:`.ipu_pipeline`);
:meth:`IPUBackend.make_loader` gives a ``poptorch.DataLoader``
with the plan's options for a dataset.
"""

from __future__ import annotations

import importlib
import logging
import os
from types import ModuleType
from typing import Any, Iterable

import torch

from accelbatch.plan import ExecutionPlan, PlanError, reserved_ipus

from .base import Backend, BackendUnavailable, Engine, TensorBatch
from .ipu_engine import IPUEngine, plan_options
from .ipu_latency import LatencyStats, combined
from .ipu_settings import IPUSettings

MAX_IPUS = 64  # IPUs one PopTorch process drives (more need distributed execution)

log = logging.getLogger("accelbatch.ipu")

EMULATOR_ENV = "ACCELBATCH_IPU_EMULATOR"
REAL = "poptorch"
EMULATOR = "poptorch-emulator"
_TRUE = ("1", "true", "yes", "on")
_MODES = {"sync": "Sync", "async": "Async", "async-rebatched": "AsyncRebatched", "asyncrebatched": "AsyncRebatched"}


def emulator_requested(opts: Any = None) -> bool:
    """``opts.ipu_emulator`` where it says (--no-ipu-emulator wins over the environment), else whether
    ``ACCELBATCH_IPU_EMULATOR`` is 1/true/yes/on."""
    said = getattr(opts, "ipu_emulator", None) if opts is not None else None
    if said is not None:
        return bool(said)
    return os.environ.get(EMULATOR_ENV, "").strip().lower() in _TRUE


def _import_real() -> tuple[ModuleType | None, str]:
    """(poptorch, "") when it imports, else (None, why not)."""
    try:
        module = importlib.import_module("poptorch")
    except ModuleNotFoundError as exc:
        if exc.name == "poptorch":
            return None, "poptorch is not installed"
        return None, f"poptorch failed to import ({type(exc).__name__}: {exc})"
    except Exception as exc:  # noqa: BLE001 - an SDK not enabled fails in many ways
        return None, f"poptorch failed to import ({type(exc).__name__}: {exc})"
    return module, ""


def unavailable_reason(why: str) -> str:
    return (f"{why}: it ships with Graphcore's Poplar SDK (not on PyPI; install and enable the SDK, then "
            "pip install its poptorch wheel), or run on the CPU emulator of poptorch with --ipu-emulator or "
            f"{EMULATOR_ENV}=1")


def select_poptorch(opts: Any = None) -> tuple[ModuleType, str]:
    """(the poptorch module, "poptorch" | "poptorch-emulator"); BackendUnavailable when there is none."""
    if emulator_requested(opts):
        from . import poptorch_emulator

        return poptorch_emulator, EMULATOR
    module, why = _import_real()
    if module is None:
        raise BackendUnavailable(unavailable_reason(why))
    return module, (EMULATOR if getattr(module, "IS_EMULATOR", False) else REAL)


class IPUBackend(Backend):
    """``--device ipu``: poptorch (or its emulator) running the execution plan."""

    name = "ipu"
    runs_partial_tails = False  # a graph has static shapes

    def __init__(self) -> None:
        self.poptorch: ModuleType | None = None
        self.implementation: str | None = None  # "poptorch" or "poptorch-emulator" once selected
        self.seed: int | None = None
        self.engines: list[IPUEngine] = []
        self._counted_from = (0, 0)  # (compilations, cache loads) before this run: see begin_run
        self.settings = IPUSettings()
        self.replicas = 1

    @classmethod
    def is_available(cls, opts: Any = None) -> tuple[bool, str]:
        try:
            select_poptorch(opts)
        except BackendUnavailable as exc:
            return False, str(exc)
        return True, ""

    def setup(self, opts: Any) -> None:
        """Pick poptorch or the emulator for ``opts`` (see :func:`select_poptorch`); keep the seed."""
        if getattr(opts, "compile", False):
            raise PlanError("--compile applies to --device cpu and cuda (torch.compile); poptorch compiles "
                            "every model for the IPU itself: leave it out")
        self.settings = IPUSettings.from_opts(opts)
        replicas = self.replicas = int(getattr(opts, "replication_factor", 1) or 1)
        per_replica = self.settings.pipeline.ipus_per_replica
        if replicas * per_replica > MAX_IPUS:
            fits = 1 << ((MAX_IPUS // per_replica).bit_length() - 1)
            raise PlanError(f"-rf/--replication-factor {replicas}: {replicas} replicas x {per_replica} IPU(s) = "
                            f"{replicas * per_replica} IPUs, and PopTorch drives at most {MAX_IPUS} from one process "
                            f"(more need distributed execution, poprun); use -rf {fits} or fewer")
        reserved = reserved_ipus(replicas)
        self.settings.pipeline.check_replicas(replicas)
        if reserved != replicas and self.settings.pipeline.stages == 1:
            below = 1 << (replicas.bit_length() - 1)
            raise PlanError(f"-rf/--replication-factor {replicas}: an IPU system reserves a power of 2 or a "
                            f"multiple of 64 IPUs, so {replicas} replicas would hold {reserved} IPUs with "
                            f"{reserved - replicas} idle (PopTorch refuses it); use -rf {below} or {reserved}")
        self._select(opts)
        seed = getattr(opts, "seed", None)
        self.seed = int(seed) if seed is not None else None

    def _select(self, opts: Any = None) -> ModuleType:
        if self.poptorch is None:
            self.poptorch, self.implementation = select_poptorch(opts)
            if self.implementation == EMULATOR:
                log.info("ipu: running on the CPU emulator of poptorch (%s)", self.poptorch.__version__)
        return self.poptorch

    def describe(self) -> str:
        """Which poptorch runs, in words (for the run's report)."""
        if self.poptorch is None:
            return "ipu (poptorch not selected yet)"
        version = getattr(self.poptorch, "__version__", "?")
        where = "CPU emulator of poptorch" if self.implementation == EMULATOR else "poptorch on IPU"
        return f"ipu: {where} {version}"

    @property
    def compilations(self) -> int:
        """Graphs compiled by every engine this backend made (graphs loaded from --ipu-cache-dir left out)."""
        return sum(e.compilations for e in self.engines)

    @property
    def latency(self) -> dict[str, float] | None:
        """Round-trip latency figures over every engine's calls (see :mod:`.ipu_latency`), or None."""
        return combined(e.latency for e in self.engines).report()

    @property
    def cache_loads(self) -> int:
        """Graphs loaded from --ipu-cache-dir instead of compiled."""
        return sum(e.cache_loads for e in self.engines)

    def begin_run(self) -> None:
        """Report this run's compilations, cache loads and latencies alone: an agent's engines serve every run
        of worlds built on it (``create_world(opts, agent=...)``)."""
        self._counted_from = (self.compilations, self.cache_loads)
        for engine in self.engines:
            engine.latency = LatencyStats()

    def report_extras(self) -> dict[str, Any]:
        """The report's ``ipu`` entry: which poptorch ran, graphs compiled (and loaded from --ipu-cache-dir),
        latency when the poptorch has getLatency (host-timed: it varies from run to run), --pipeline's
        stages, strategy and the IPUs the run holds."""
        out: dict[str, Any] = {"poptorch": self.implementation,
                               "compilations": self.compilations - self._counted_from[0]}
        out.update(self.latency or {})
        if self.settings.cache_dir is not None:
            out["cached"] = self.cache_loads - self._counted_from[1]
        pipeline = self.settings.pipeline
        if pipeline.stages > 1:
            out.update(stages=pipeline.stages, strategy=pipeline.strategy,
                       ipus=pipeline.ipus_per_replica * self.replicas)
        return {"ipu": out}

    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                plan: ExecutionPlan | None = None, *, max_executors: int = 16) -> Engine:
        """An :class:`IPUEngine` for ``plan`` (weights shared with ``model``; cast to float16 in place with
        --mixed-precision fp16, see :mod:`~accelbatch.backends.ipu_settings`)."""
        poptorch = self._select()
        self.settings.pipeline.check_names(model)  # a misspelt name first: the plan rules follow from the names
        self.settings.pipeline.check_plan(plan if plan is not None else ExecutionPlan())
        self.settings.pipeline.annotate(poptorch, model)
        self.settings.prepare(model, optimizer)
        engine = IPUEngine(poptorch, model, optimizer, plan, seed=self.seed, max_executors=max_executors,
                           settings=self.settings)
        self.engines.append(engine)
        return engine

    def options(self, plan: ExecutionPlan) -> Any:
        """``poptorch.Options`` for ``plan`` (the engine's mapping), e.g. for a loader or your own wrapper."""
        return plan_options(self._select(), plan, self.seed, self.settings)

    def make_loader(self, batches: Any, plan: Any, *, mode: Any = "sync", num_workers: int = 0,
                    drop_last: bool | None = None, rebatched_worker_size: int | None = None,
                    shuffle: bool = False, batch_size: int | None = None, **kwargs: Any) -> Iterable[TensorBatch]:
        """A ``poptorch.DataLoader`` over a dataset, with the plan's options.

        ``batches`` a ``torch.utils.data.Dataset`` (map-style or iterable): each element of the loader is
        one host call's combined batch (``batch_size`` defaults to the plan's micro batch).
        ``mode`` sync, async or async-rebatched (or a ``poptorch.DataLoaderMode``); ``drop_last`` defaults
        to the plan's; ``rebatched_worker_size``, ``num_workers``, ``shuffle`` and other keyword arguments
        (``collate_fn``, ``worker_init_fn``, ``async_options``) go to ``poptorch.DataLoader``. Anything
        else (an iterable of ready combined batches) is returned unchanged, as on the other backends.
        """
        if not isinstance(batches, (torch.utils.data.Dataset, torch.utils.data.IterableDataset)):
            return batches
        poptorch = self._select()
        if isinstance(mode, str):
            key = mode.strip().lower()
            if key not in _MODES:
                raise ValueError(f"--dataloader-mode: {mode!r} is not one of sync, async, async-rebatched")
            mode = getattr(poptorch.DataLoaderMode, _MODES[key])
        return poptorch.DataLoader(
            plan_options(poptorch, plan, self.seed, self.settings), batches,
            batch_size=plan.micro_batch if batch_size is None else batch_size, shuffle=shuffle,
            num_workers=num_workers, drop_last=plan.drop_last if drop_last is None else drop_last, mode=mode,
            rebatched_worker_size=rebatched_worker_size, **kwargs)

    def teardown(self) -> None:
        """Weights back to the host, graphs destroyed; safe to call twice."""
        for engine in self.engines:
            engine.close()


__all__ = ["IPUBackend", "EMULATOR", "EMULATOR_ENV", "REAL", "emulator_requested", "select_poptorch"]
