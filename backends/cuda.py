"""CUDA backend on Hugging Face accelerate: the execution plan on a GPU, fed without stalls.

* Placement, mixed precision (``--mixed-precision no|bf16|fp16``) and DDP come from ``accelerate``: one
  :class:`accelerate.Accelerator` per backend; ``Accelerator(cpu=True)`` runs the very same code on the CPU
  (that is how it is tested without a GPU).
* A call runs the plan exactly as :class:`accelbatch.backends.cpu.PlanEngine` does (same layout, loss weights,
  update order, output selection, loss reporting), so the same plan gives the same numbers.
* Feeding: host rows are pinned and copied with ``non_blocking=True`` on a side stream
  (:mod:`accelbatch.backends.prefetch`). Inside a call, the rows of weight update d+1 are copied while update
  d computes; across calls, :meth:`CUDAEngine.run` (an engine-driven loop) and
  :meth:`CUDABackend.make_loader` (any loop) copy batch k+1 while batch k computes, pinning in a helper
  thread. A batch that is already on the device is not copied.
* No host synchronisation inside a call: the D updates are queued back to back, the loss is summed on the
  device, and the call ends with one wait, after which the loss and the selected outputs (copied to pinned
  host memory without blocking) are read. ``engine.host_syncs`` counts those waits, and
  :func:`accelbatch.backends.prefetch.count_host_syncs` checks that nothing else waits. Exceptions: fp16 (the
  GradScaler reads its overflow flag at every update) and, with R processes and ``--no-drop-last``, one small
  all-reduce of shard sizes per call.
* Replication: one process per replica. Launched by ``torchrun``/``accelerate launch``, accelerate joins the
  group (NCCL) and wraps the model in DDP; on one node :func:`spawn_cuda_replicas` starts the R processes.
  Each process runs its own shard (``plan.shard(batch, rank)``; or, with ``inputs="full"``, is given the
  whole call and keeps its shard; ``gather_outputs=True`` returns the whole call's outputs on every rank),
  as with the CPU backend's ReplicatedEngine.
  Gradients: DDP averages over R, so a micro-batch's loss is scaled by ``weight x R`` (Mean: 1/G, giving
  the Mean over G x R; Sum: R, giving the sum). An epoch tail (``--no-drop-last``) may leave a replica with
  fewer micro-batches than another, which DDP cannot all-reduce, so tails accumulate under ``no_sync`` and
  all-reduce the gradients explicitly. In one process with R > 1 the replicas are run in turn (as the CPU
  engine does), which gives the same weights.
* The optimizer step, ``zero_grad`` and ``backward`` call torch (and accelerate's GradScaler for fp16)
  directly for one device or DDP: accelerate's optimizer wrapper does per-step host work (it looked up a
  package on every step) that an engine doing its own accumulation does not need.
* Hogwild on CUDA: :func:`hogwild_start_method` says ``spawn`` or refuses with the reason.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist

from accelbatch.plan import CallLayout, ExecutionPlan, PlanError, batch_rows, combine_outputs

from . import distributed
from .base import Backend, Engine, StepResult, TensorBatch
from .engine_parts import (cat_parts, check_trainable, detached_outputs, keep_flags, loss_of, replica_steps,
                           slice_rows, sum_parts)
from .prefetch import Copier, DeviceLoader, Prefetcher, copier_for, map_tensors, tensors_of

if TYPE_CHECKING:
    from accelerate import Accelerator

    from accelbatch.opts import Opts

MIXED_PRECISION = ("no", "bf16", "fp16")


# --- availability ---------------------------------------------------------------------------------------

def cuda_unavailable_reason() -> str | None:
    """Why ``--device cuda`` cannot run here (None when it can)."""
    if torch.cuda.is_available():
        return None
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


# --- accelerate -------------------------------------------------------------------------------------------

def make_accelerator(cpu: bool = False, mixed_precision: str = "no",
                     group_timeout_s: float | None = None) -> "Accelerator":
    """An ``Accelerator`` for this process (``cpu=True``: the CPU; else the GPU of this rank).
    ``group_timeout_s`` (``--replica-timeout-s``): how long a collective waits when accelerate joins the
    process group.

    accelerate keeps one shared state per process and refuses a second Accelerator with other settings;
    in a single process (tests, notebooks) that state is reset so each backend gets what it asks for.
    """
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState, PartialState

    if mixed_precision not in MIXED_PRECISION:
        raise PlanError(f"--mixed-precision: {mixed_precision!r} is not one of {', '.join(MIXED_PRECISION)}")
    if cpu and mixed_precision == "fp16":
        raise PlanError("--mixed-precision fp16 needs a GPU (fp16 autocast with a GradScaler); on the CPU "
                        "use bf16 or no")
    handlers = []
    if group_timeout_s is not None:
        from datetime import timedelta

        from accelerate.utils import InitProcessGroupKwargs

        handlers.append(InitProcessGroupKwargs(timeout=timedelta(seconds=group_timeout_s)))
    try:
        return Accelerator(cpu=cpu, mixed_precision=mixed_precision, kwargs_handlers=handlers)
    except ValueError as exc:
        if "already been initialized" not in str(exc) or distributed.is_initialized():
            raise
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    PartialState._reset_state()
    return Accelerator(cpu=cpu, mixed_precision=mixed_precision, kwargs_handlers=handlers)


# --- the engine -------------------------------------------------------------------------------------------

@dataclass
class _Queued:
    """A call whose kernels are queued but not waited for."""

    loss_sum: torch.Tensor | None        # on the device
    count: int                            # micro-batches (rows, for eval) the loss sum covers
    outputs: dict[str, torch.Tensor]      # on the device
    rows: torch.Tensor | None
    updates: int
    extras: dict[str, Any]
    gather: CallLayout | None = None      # gather_outputs: ``outputs`` maps j -> that micro-batch's outputs


class CUDAEngine(Engine):
    """Runs an :class:`ExecutionPlan` through an ``Accelerator`` (see the module docstring)."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan | None, accelerator: "Accelerator", prefetch: bool = True,
                 copier: Copier | None = None, inputs: str = "shard", gather_outputs: bool = False):
        if inputs not in ("shard", "full"):
            raise PlanError(f"inputs={inputs!r}: expected 'shard' (each process gets its replica's rows) or "
                            "'full' (each process gets the whole combined batch)")
        self.inputs = inputs
        self.gather_outputs = gather_outputs
        self.plan = plan if plan is not None else ExecutionPlan()
        self.accelerator = accelerator
        device = accelerator.device
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.world_size = accelerator.num_processes
        self.rank = accelerator.process_index
        if self.world_size > 1 and self.plan.replication_factor != self.world_size:
            raise PlanError(f"--replication-factor {self.plan.replication_factor} but {self.world_size} "
                            f"processes were launched: start one process per replica "
                            f"(torchrun --nproc-per-node {self.plan.replication_factor}) or change the "
                            "option")
        self.model = model                         # the user's module (moved to the device in place)
        if optimizer is None:
            self.module = accelerator.prepare(model)
            self.optimizer = None
        else:
            self.module, self.optimizer = accelerator.prepare(model, optimizer)
        self.raw_optimizer = optimizer
        # accelerate's optimizer wrapper and backward add per-step host work (a package lookup per step, a
        # division by 1) that this engine does not need, since it does its own accumulation: with plain
        # DDP or one device it calls torch (and accelerate's GradScaler for fp16) directly
        from accelerate.utils import DistributedType

        self._direct = accelerator.distributed_type in (DistributedType.NO, DistributedType.MULTI_GPU,
                                                         DistributedType.MULTI_CPU)
        if self.world_size > 1:   # eval is local: a replica evaluates its own rows
            self.eval_plan = dataclasses.replace(self.plan.for_inference(), replication_factor=1)
        else:
            self.eval_plan = self.plan.for_inference()
        self.prefetch = prefetch
        self.copier = copier if copier is not None else copier_for(self.device)
        self.host_syncs = 0

    # --- public steps ------------------------------------------------------------------------------
    def train_step(self, batch: TensorBatch) -> StepResult:
        return self._fetch(self._queue_train(batch))

    def eval_step(self, batch: TensorBatch) -> StepResult:
        return self._fetch(self._queue_eval(batch))

    def run(self, batches: Iterable[TensorBatch], training: bool = True, depth: int = 1,
            pin_in_background: bool = False) -> Iterator[StepResult]:
        """Step through ``batches``, copying batch k+1 to the device while batch k computes.

        The next copy is issued after batch k's kernels are queued and before the host waits for them, so
        the host-side work of the copy (pinning, when the source is not pinned) also overlaps the device.
        ``pin_in_background=True`` pins in a helper thread instead (best when batches are large).
        """
        from .prefetch import pinned_in_background

        source: Iterable[TensorBatch] = batches
        if pin_in_background and self.device.type == "cuda":
            source = pinned_in_background(batches, depth=depth + 1)
        feed = Prefetcher(source, self.copier, depth=depth)
        queue_step = self._queue_train if training else self._queue_eval
        try:
            while True:
                try:
                    batch = feed.take()
                except StopIteration:
                    return
                queued = queue_step(batch)
                feed.fill()
                yield self._fetch(queued)
        finally:
            feed.close()

    # --- training ------------------------------------------------------------------------------------
    def _check_train(self) -> None:
        check_trainable(self.optimizer, self.plan)
        if not self.module.training:
            self.module.train()

    def _queue_train(self, batch: TensorBatch) -> _Queued:
        self._check_train()
        local_rows = batch_rows(batch)
        if self.world_size > 1:
            if self.inputs == "full":     # every process got the whole call: keep this replica's rows
                total = local_rows
                self.plan.layout(total)   # validates
                batch = self.plan.shard(batch, self.rank)
                local_rows = batch_rows(batch)
            else:
                total = self._total_rows(local_rows)
            lay = self.plan.layout(total)
            mine = replica_steps(lay, self.rank)
            if mine.shard_rows != local_rows:
                raise PlanError(f"replica {self.rank} got {local_rows} rows; a {total}-row call gives it "
                                f"{mine.shard_rows} (the plan's [D, G, b] slice: plan.shard(batch, rank))")
            per_update = mine.updates
        else:
            lay = self.plan.layout(local_rows)
            per_update = tuple(tuple((lay.starts[j], lay.stops[j], lay.weight[j], j) for j in js)
                               for js in lay.updates)
        ddp = self.world_size > 1 and not lay.partial   # DDP all-reduces; tails all-reduce explicitly
        manual = self.world_size > 1 and lay.partial
        scale = float(self.world_size) if ddp else 1.0
        keep = keep_flags(lay)
        kept: dict[int, dict[str, torch.Tensor]] = {}
        loss_sum = torch.zeros((), dtype=torch.float32, device=self.device)
        spans = [(steps[0][0], steps[-1][1]) if steps else None for steps in per_update]
        # a tail runs the bare module (no DDP hooks or buffer broadcasts, which need every replica to run
        # the same number of forwards) and all-reduces the gradients itself
        forward = self.model if manual else self.module
        for steps, (offset, chunk) in zip(per_update, self._feed(batch, spans, local_rows)):
            self._zero_grad()
            rows_here = 0 if chunk is None else batch_rows(chunk)
            for i, (start, stop, weight, j) in enumerate(steps):
                last = i == len(steps) - 1
                sync = contextlib.nullcontext() if (ddp and last) or self.world_size == 1 \
                    else self.accelerator.no_sync(self.module)
                with sync:
                    out = forward(slice_rows(chunk, start - offset, stop - offset, rows_here))
                    loss = loss_of(out)
                    w = weight * scale
                    self._backward(loss if w == 1.0 else loss * w)
                loss_sum += loss.detach().float()
                if keep[j]:
                    kept[j] = detached_outputs(out)
            if manual:
                self._all_reduce_grads()
            self._step()
        extras: dict[str, Any] = {"micro_batches": lay.num_micro_batches, "partial": lay.partial}
        if self.world_size == 1:
            outputs = combine_outputs(lay, [kept[j] for j in lay.kept])
            return _Queued(loss_sum, lay.num_micro_batches, outputs, lay.out_rows, lay.num_updates, extras)
        dist.all_reduce(loss_sum)          # queued on the device with NCCL; no host wait
        extras.update(replica=self.rank, shard_rows=local_rows)
        if self.gather_outputs:            # gathered after the call's wait, in _fetch
            mine_kept = {j: kept[j] for j in lay.kept if lay.replica[j] == self.rank}
            return _Queued(loss_sum, lay.num_micro_batches, mine_kept, lay.out_rows, lay.num_updates, extras,
                           gather=lay)
        outputs, rows = self._local_outputs(lay, mine, kept)
        return _Queued(loss_sum, lay.num_micro_batches, outputs, rows, lay.num_updates, extras)

    def _zero_grad(self) -> None:
        if self._direct:
            self.raw_optimizer.zero_grad(set_to_none=True)
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _backward(self, loss: torch.Tensor) -> None:
        scaler = self.accelerator.scaler
        if not self._direct:
            self.accelerator.backward(loss)
        elif scaler is not None:
            scaler.scale(loss).backward()
        else:
            loss.backward()

    def _step(self) -> None:
        scaler = self.accelerator.scaler
        if not self._direct:
            self.optimizer.step()
        elif scaler is not None:     # fp16: skips the step on overflow (reads a flag: one host wait)
            scaler.step(self.raw_optimizer)
            scaler.update()
        else:
            self.raw_optimizer.step()

    def _total_rows(self, local_rows: int) -> int:
        if self.plan.drop_last:
            return local_rows * self.world_size
        counts = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
        counts[self.rank] = local_rows
        dist.all_reduce(counts)
        got = counts.tolist()          # the one extra host wait of a --no-drop-last replicated call
        total = sum(got)
        expected = [s.shard_rows for s in (replica_steps(self.plan.layout(total), r)
                                           for r in range(self.world_size))]
        if got != expected:
            raise PlanError(f"replica shards have {got} rows but the plan's layout of a {total}-row call "
                            f"gives {expected}: cut shards with plan.shard(batch, rank)")
        return total

    def _all_reduce_grads(self) -> None:
        for p in self.model.parameters():
            if not p.requires_grad:
                continue
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            dist.all_reduce(p.grad)

    def _local_outputs(self, lay: CallLayout, mine: Any, kept: dict[int, dict[str, torch.Tensor]]
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        my_js = [j for j in lay.kept if lay.replica[j] == self.rank]
        parts = [kept[j] for j in my_js]
        if lay.sum_groups is not None:
            return sum_parts(parts), None
        if not my_js:
            return cat_parts(parts), torch.empty(0, dtype=torch.long)
        if self.inputs == "full":   # rows index the combined batch this process was given
            rows = torch.cat([torch.arange(lay.starts[j], lay.stops[j]) for j in my_js])
        else:                       # rows index this process's shard
            rows = torch.cat([torch.arange(mine.local_start[j], mine.local_start[j] + lay.micro_rows(j))
                              for j in my_js])
        return cat_parts(parts), rows

    # --- inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def _queue_eval(self, batch: TensorBatch) -> _Queued:
        n = batch_rows(batch)
        lay = self.eval_plan.layout(n)
        if self.module.training:
            self.module.eval()
        forward = self.model      # eval is local: the bare module (accelerate's autocast is on its forward)
        spans = [(lay.starts[js[0]], lay.stops[js[-1]]) for js in lay.updates]
        outs: list[dict[str, torch.Tensor]] = []
        loss_sum: torch.Tensor | None = None
        for js, (offset, chunk) in zip(lay.updates, self._feed(batch, spans, n)):
            rows_here = batch_rows(chunk)
            for j in js:
                s, e = lay.starts[j], lay.stops[j]
                out = forward(slice_rows(chunk, s - offset, e - offset, rows_here))
                loss = out.get("loss")
                if loss is not None:
                    part = loss.detach().float() * (e - s)
                    loss_sum = part if loss_sum is None else loss_sum + part
                outs.append(detached_outputs(out))
        outputs = combine_outputs(lay, outs)
        return _Queued(loss_sum, n, outputs, lay.out_rows, 0, {"micro_batches": lay.num_micro_batches})

    # --- feeding and fetching ------------------------------------------------------------------------
    def _feed(self, batch: TensorBatch, spans: list[tuple[int, int] | None], rows: int
              ) -> Iterator[tuple[int, TensorBatch | None]]:
        """(row offset, rows of each span on the device): the copy of span u+1 overlaps span u's work."""
        if self._on_device(batch):
            for span in spans:
                yield (0, batch) if span is not None else (0, None)
            return
        if not self.prefetch or len(spans) == 1:
            whole = self.copier.finish(self.copier.start(batch))
            for span in spans:
                yield (0, whole) if span is not None else (0, None)
            return
        chunks = [slice_rows(batch, s, e, rows) for s, e in (span for span in spans if span is not None)]
        feed = Prefetcher(chunks, self.copier, depth=1)
        for span in spans:
            yield (span[0], next(feed)) if span is not None else (0, None)

    def _on_device(self, batch: TensorBatch) -> bool:
        return all(t.device == self.device for t in tensors_of(batch))

    def _fetch(self, queued: _Queued) -> StepResult:
        """The call's one host wait: loss and outputs come back together."""
        on_device = self.device.type != "cpu"
        outputs = queued.outputs
        loss = queued.loss_sum
        if on_device:
            outputs = map_tensors(outputs, lambda t: t.to("cpu", non_blocking=True))
            loss = None if loss is None else loss.to("cpu", non_blocking=True)
            torch.cuda.current_stream(self.device).synchronize()
        self.host_syncs += 1
        value = None if loss is None else loss.item() / max(queued.count, 1)
        extras = dict(queued.extras)
        extras["host_syncs"] = 1
        if queued.gather is not None:     # the whole call's outputs on every rank, in the plan's order
            gathered: list[Any] = [None] * self.world_size
            dist.all_gather_object(gathered, outputs)
            by_j: dict[int, dict[str, torch.Tensor]] = {}
            for part in gathered:
                by_j.update(part)
            outputs = combine_outputs(queued.gather, [by_j[j] for j in queued.gather.kept])
        return StepResult(outputs=outputs, rows=queued.rows, loss=value, updates=queued.updates,
                          extras=extras)

    # --- persistence ------------------------------------------------------------------------------------
    def host_optimizer(self) -> torch.optim.Optimizer | None:
        return self.raw_optimizer  # the torch optimizer, not accelerate's wrapper


# --- the backend ------------------------------------------------------------------------------------------

class CUDABackend(Backend):
    """``--device cuda``: accelerate on the GPU of this process (``cpu=True``: the same code on the CPU)."""

    name = "cuda"

    def __init__(self, cpu: bool = False, prefetch: bool = True) -> None:
        self.cpu = cpu
        self.prefetch = prefetch
        self.mixed_precision = "no"
        self.accelerator: Accelerator | None = None
        self._owns_group = False

    @classmethod
    def is_available(cls) -> tuple[bool, str]:
        why = cuda_unavailable_reason()
        return (why is None), (why or "")

    def setup(self, opts: "Opts") -> None:
        self.mixed_precision = getattr(opts, "mixed_precision", "no") or "no"
        hogwild_start_method(opts)
        had_group = distributed.is_initialized()
        self.accelerator = make_accelerator(cpu=self.cpu, mixed_precision=self.mixed_precision,
                                            group_timeout_s=getattr(opts, "replica_timeout_s", None))
        # accelerate joins the group torchrun describes; then this backend leaves it at teardown
        self._owns_group = not had_group and distributed.is_initialized()

    def compile(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                plan: ExecutionPlan | None = None, *, gather_outputs: bool = False,
                inputs: str = "shard") -> CUDAEngine:
        """A :class:`CUDAEngine`; ``inputs`` and ``gather_outputs`` apply with R processes, as for the CPU
        backend's ReplicatedEngine (``inputs="full"``: every process gets the whole combined batch and
        keeps its replica's rows; ``gather_outputs=True``: every rank gets the whole call's outputs)."""
        if self.accelerator is None:
            self.accelerator = make_accelerator(cpu=self.cpu, mixed_precision=self.mixed_precision)
        return CUDAEngine(model, optimizer, plan, self.accelerator, prefetch=self.prefetch, inputs=inputs,
                          gather_outputs=gather_outputs)

    @property
    def rank(self) -> int:
        return self.accelerator.process_index if self.accelerator is not None else distributed.rank()

    @property
    def world_size(self) -> int:
        return self.accelerator.num_processes if self.accelerator is not None else distributed.world_size()

    def make_loader(self, batches: Iterable[TensorBatch], plan: Any) -> Iterable[TensorBatch]:
        """On a GPU: batches pinned in a helper thread and copied on a side stream one batch ahead (the
        engine then finds them on the device and copies nothing). With ``cpu=True``: unchanged."""
        if self.accelerator is None:
            self.accelerator = make_accelerator(cpu=self.cpu, mixed_precision=self.mixed_precision)
        device = self.accelerator.device
        if device.type != "cuda":
            return batches
        return DeviceLoader(batches, copier_for(device), depth=1, pin_in_background=True)

    def reduce_metrics(self, metrics: Any) -> Any:
        return distributed.reduce_metrics(metrics)

    def teardown(self) -> None:
        if self.accelerator is not None:
            self.accelerator.free_memory()
            self.accelerator = None
        if self._owns_group:
            from accelerate.state import AcceleratorState

            distributed.shutdown()
            AcceleratorState._reset_state(reset_partial_state=True)
            self._owns_group = False


# --- processes --------------------------------------------------------------------------------------------

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
    return distributed.spawn_replicas(fn, replicas, *args, timeout_s=timeout_s, init_process_group=cpu,
                                      backend="gloo", group_timeout_s=group_timeout_s)


class HogwildError(PlanError):
    """Hogwild (--numthreads > 1) cannot run with these options on CUDA; the text says what to change."""


def hogwild_start_method(opts: Any) -> str | None:
    """The start method hogwild processes must use for ``opts`` (None: no constraint from CUDA).

    With ``--device cuda`` and ``--numthreads`` > 1 it is ``spawn`` (a forked child cannot use CUDA;
    the model's CUDA tensors reach the children through CUDA IPC, so the parent must keep the model alive
    while they run); the hogwild code should use ``torch.multiprocessing.get_context(...)`` with it.
    Refused with :class:`HogwildError`: a platform without CUDA IPC (not Linux), and hogwild combined with
    --replication-factor > 1.
    """
    if getattr(opts, "device", "cpu") != "cuda" or getattr(opts, "numthreads", 1) <= 1:
        return None
    n = opts.numthreads
    if not sys.platform.startswith("linux"):
        raise HogwildError(f"--numthreads {n} with --device cuda: hogwild processes share the model's CUDA "
                           f"tensors through CUDA IPC, which {sys.platform} does not support; use "
                           f"--numthreads 1 (and --device-iterations for throughput) or --device cpu")
    if getattr(opts, "replication_factor", 1) > 1:
        raise HogwildError(f"--numthreads {n} with --replication-factor {opts.replication_factor} on "
                           "--device cuda: hogwild (asynchronous, one shared model) and replication "
                           "(synchronous, one model per GPU) do not combine; pick one of the two")
    return "spawn"


__all__ = ["CUDABackend", "CUDAEngine", "HogwildError", "cuda_unavailable_reason", "hogwild_start_method",
           "make_accelerator", "spawn_cuda_replicas"]
