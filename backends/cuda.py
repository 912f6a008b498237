"""CUDA backend on Hugging Face accelerate: the execution plan on a GPU, fed without stalls.

* Placement, mixed precision and DDP come from ``accelerate`` (one :class:`accelerate.Accelerator` per
  process, see :func:`make_accelerator`); ``Accelerator(cpu=True)`` runs the very same code on the CPU,
  which is how it is tested without a GPU.
* A call is the one loop of :mod:`accelbatch.backends.engine` with :class:`AccelerateHooks`, so the same
  plan gives the same numbers as the CPU engine (layout, loss weights, update order, outputs, loss).
* Feeding: host rows are pinned and copied with ``non_blocking=True`` on a side stream
  (:mod:`accelbatch.backends.prefetch`). Inside a call the rows of update u+1 are copied once update u's
  kernels are queued; ``engine.stage(next_batch)``, called before stepping the current batch, has the next
  call pinned on one helper thread at once (while this thread steps the current call) and copied once the
  current call's kernels are queued, so both overlap the device's work. ``accelbatch train --device cuda``
  stages every call one step ahead (the loader front end, with or without data workers).
* No host wait inside a call: updates are queued back to back and the call ends with one wait, after
  which the loss, the NaN flags and the selected outputs are read together (``engine.host_syncs``). The
  NaN policy keeps its flag on the device (:class:`StepGuard`), and so does fp16's loss scaler
  (:class:`~accelbatch.backends.scaler.LossScaler`: an overflow masks the step through the same guard).
  Exceptions, each one wait per update: the first update while the optimizer has no state yet,
  and ``--skip-nan`` or fp16 with an optimizer that keeps state on the host (torch's Adam/AdamW unless
  ``fused=True`` or ``capturable=True``); with R processes and ``--no-drop-last``, one small all-reduce of
  shard sizes per call.
* Replication: one process per replica, launched by ``torchrun``/``accelerate launch`` (or
  :func:`spawn_cuda_replicas` on one node); accelerate joins the group and wraps the model in DDP. DDP
  averages over R, so a micro-batch's loss is scaled by ``weight x R``. An epoch tail may leave a replica
  with fewer micro-batches than another, which DDP cannot all-reduce: tails run the bare module under
  ``no_sync`` and all-reduce the gradients explicitly (one flat buffer with the loss). Each update's
  loss is all-reduced (on the device), so every replica skips or stops at the same update.
* The optimizer step, ``zero_grad`` and ``backward`` call torch (and the device-side loss scaler for
  fp16) directly for one device or DDP: accelerate's optimizer wrapper and GradScaler add per-step host
  work that an engine doing its own accumulation does not need.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import os
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from accelbatch.plan import ExecutionPlan, PlanError

from . import distributed
from .base import MIXED_PRECISION, Backend, EngineOptions, Hooks, Replicas, TensorBatch, Topology
from .engine import LayoutEngine
from .prefetch import Copier, copier_for, map_tensors, tensors_of
from .scaler import LossScaler

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accelbatch.opts import Opts


def cuda_unavailable_reason() -> str | None:
    """Why ``--device cuda`` cannot run here (None when it can)."""
    if torch.cuda.is_available():
        return None if importlib.util.find_spec("accelerate") else (
            "Hugging Face accelerate, which the cuda backend runs on, is not installed: pip install "
            "'accelbatch[cuda]' (or pip install accelerate)")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    shown = "unset" if visible is None else repr(visible)
    why = f"no CUDA GPU is visible (torch.cuda.device_count() == 0; CUDA_VISIBLE_DEVICES={shown})"
    if torch.version.cuda is None:
        why += (f"; this torch ({torch.__version__}) is built without CUDA: install a CUDA build of torch "
                "to use a GPU")
    elif visible is not None and visible.strip() in ("", "-1"):
        why += "; CUDA_VISIBLE_DEVICES hides every GPU: unset it or name a GPU index"
    else:
        why += "; check the NVIDIA driver (nvidia-smi)"
    return why


def make_accelerator(cpu: bool = False, mixed_precision: str = "no",
                     group_timeout_s: float | None = None, static_graph: bool = False) -> Accelerator:
    """An ``Accelerator`` for this process (``cpu=True``: the CPU; else the GPU of this rank).

    accelerate keeps one state per process, so every Accelerator of a process must run on the same device
    and, when one is asked for, with the same mixed precision; anything else is refused (PlanError): run
    it in a process of its own. ``mixed_precision`` "no" passes nothing on, leaving the choice to
    ``accelerate launch --mixed_precision`` or accelerate's config; bf16/fp16 are passed on.
    ``group_timeout_s`` (``--replica-timeout-s``): how long a collective waits when accelerate joins the
    process group. ``static_graph`` (``--ddp-static-graph``): DDP's static_graph.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, is_initialized
    from accelerate.utils import DistributedType

    if mixed_precision not in MIXED_PRECISION:
        raise PlanError(f"--mixed-precision: {mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}")
    if cpu and mixed_precision == "fp16":
        raise PlanError("--mixed-precision fp16 needs a GPU on accelerate (its CPU path has no GradScaler): "
                        "use bf16 or no, or --device cpu, which runs fp16 with torch's CPU GradScaler")
    if is_initialized():
        state = AcceleratorState()
        want_cpu = cpu or not torch.cuda.is_available()
        if (state.device.type == "cpu") != want_cpu or mixed_precision not in ("no", state.mixed_precision):
            raise PlanError(
                f"accelerate already runs this process on {state.device} with mixed precision "
                f"{state.mixed_precision} and keeps one state per process: an Accelerator on "
                f"{'the CPU' if want_cpu else 'the GPU'} with mixed precision {mixed_precision} needs a "
                "process of its own (start a new process for it)")
        if state.distributed_type != DistributedType.NO and not distributed.is_initialized():
            raise PlanError("accelerate's process group of this process was torn down; start a new process")
    from accelerate.utils import DistributedDataParallelKwargs

    kwargs: dict[str, Any] = {"cpu": cpu}
    if mixed_precision != "no":
        kwargs["mixed_precision"] = mixed_precision
    # DDP: gradients are views of its all-reduce buckets (no copy into and out of them, no second copy
    # of the gradients in memory)
    handlers: list[Any] = [DistributedDataParallelKwargs(gradient_as_bucket_view=True, static_graph=static_graph)]
    if group_timeout_s is not None:
        from datetime import timedelta

        from accelerate.utils import InitProcessGroupKwargs

        handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=group_timeout_s)))
    kwargs["kwargs_handlers"] = handlers
    return Accelerator(**kwargs)


class StepGuard:
    """An optimizer step that takes effect only where a device-side flag is clear; the flag is not read.

    Optimizers with amp-scaling support (``fused=True``) get the flag as ``found_inf`` and skip in their
    kernel. Others are stepped, then their parameters and device-side state are put back where the flag
    is set, from a copy taken before the step (memory for one more copy of them). The flag must be read
    on the host instead (:meth:`needs_host`) before the first applied step while a parameter has no state
    yet (state created by a step cannot be put back), and, with ``skip``, when the optimizer keeps state
    off the device. Without ``skip`` such state is saved before each masked update and put back by
    :meth:`rollback` (every update from the first bad one on is masked, so that is the state to keep).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, device: torch.device, skip: bool):
        self.optimizer, self.device, self.skip = optimizer, device, skip
        self.fused = bool(getattr(optimizer, "_step_supports_amp_scaling", False))
        self.primed = False            # a step was applied through this guard's engine
        self._copies: list[torch.Tensor] = []
        self._host: dict[int, list[tuple[dict, Any, Any]]] = {}

    def _state(self, on_device: bool) -> list[tuple[dict, Any]]:
        """(state dict, key) of the optimizer's state entries on the device (or off it)."""
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                for key, value in self.optimizer.state.get(p, {}).items():
                    if (isinstance(value, torch.Tensor) and value.device == self.device) == on_device:
                        out.append((self.optimizer.state[p], key))
        return out

    def has_host_state(self) -> bool:
        """Whether the optimizer keeps state off the device (torch's Adam: ``step`` unless fused/capturable)."""
        return bool(self._state(on_device=False))

    def needs_host(self) -> bool:
        state = self.optimizer.state
        if not self.primed and any(p not in state for g in self.optimizer.param_groups for p in g["params"]):
            return True
        return self.skip and self.has_host_state()

    def step(self, do_step: Callable[[], None], flag: torch.Tensor, update: int) -> None:
        if update == 0:
            self._host.clear()
        if not self.skip:
            self._host[update] = [(d, k, copy.deepcopy(d[k])) for d, k in self._state(on_device=False)]
        if self.fused:
            self.optimizer.found_inf = flag.float()  # read by fused optimizers' step, as GradScaler sets it
            try:
                do_step()
            finally:
                del self.optimizer.found_inf
            return
        targets: list[tuple[Any, Any]] = [(g["params"], i) for g in self.optimizer.param_groups
                                          for i in range(len(g["params"]))]
        targets += self._state(on_device=True)
        with torch.no_grad():
            now = [c[k] for c, k in targets]
            if [(t.shape, t.dtype) for t in self._copies] != [(t.shape, t.dtype) for t in now]:
                self._copies = [t.detach().clone() for t in now]
            else:
                for saved, t in zip(self._copies, now):
                    saved.copy_(t)
            do_step()
            for (c, k), saved in zip(targets, self._copies):
                c[k].copy_(torch.where(flag, saved, c[k]))

    def rollback(self, update: int) -> None:
        for d, k, value in self._host.get(update, []):
            d[k] = value


class AccelerateHooks(Hooks):
    """The engine's device work through an ``Accelerator`` (see the module docstring)."""

    def __init__(self, accelerator: Accelerator, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None, options: EngineOptions, prefetch: bool = True,
                 copier: Copier | None = None):
        from accelerate.utils import DistributedType

        super().__init__(model, optimizer)
        device = accelerator.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device, self.accelerator, self.world = device, accelerator, accelerator.num_processes
        if optimizer is None:
            self.module, self.wrapped = accelerator.prepare(model), None
        else:
            self.module, self.wrapped = accelerator.prepare(model, optimizer)
        self.direct = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU,
                                                        DistributedType.MULTI_CPU)
        # fp16: our device-side scaler where we step ourselves (no host read per update); accelerate's
        # GradScaler where accelerate steps (DeepSpeed, FSDP, ...)
        self.scaler: Any = accelerator.scaler
        if self.direct and self.scaler is not None:
            self.scaler = LossScaler(device)
        self.guard = StepGuard(optimizer, device, options.skip_nan) if optimizer is not None else None
        self.copier = copier if copier is not None else copier_for(device)
        self.prefetch = prefetch
        # --compile: the bare module (tails, eval) and the wrapped one (DDP) each through torch.compile
        self.run_bare: Any = torch.compile(model) if options.compile else model
        self.run_wrapped: Any = self.run_bare if self.module is model else (
            torch.compile(self.module) if options.compile else self.module)
        # --ddp-static-graph: DDP records the graph in its first iteration, which must all-reduce (a
        # backward under no_sync, or through the bare module, then fails inside DDP's reducer), so the
        # first update all-reduces after each of its micro-batches: the same sum, G - 1 more all-reduces once
        self.graph_pending = options.ddp_static_graph and self.world > 1 and self.module is not model

    def forward(self, batch: TensorBatch, bare: bool) -> Mapping[str, torch.Tensor]:
        return (self.run_bare if bare else self.run_wrapped)(batch)

    def generator(self) -> torch.Generator | None:
        if self.device.type == "cuda":
            return torch.cuda.default_generators[self.device.index]
        return torch.default_generator

    def no_sync(self, last: bool, bare: bool) -> Any:
        if bare and self.graph_pending:
            raise PlanError("--ddp-static-graph: the run's first call is an epoch tail (fewer micro-batches on "
                            "some replicas), and DDP records its static graph from a full update: train on "
                            "more data than one call, or leave --ddp-static-graph out")
        if self.world == 1 or (last and not bare) or self.graph_pending:
            return super().no_sync(last, bare)
        return self.accelerator.no_sync(self.module)

    def loss_factor(self, bare: bool) -> float:
        return float(self.world) if self.world > 1 and not bare else 1.0

    def zero_grad(self) -> None:
        (self.optimizer if self.direct else self.wrapped).zero_grad(set_to_none=True)

    def backward(self, loss: torch.Tensor) -> None:
        if not self.direct:
            self.accelerator.backward(loss)
        elif self.scaler is not None:
            self.scaler.scale(loss).backward()
        else:
            loss.backward()

    def reduce(self, loss_sum: torch.Tensor, bare: bool) -> torch.Tensor:
        if self.world == 1:
            return loss_sum
        if not bare:
            self.graph_pending = False
            dist.all_reduce(loss_sum)
            return loss_sum
        # a tail: DDP did not all-reduce (see the module docstring); gradients and loss in one flat buffer
        params = [p for p in self.model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        dtype = functools.reduce(torch.promote_types, [p.grad.dtype for p in params], torch.float32)
        flat = torch.cat([p.grad.reshape(-1).to(dtype) for p in params] + [loss_sum.reshape(1).to(dtype)])
        dist.all_reduce(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
            offset += p.numel()
        return flat[-1]

    def _params(self) -> list[torch.nn.Parameter]:
        return [p for g in self.optimizer.param_groups for p in g["params"]]

    def _optimizer_step(self) -> None:
        self.optimizer.step()
        if self.guard is not None:
            self.guard.primed = True

    def step(self) -> int:
        if not self.direct:
            self.wrapped.step()
            return 0
        if self.scaler is None:
            self._optimizer_step()
            return 0
        # the host path (the optimizer has no state yet, or keeps it off the device): read the overflow flag
        found = self.scaler.unscale_(self._params())
        if not found.item():
            self._optimizer_step()
        self.scaler.update(found)
        return 1

    def host_check(self) -> bool:
        # fp16 with state off the device: an overflow-masked step would leave it advanced (no rollback then)
        return (self.guard is None or not self.direct or self.guard.needs_host()
                or (self.scaler is not None and self.guard.has_host_state()))

    def step_unless(self, flag: torch.Tensor, update: int) -> None:
        if self.scaler is None:
            self.guard.step(self._optimizer_step, flag, update)
            return
        # fp16 without a host read: an overflow masks the step as a bad loss does; the scale changes only
        # on updates the NaN policy lets through
        found = self.scaler.unscale_(self._params())
        self.guard.step(self._optimizer_step, flag | found, update)
        self.scaler.update(found, active=~flag)

    def rollback(self, update: int) -> None:
        if self.guard is not None:
            self.guard.rollback(update)

    def on_device(self, batch: Any) -> bool:
        return all(t.device == self.device for t in tensors_of(batch))

    def to_host(self, tree: Any) -> Any:
        if self.device.type == "cpu":
            return tree
        out = map_tensors(tree, lambda t: t.to("cpu", non_blocking=True))
        torch.cuda.current_stream(self.device).synchronize()
        return out


class CUDAEngine(LayoutEngine):
    """Runs an :class:`ExecutionPlan` through an ``Accelerator`` (see the module docstring).

    ``engine.model`` is the user's module (moved to the device in place), ``engine.module`` what
    accelerate prepared (DDP with R processes), ``engine.optimizer`` the user's torch optimizer.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan | None, accelerator: Accelerator, prefetch: bool = True,
                 copier: Copier | None = None, inputs: str = "shard", gather_outputs: bool = False,
                 options: EngineOptions | None = None):
        plan = plan if plan is not None else ExecutionPlan()
        options = options or EngineOptions()
        replicas = Replicas(rank=accelerator.process_index, world_size=accelerator.num_processes,
                            inputs=inputs, gather_outputs=gather_outputs)
        replicas.check(plan)
        hooks = AccelerateHooks(accelerator, model, optimizer, options, prefetch, copier)
        super().__init__(model, optimizer, plan, hooks, options, replicas)
        self.accelerator, self.module = accelerator, hooks.module


class CUDABackend(Backend):
    """``--device cuda``: accelerate on the GPU of this process (``cpu=True``: the same code on the CPU)."""

    name = "cuda"

    def __init__(self, cpu: bool = False, prefetch: bool = True) -> None:
        self.cpu = cpu
        self.prefetch = prefetch
        self.accelerator: Accelerator | None = None
        self._owns_group = False

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        why = cuda_unavailable_reason()
        return (why is None), (why or "")

    def setup(self, opts: Opts) -> Topology:
        """Make this process's Accelerator (joining the group torchrun describes); keep the engine options."""
        self.options = EngineOptions.from_opts(opts)
        had_group = distributed.is_initialized()
        self._make(getattr(opts, "replica_timeout_s", None))
        self._owns_group = not had_group and distributed.is_initialized()  # left again at teardown
        return self.topology

    def _make(self, group_timeout_s: float | None = None) -> Accelerator:
        if self.accelerator is None:
            acc = make_accelerator(cpu=self.cpu, mixed_precision=self.options.mixed_precision,
                                   group_timeout_s=group_timeout_s,
                                   static_graph=self.options.ddp_static_graph)
            self.accelerator = acc
            self.topology = Topology(rank=acc.process_index, world_size=acc.num_processes,
                                     local_rank=acc.local_process_index)
        return self.accelerator

    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                plan: ExecutionPlan | None = None, *, gather_outputs: bool = False,
                inputs: str = "shard") -> CUDAEngine:
        """A :class:`CUDAEngine`; ``inputs`` and ``gather_outputs`` apply with R processes, as for the CPU
        backend's ReplicatedEngine."""
        return CUDAEngine(model, optimizer, plan, self._make(), prefetch=self.prefetch, inputs=inputs,
                          gather_outputs=gather_outputs, options=self.options)

    def collective_device(self) -> torch.device:
        """The accelerator's device: an NCCL group has no CPU backend, so collectives use the GPU."""
        return self._make().device

    def teardown(self) -> None:
        if self.accelerator is not None:
            self.accelerator.free_memory()
            self.accelerator = None
        if self._owns_group:
            distributed.shutdown()
            self._owns_group = False
        self.topology = Topology()


def spawn_cuda_replicas(fn: Callable[..., Any], replicas: int, *args: Any, timeout_s: float | None = None,
                        cpu: bool = False, group_timeout_s: float = 300.0) -> list[Any]:
    """Run ``fn(rank, *args)`` in ``replicas`` spawned processes, one GPU each; return their results.

    For ``--device cuda --replication-factor R`` on one node. Each process gets torchrun's environment
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, a free ``MASTER_PORT``); the ``Accelerator`` made in it
    (:meth:`CUDABackend.setup`) joins the NCCL group on ``cuda:LOCAL_RANK``. ``cpu=True`` joins a gloo group
    instead (tests). ``group_timeout_s`` (``--replica-timeout-s``) bounds a wait in a collective. Errors and
    cleanup as :func:`accelbatch.backends.distributed.spawn_replicas`.
    """
    if not cpu:
        why = cuda_unavailable_reason()
        if why:
            raise PlanError(f"--replication-factor {replicas} on --device cuda: {why}")
        if torch.cuda.device_count() < replicas:
            raise PlanError(f"--replication-factor {replicas} on --device cuda needs {replicas} GPUs, "
                            f"{torch.cuda.device_count()} are visible: lower --replication-factor, or use "
                            f"--gradient-accumulation for the same combined batch on fewer GPUs")
    # spawned, not forked from the forkserver: a process that has touched the CUDA driver must not fork
    return distributed.spawn_replicas(fn, replicas, *args, timeout_s=timeout_s, init_process_group=cpu,
                                      backend="gloo", group_timeout_s=group_timeout_s,
                                      start_method=None if cpu else "spawn")


__all__ = ["AccelerateHooks", "CUDABackend", "CUDAEngine", "StepGuard", "cuda_unavailable_reason",
           "make_accelerator", "spawn_cuda_replicas"]
