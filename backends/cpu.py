"""CPU backend: the execution plan run in one process, or replicated over torch.distributed (gloo).

* :class:`PlanEngine` (one process) runs a call as :meth:`ExecutionPlan.layout` describes it: D weight
  updates, each over G micro-batches x R replicas; with R > 1 and no process group the replicas are
  simulated in this process (their micro-batches simply join the update's accumulation), which gives the
  same weights as R processes. Micro-batches are views of the combined batch (no copy, no per-row Python).
* :class:`ReplicatedEngine` (R processes, torch.distributed initialised with ``world_size == R``):
  by default (``inputs="shard"``) **each process receives only its own replica's rows**, the ``[D, G, b]``
  slice of the combined batch (``plan.shard(batch, rank)`` cuts it from a full batch; a sharded world
  produces it directly, which saves R-1 copies of the data work); ``inputs="full"`` accepts the whole
  combined batch in every process and shards it inside (simpler when every process runs the same
  unsharded world, at R times the data work). Each process runs its micro-batches and all-reduces the gradients before each of the D updates. The gradients live in one
  flat buffer (each ``param.grad`` is a view of it), so an update costs one ``all_reduce``; the loss and
  micro-batch count ride in two extra slots of the same buffer. Micro-batch losses are pre-scaled by the
  layout's weights (1/(G*R) for Mean), so the all-reduced SUM is the update's gradient. Initial weights and
  buffers are broadcast from rank 0. With ``drop_last=False`` every call first all-reduces the shard
  sizes (R integers) so all replicas agree on the tail layout (not needed with ``inputs="full"``); with
  ``drop_last=True`` (default) no extra collective is made. Outputs: by default each process gets its own
  replica's outputs (``rows`` index its shard, or the combined batch with ``inputs="full"``), which is
  what a world running on its own shard needs; ``gather_outputs=True`` all-gathers them so every rank
  (rank 0 builds the replies) gets the whole call's outputs in the plan's order with ``rows`` indexing
  the combined batch. ``eval_step`` is local (no collective): each process evaluates the rows it is given.
  Metrics: with sharded inputs every process scores its own rows and :meth:`CPUBackend.reduce_metrics`
  sums them; with ``inputs="full"`` every process sees every row, so take metrics from rank 0 unsummed.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
import torch.distributed as dist

from accelbatch.plan import CallLayout, ExecutionPlan, OutputMode, PlanError, batch_rows, combine_outputs

from . import distributed
from .base import Backend, Engine, NonFiniteLoss, StepResult, TensorBatch
from .engine_parts import (ReplicaSteps, cat_parts, check_trainable, detached_outputs, keep_flags, loss_of,
                           replica_steps, slice_rows, sum_parts)


class PlanEngine(Engine):
    """Runs an :class:`ExecutionPlan` in the calling process (replicas, if any, simulated in order)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan | None = None):
        self.model = model
        self.optimizer = optimizer
        self.plan = plan if plan is not None else ExecutionPlan()
        self.eval_plan = self.plan.for_inference()
        self.skip_nonfinite = False  # --skip-nan: drop an update whose loss is NaN/inf instead of stopping

    # --- training ----------------------------------------------------------------------------
    def _check_train(self) -> None:
        check_trainable(self.optimizer, self.plan)
        if not self.model.training:
            self.model.train()

    def train_step(self, batch: TensorBatch) -> StepResult:
        self._check_train()
        n = batch_rows(batch)
        lay = self.plan.layout(n)
        model, opt = self.model, self.optimizer
        keep = keep_flags(lay)
        losses: list[torch.Tensor] = []
        kept: dict[int, dict[str, torch.Tensor]] = {}
        skipped = 0
        for d, js in enumerate(lay.updates):
            opt.zero_grad(set_to_none=True)
            first = len(losses)
            for j in js:
                out = model(slice_rows(batch, lay.starts[j], lay.stops[j], n))
                loss = loss_of(out)
                w = lay.weight[j]
                (loss if w == 1.0 else loss * w).backward()
                losses.append(loss.detach())
                if keep[j]:
                    kept[j] = detached_outputs(out)
            if not bool(torch.isfinite(torch.stack(losses[first:])).all()):
                if not self.skip_nonfinite:
                    raise NonFiniteLoss(f"non-finite training loss ({_first_bad(losses[first:])}) in weight "
                                        f"update {d + 1} of {lay.num_updates} of this call; the update was not "
                                        "applied. Lower --learning-rate, or pass --skip-nan to skip such steps")
                opt.zero_grad(set_to_none=True)
                skipped += 1
                continue
            opt.step()
        outputs = combine_outputs(lay, [kept[j] for j in lay.kept])
        finite = [x for x in losses if bool(torch.isfinite(x))] if skipped else losses
        mean_loss = (torch.stack(finite).mean().item() if finite else None)
        return StepResult(outputs=outputs, rows=lay.out_rows, loss=mean_loss, updates=lay.num_updates - skipped,
                          extras={"micro_batches": lay.num_micro_batches, "partial": lay.partial,
                                  "skipped_updates": skipped})

    # --- inference ---------------------------------------------------------------------------
    @torch.no_grad()
    def eval_step(self, batch: TensorBatch) -> StepResult:
        n = batch_rows(batch)
        lay = self.eval_plan.layout(n)
        if self.model.training:
            self.model.eval()
        outs: list[dict[str, torch.Tensor]] = []
        loss_sum: torch.Tensor | None = None
        for j in range(lay.num_micro_batches):
            s, e = lay.starts[j], lay.stops[j]
            out = self.model(slice_rows(batch, s, e, n))
            loss = out.get("loss")
            if loss is not None:
                part = loss * (e - s)
                loss_sum = part if loss_sum is None else loss_sum + part
            outs.append(detached_outputs(out))
        outputs = combine_outputs(lay, outs)
        return StepResult(outputs=outputs, rows=lay.out_rows,
                          loss=None if loss_sum is None else float(loss_sum) / n, updates=0,
                          extras={"micro_batches": lay.num_micro_batches})


class ReplicatedEngine(PlanEngine):
    """One replica of a synchronous data-parallel plan over torch.distributed (see the module docstring).

    Every process of the group builds one with the same plan (``replication_factor == world_size``) and
    calls ``train_step`` with its shard, in step.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan, group: Any = None, gather_outputs: bool = False,
                 inputs: str = "shard", broadcast_init: bool = True):
        if not dist.is_available() or not dist.is_initialized():
            raise PlanError("ReplicatedEngine needs torch.distributed initialised (use "
                            "accelbatch.backends.distributed.spawn_replicas, or torchrun)")
        world = dist.get_world_size(group)
        if plan.replication_factor != world:
            raise PlanError(f"--replication-factor {plan.replication_factor} but torch.distributed has "
                            f"{world} processes: start one process per replica "
                            f"(torchrun --nproc-per-node {plan.replication_factor}) or change the option")
        if inputs not in ("shard", "full"):
            raise PlanError(f"inputs={inputs!r}: expected 'shard' (each process gets its replica's rows) or "
                            "'full' (each process gets the whole combined batch)")
        super().__init__(model, optimizer, plan)
        self.inputs = inputs
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = world
        self.gather_outputs = gather_outputs
        # eval is local: a replica evaluates its own rows with micro batch b*G over D iterations
        self.eval_plan = dataclasses.replace(plan.for_inference(), replication_factor=1)
        self._params = [p for p in model.parameters() if p.requires_grad]
        dtypes = {p.dtype for p in self._params}
        if len(dtypes) > 1:
            raise PlanError(f"ReplicatedEngine needs parameters of one dtype, found {sorted(map(str, dtypes))}")
        dtype = dtypes.pop() if dtypes else torch.float32
        total = sum(p.numel() for p in self._params)
        self._numel = total
        self._flat = torch.zeros(total + 2, dtype=dtype)  # grads, then [loss sum, micro-batch count]
        self._views: list[torch.Tensor] = []
        offset = 0
        for p in self._params:
            self._views.append(self._flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self._steps_cache: dict[int, tuple[CallLayout, ReplicaSteps, list[ReplicaSteps]]] = {}
        if broadcast_init:
            self._broadcast_state()

    def _broadcast_state(self) -> None:
        tensors = [t for t in list(self.model.parameters()) + list(self.model.buffers())
                   if t.is_floating_point() or t.dtype in (torch.int64, torch.int32)]
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault(t.dtype, []).append(t)
        with torch.no_grad():
            for dtype, ts in by_dtype.items():
                flat = torch.cat([t.detach().reshape(-1) for t in ts])
                dist.broadcast(flat, src=0, group=self.group)
                offset = 0
                for t in ts:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()

    def _steps(self, total_rows: int) -> tuple[CallLayout, ReplicaSteps, list[ReplicaSteps]]:
        cached = self._steps_cache.get(total_rows)
        if cached is None:
            lay = self.plan.layout(total_rows)
            every = [replica_steps(lay, r) for r in range(self.world_size)]
            cached = (lay, every[self.rank], every)
            if len(self._steps_cache) > 64:
                self._steps_cache.clear()
            self._steps_cache[total_rows] = cached
        return cached

    def _total_rows(self, local_rows: int) -> int:
        if self.plan.drop_last:
            return local_rows * self.world_size
        counts = torch.zeros(self.world_size, dtype=torch.int64)
        counts[self.rank] = local_rows
        dist.all_reduce(counts, group=self.group)
        total = int(counts.sum())
        lay, _, every = self._steps(total)
        expected = [s.shard_rows for s in every]
        if counts.tolist() != expected:  # every rank sees the same counts, so every rank raises
            raise PlanError(f"replica shards have {counts.tolist()} rows but the plan's layout of a "
                            f"{total}-row call gives {expected}: cut shards with plan.shard(batch, rank)")
        return total

    def train_step(self, batch: TensorBatch) -> StepResult:
        self._check_train()
        if self.inputs == "full":
            total = batch_rows(batch)
            self.plan.layout(total)  # validates
            batch = self.plan.shard(batch, self.rank)
            local_rows = batch_rows(batch)
        else:
            local_rows = batch_rows(batch)
            total = self._total_rows(local_rows)
        lay, mine, every = self._steps(total)
        if mine.shard_rows != local_rows:
            raise PlanError(f"replica {self.rank} got {local_rows} rows; a {total}-row call gives it "
                            f"{mine.shard_rows} (the plan's [D, G, b] slice: plan.shard(batch, rank))")
        model, opt, flat = self.model, self.optimizer, self._flat
        params, views = self._params, self._views
        keep = keep_flags(lay)
        kept: dict[int, dict[str, torch.Tensor]] = {}
        loss_total = torch.zeros((), dtype=torch.float64)
        count_total = 0.0
        for steps in mine.updates:
            flat.zero_()
            for p, v in zip(params, views):
                p.grad = v
            local_loss = None
            for start, stop, w, j in steps:
                out = model(slice_rows(batch, start, stop, local_rows))
                loss = loss_of(out)
                (loss if w == 1.0 else loss * w).backward()
                d = loss.detach()
                local_loss = d if local_loss is None else local_loss + d
                if keep[j]:
                    kept[j] = detached_outputs(out)
            for p, v in zip(params, views):
                if p.grad is not v:  # something replaced the grad tensor: fold it back into the bucket
                    if p.grad is not None:
                        v.copy_(p.grad)
                    p.grad = v
            if local_loss is not None:
                flat[-2] = local_loss
            flat[-1] = len(steps)
            dist.all_reduce(flat, group=self.group)
            loss_total += flat[-2]
            count_total += float(flat[-1])
            opt.step()
        outputs, rows = self._outputs(lay, mine, every, kept)
        return StepResult(outputs=outputs, rows=rows,
                          loss=float(loss_total) / count_total if count_total else None,
                          updates=lay.num_updates,
                          extras={"micro_batches": lay.num_micro_batches, "partial": lay.partial,
                                  "replica": self.rank, "shard_rows": local_rows})

    def _outputs(self, lay: CallLayout, mine: ReplicaSteps, every: list[ReplicaSteps],
                 kept: dict[int, dict[str, torch.Tensor]]) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        my_js = [j for j in lay.kept if lay.replica[j] == self.rank]
        if not self.gather_outputs:
            parts = [kept[j] for j in my_js]
            if lay.sum_groups is not None:
                return sum_parts(parts), None
            if self.inputs == "full":  # rows index the combined batch this process was given
                rows = (torch.cat([torch.arange(lay.starts[j], lay.stops[j]) for j in my_js]) if my_js
                        else torch.empty(0, dtype=torch.long))
            else:  # rows index this process's shard
                rows = (torch.cat([torch.arange(mine.local_start[j], mine.local_start[j] + lay.micro_rows(j))
                                   for j in my_js]) if my_js else torch.empty(0, dtype=torch.long))
            return cat_parts(parts), rows
        local = {j: kept[j] for j in my_js}
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, local, group=self.group)
        by_j: dict[int, dict[str, torch.Tensor]] = {}
        for part in gathered:
            by_j.update(part)
        return combine_outputs(lay, [by_j[j] for j in lay.kept]), lay.out_rows


class CPUBackend(Backend):
    """``--device cpu``: one process, simulated replicas, or one process per replica over gloo."""

    name = "cpu"

    def __init__(self) -> None:
        self._owns_group = False
        self._skip_nonfinite = False

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        return True, ""

    @property
    def rank(self) -> int:
        return distributed.rank()

    @property
    def world_size(self) -> int:
        return distributed.world_size()

    def setup(self, opts: Any) -> None:
        """Join the process group when launched by torchrun (or spawn_replicas) and R > 1."""
        self._skip_nonfinite = bool(getattr(opts, "skip_nan", False))
        if getattr(opts, "replication_factor", 1) > 1 and not distributed.is_initialized():
            timeout_s = float(getattr(opts, "replica_timeout_s", distributed.DEFAULT_GROUP_TIMEOUT_S))
            if distributed.init_from_env(timeout_s=timeout_s) is not None:
                self._owns_group = True

    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                plan: ExecutionPlan | None = None, *, gather_outputs: bool = False,
                inputs: str = "shard") -> Engine:
        """A :class:`ReplicatedEngine` when a process group of R > 1 processes is up, else a
        :class:`PlanEngine` (replicas, if R > 1, simulated in this process). ``gather_outputs`` and
        ``inputs`` apply to the replicated engine (see the module docstring)."""
        plan = plan if plan is not None else ExecutionPlan()
        if distributed.is_initialized() and distributed.world_size() > 1:
            return ReplicatedEngine(model, optimizer, plan, gather_outputs=gather_outputs, inputs=inputs)
        engine = PlanEngine(model, optimizer, plan)
        engine.skip_nonfinite = self._skip_nonfinite
        return engine

    def reduce_metrics(self, metrics: Any) -> Any:
        return distributed.reduce_metrics(metrics)

    def teardown(self) -> None:
        if self._owns_group:
            distributed.shutdown()
            self._owns_group = False


def _first_bad(losses: list[torch.Tensor]) -> str:
    bad = [float(x) for x in losses if not bool(torch.isfinite(x))]
    return f"{bad[0]}" if bad else "?"


# The one-process engine under its former name.
LocalEngine = PlanEngine

__all__ = ["CPUBackend", "PlanEngine", "ReplicatedEngine", "LocalEngine", "OutputMode"]
