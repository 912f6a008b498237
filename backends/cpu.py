"""CPU backend: the execution plan run in one process, or replicated over torch.distributed (gloo).

Both engines are the one loop of :mod:`accelbatch.backends.engine` with CPU hooks:

* :class:`PlanEngine` (one process): with R > 1 the replicas are simulated in this process, each adding
  up its own micro-batches' gradients, then the replicas' added in replica order, as R processes'
  all-reduce (and the IPU emulator) add them: the same weights, to the bit.
  Micro-batches are views of the combined batch (no copy). ``--mixed-precision bf16|fp16`` runs the
  forward under CPU autocast (outputs come back in fp32); fp16 also scales the loss
  (:class:`~accelbatch.backends.scaler.LossScaler`, GradScaler's policy, shared with the CUDA engine: an
  update whose gradients overflow is not applied and the scale lowered). A torch without fp16 CPU
  autocast refuses fp16 in one line.
* :class:`ReplicatedEngine` (R processes, torch.distributed initialised with ``world_size == R``): each
  process runs its replica's micro-batches (``inputs="shard"``: it is given its ``[D, G, b]`` slice,
  ``plan.shard(batch, rank)``; ``inputs="full"``: it is given the whole call and keeps its rows). The
  gradients live in one flat buffer (each ``param.grad`` is a view of it) with the update's loss in one
  more slot, so an update costs one ``all_reduce``; micro-batch losses are pre-scaled by the layout's
  weights, so the all-reduced sum is the update's gradient, and every replica sees the same loss, so all
  skip (or stop at) the same non-finite update. Initial weights and buffers are broadcast from rank 0.
  With ``drop_last=False`` a call first all-reduces the shard sizes (not needed with ``inputs="full"``).
  Outputs: each process gets its own replica's, ``rows`` indexing what it was given; with
  ``gather_outputs=True`` every rank gets the whole call's in the plan's order. ``eval_step`` is local.
  Metrics: with sharded inputs every process scores its own rows and :meth:`CPUBackend.reduce_metrics`
  sums them; with ``inputs="full"`` every process sees every row, so take metrics from rank 0 unsummed.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from accelbatch.plan import ExecutionPlan, OutputMode, PlanError

from . import distributed
from .base import Backend, EngineOptions, Hooks, Replicas, TensorBatch, Topology
from .engine import LayoutEngine
from .scaler import LossScaler

FP16_ON_CPU = (f"--mixed-precision fp16 on the CPU needs a torch with fp16 CPU autocast and CPU loss-scaling "
               f"kernels (this is {torch.__version__}): upgrade torch, or use bf16 or no")
AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def fp16_on_cpu_supported() -> bool:
    """Whether this torch runs fp16 autocast on the CPU and unscales gradients there (torch >= 2.4)."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # an older torch warns and disables autocast instead
            with torch.autocast("cpu", dtype=torch.float16):
                ok = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.float16
        grad = torch.ones(1)
        torch._amp_foreach_non_finite_check_and_unscale_([grad], torch.zeros(1), torch.ones(()))
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False
    return ok


def check_mixed_precision_on_cpu(mixed_precision: str) -> None:
    """Refuse fp16 in one line when this torch cannot run it on the CPU."""
    if mixed_precision == "fp16" and not fp16_on_cpu_supported():
        raise PlanError(FP16_ON_CPU)


class CPUHooks(Hooks):
    """The CPU in one process; ``bf16``/``fp16``: the forward under CPU autocast, its outputs returned in
    fp32; ``fp16`` also scales the loss (``self.scaler``, a :class:`LossScaler`; None otherwise)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 mixed_precision: str = "no", compile: bool = False):
        check_mixed_precision_on_cpu(mixed_precision)
        super().__init__(model, optimizer)
        self.autocast = AUTOCAST_DTYPES.get(mixed_precision)
        self.scaler = LossScaler("cpu") if mixed_precision == "fp16" else None
        self.run: Any = torch.compile(model) if compile else model   # shares the model's parameters

    def forward(self, batch: TensorBatch, bare: bool) -> Mapping[str, torch.Tensor]:
        if self.autocast is None:
            return self.run(batch)
        with torch.autocast("cpu", dtype=self.autocast):
            out = self.run(batch)
        return {k: v.float() if v.dtype in (torch.bfloat16, torch.float16) else v for k, v in out.items()}

    def backward(self, loss: torch.Tensor) -> None:
        (loss if self.scaler is None else self.scaler.scale(loss)).backward()

    def step(self) -> int:
        if self.scaler is None:
            self.optimizer.step()
            return 0
        found = self.scaler.unscale_(p for g in self.optimizer.param_groups for p in g["params"])
        if not found.item():  # applied unless a gradient overflowed (reading a CPU tensor waits for nothing)
            self.optimizer.step()
        self.scaler.update(found)
        return 1


class FlatGradHooks(CPUHooks):
    """One replica of R gloo processes: gradients and the update's loss in one flat all-reduced buffer."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, group: Any,
                 mixed_precision: str = "no", compile: bool = False):
        super().__init__(model, optimizer, mixed_precision, compile)
        self.group = group
        self.params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self.params}
        if len(dtypes) > 1:
            raise PlanError(f"ReplicatedEngine needs parameters of one dtype, found "
                            f"{sorted(map(str, dtypes))}")
        self.flat = torch.zeros(sum(p.numel() for p in self.params) + 1,
                                dtype=dtypes.pop() if dtypes else torch.float32)  # grads, then the loss
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()

    def zero_grad(self) -> None:
        self.flat.zero_()
        for p, v in zip(self.params, self.views):
            p.grad = v

    def reduce(self, loss_sum: torch.Tensor, bare: bool) -> torch.Tensor:
        for p, v in zip(self.params, self.views):
            if p.grad is not v:  # something replaced the grad tensor: fold it back into the bucket
                if p.grad is not None:
                    v.copy_(p.grad)
                p.grad = v
        self.flat[-1] = loss_sum
        dist.all_reduce(self.flat, group=self.group)
        return self.flat[-1].clone()


class PlanEngine(LayoutEngine):
    """Runs an :class:`ExecutionPlan` in the calling process (replicas, if any, simulated in order)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan | None = None, options: EngineOptions | None = None):
        options = options or EngineOptions()
        hooks = CPUHooks(model, optimizer, options.mixed_precision, options.compile)
        super().__init__(model, optimizer, plan, hooks, options)


class ReplicatedEngine(LayoutEngine):
    """One replica of a synchronous data-parallel plan over torch.distributed (see the module docstring).

    Every process of the group builds one with the same plan (``replication_factor == world_size``) and
    calls ``train_step`` with its shard (or, with ``inputs="full"``, the whole call), in step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan, group: Any = None, gather_outputs: bool = False,
                 inputs: str = "shard", broadcast_init: bool = True, options: EngineOptions | None = None):
        if not distributed.is_initialized():
            raise PlanError("ReplicatedEngine needs torch.distributed initialised (use "
                            "accelbatch.backends.distributed.spawn_replicas, or torchrun)")
        options = options or EngineOptions()
        replicas = Replicas(rank=dist.get_rank(group), world_size=dist.get_world_size(group), group=group,
                            inputs=inputs, gather_outputs=gather_outputs)
        replicas.check(plan)
        hooks = FlatGradHooks(model, optimizer, group, options.mixed_precision, options.compile)
        super().__init__(model, optimizer, plan, hooks, options, replicas)
        if broadcast_init:
            _broadcast_state(model, group)


def _broadcast_state(model: torch.nn.Module, group: Any) -> None:
    """Rank 0's parameters and buffers to every replica (one broadcast per dtype)."""
    tensors = [t for t in list(model.parameters()) + list(model.buffers())
               if t.is_floating_point() or t.dtype in (torch.int64, torch.int32)]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    with torch.no_grad():
        for ts in by_dtype.values():
            flat = torch.cat([t.detach().reshape(-1) for t in ts])
            dist.broadcast(flat, src=0, group=group)
            offset = 0
            for t in ts:
                t.copy_(flat[offset:offset + t.numel()].view_as(t))
                offset += t.numel()


def _group_topology() -> Topology:
    """This process's place in the initialised process group (one process when there is none)."""
    if not distributed.is_initialized():
        return Topology()
    rank = dist.get_rank()
    return Topology(rank=rank, world_size=dist.get_world_size(),
                    local_rank=int(os.environ.get("LOCAL_RANK", rank)))


class CPUBackend(Backend):
    """``--device cpu``: one process, simulated replicas, or one process per replica over gloo."""

    name = "cpu"

    def __init__(self) -> None:
        self._owns_group = False
        self.topology = _group_topology()  # a replica started inside a group works before setup()

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    def setup(self, opts: Any) -> Topology:
        """Keep the engine options (fp16 refused where torch cannot run it on the CPU) and, when launched
        by torchrun or spawn_replicas with R > 1, join the gloo process group."""
        options = EngineOptions.from_opts(opts)
        check_mixed_precision_on_cpu(options.mixed_precision)
        self.options = options
        launched = distributed.env_info()  # torchrun's processes join their group whatever -rf says: a count
        many = launched is not None and launched.world_size > 1  # that disagrees is refused, not run N times
        if (getattr(opts, "replication_factor", 1) > 1 or many) and not distributed.is_initialized():
            timeout_s = float(getattr(opts, "replica_timeout_s", distributed.DEFAULT_GROUP_TIMEOUT_S))
            if distributed.init_from_env(timeout_s=timeout_s) is not None:
                self._owns_group = True
        self.topology = _group_topology()
        return self.topology

    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                plan: ExecutionPlan | None = None, *, gather_outputs: bool = False,
                inputs: str = "shard") -> LayoutEngine:
        """A :class:`ReplicatedEngine` when a process group of R > 1 processes is up, else a
        :class:`PlanEngine` (replicas, if R > 1, simulated in this process). ``gather_outputs`` and
        ``inputs`` apply to the replicated engine (see the module docstring)."""
        plan = plan if plan is not None else ExecutionPlan()
        if distributed.is_initialized() and distributed.world_size() > 1:
            return ReplicatedEngine(model, optimizer, plan, gather_outputs=gather_outputs, inputs=inputs,
                                    options=self.options)
        return PlanEngine(model, optimizer, plan, self.options)

    def teardown(self) -> None:
        if self._owns_group:
            distributed.shutdown()
            self._owns_group = False
            self.topology = Topology()


__all__ = ["CPUBackend", "CPUHooks", "FlatGradHooks", "OutputMode", "PlanEngine", "ReplicatedEngine"]
