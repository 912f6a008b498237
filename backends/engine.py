"""The one engine loop: it executes an :class:`~accelbatch.plan.CallLayout` on any device.

A training call runs the layout's weight updates, each over its G x R micro-batches (all of them in one
process, replicas simulated in turn; this replica's own when R processes run), with the layout's loss
weights, output selection and partial tails, and ends with one host read (loss, NaN flags, outputs).
Under ``--loss-normalization token`` the weights come from the batch's per-row ``loss_tokens``
(:meth:`CallLayout.token_weights`; one all-reduce of the update totals when R processes run), which never
reaches the model.
Random ops draw from a stream per micro-batch (:mod:`accelbatch.streams`), the same wherever it runs.
Device and replication specifics come from :class:`~accelbatch.backends.base.Hooks` (cpu.py, cuda.py).

NaN policy: an update whose loss (summed over the replicas, so all agree) is non-finite is not applied.
Without ``skip_nan`` the call raises :class:`NonFiniteLoss` naming the update and --skip-nan; with it the
update is skipped and counted in ``extras["skipped_updates"]``. The flag is read on the host at once when
``Hooks.host_check()`` says so (free on the CPU; the call stops before the bad update), else it stays on
the device (``Hooks.step_unless``) and is read at the end, also keeping later updates from applying when
the call is to stop. Rows not on the device are copied update by update, the copy of update u+1 issued
once update u's kernels are queued; :meth:`LayoutEngine.stage` copies a later call likewise.
"""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from accelbatch.layout import token_prefix, update_totals
from accelbatch.plan import (
    LOSS_TOKENS,
    CallLayout,
    ExecutionPlan,
    LossNormalization,
    PlanError,
    batch_rows,
    combine_outputs,
)
from accelbatch.streams import CallStreams

from .base import Engine, EngineOptions, Hooks, NonFiniteLoss, Replicas, StepResult, TensorBatch
from .prefetch import Pending


def check_trainable(optimizer: object, plan: ExecutionPlan) -> None:
    """Refuse train_step without an optimizer or on an engine compiled for inference."""
    if optimizer is None:
        raise PlanError("train_step needs an optimizer: compile the model with one (a TorchAgent builds none "
                        "when its model has no parameter that requires grad: nothing to train)")
    if not plan.training:
        raise PlanError("this engine was compiled with an inference plan; compile with "
                        "ExecutionPlan.from_opts(opts, training=True) to train")


def slice_rows(batch: Mapping[str, torch.Tensor] | None, start: int, stop: int) -> TensorBatch:
    if batch is None or (start == 0 and stop == batch_rows(batch)):
        return batch  # type: ignore[return-value]
    return {k: (v[start:stop] if v.dim() else v) for k, v in batch.items()}


def model_inputs(batch: TensorBatch | None) -> TensorBatch | None:
    """``batch`` without the engine's own ``loss_tokens`` (never an input of the model)."""
    if batch is None or LOSS_TOKENS not in batch:
        return batch
    return {k: v for k, v in batch.items() if k != LOSS_TOKENS}


def check_outputs(out: Any) -> Mapping[str, torch.Tensor]:
    """``out`` when it is what a model's forward(batch) returns: a dict of tensors, its 'loss' (None or a tensor)
    and per-row outputs; else a PlanError naming what is not."""
    if not isinstance(out, Mapping):
        raise PlanError(f"the model's forward(batch) returned {type(out).__name__}: it must return a dict of "
                        "tensors (its 'loss' and per-row outputs such as 'scores')")
    for key, value in out.items():
        if isinstance(value, torch.Tensor) or (key == "loss" and value is None):
            continue
        if key == "loss":  # e.g. loss.item(): no gradient flows through a number
            raise PlanError(f"the model's (-m) 'loss' is a {type(value).__name__}, not a tensor: return the loss "
                            "tensor itself (not loss.item() or float(loss)); the gradient flows through it")
        raise PlanError(f"the model's forward(batch) returned {key!r} as a {type(value).__name__}: every output is "
                        "a tensor with one row per row of the batch (dim 0), not a list or a number (no .tolist() "
                        "or .item() inside forward)")
    return out


def loss_of(out: Any) -> torch.Tensor:
    if "loss" not in check_outputs(out) or out["loss"] is None:
        raise PlanError("the model's forward(batch) must return a dict with 'loss' (the mean loss over the "
                        "micro-batch's rows) when training")
    loss = out["loss"]
    if loss.dim() != 0:
        raise PlanError(f"the model's 'loss' has shape {tuple(loss.shape)}; it must be a scalar: the mean "
                        "loss over the micro-batch's rows")
    return loss


def _detached(out: Any) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in check_outputs(out).items() if k != "loss"}


class _Mine(NamedTuple):
    """This process's part of a call: per update, (local start, local stop, loss weight, j) of its
    micro-batches; its row count; where each of its micro-batches starts in its rows."""

    lay: CallLayout
    updates: tuple[tuple[tuple[int, int, float, int], ...], ...]
    rows: int
    starts: dict[int, int]


@dataclasses.dataclass
class _Staged:
    batch: Any
    pending: Pending | None = None
    pinned: Any = None        # a future of the batch pinned off the calling thread (copiers that pin)


class LayoutEngine(Engine):
    """Runs an :class:`ExecutionPlan` through device :class:`Hooks` (see the module docstring)."""

    max_staged = 2

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan | None, hooks: Hooks, options: EngineOptions | None = None,
                 replicas: Replicas | None = None):
        self.plan = plan if plan is not None else ExecutionPlan()
        replicas = replicas or Replicas()
        replicas.check(self.plan)
        self.model, self.optimizer, self.hooks, self.device = model, optimizer, hooks, hooks.device
        self.options = options or EngineOptions()
        self.rank, self.world_size, self.group = replicas.rank, replicas.world_size, replicas.group
        self.inputs, self.gather_outputs = replicas.inputs, replicas.gather_outputs
        self.eval_plan = self.plan.for_inference()
        if self.world_size > 1:   # eval is local: a replica evaluates its own rows
            self.eval_plan = dataclasses.replace(self.eval_plan, replication_factor=1)
        self.host_syncs = 0       # host waits so far: one per call, plus updates whose flag the host read
        self._staged: OrderedDict[int, _Staged] = OrderedDict()
        self._mine: dict[tuple[int, int], _Mine] = {}
        self._along = False  # this call trains with the other replicas though none of its rows has labels

    @property
    def skip_nan(self) -> bool:
        return self.options.skip_nan

    def trains(self, labelled: bool) -> bool:
        """A training call reduces gradients and steps the optimizer on every replica, so in a training run
        (``train_together``) replicas train together when any replica's rows have labels (one all-reduce): a
        replica whose rows are all context turns trains on them with the others (its loss 0, as the rows of a
        combined batch that one process steps); elsewhere (evaluations) each decides alone."""
        trains = labelled
        if self.world_size > 1 and self.train_together:
            flag = torch.tensor([1.0 if labelled else 0.0], device=self.device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
            trains = bool(flag.item())
        self._along = trains and not labelled
        return trains

    def _loss(self, out: Mapping[str, torch.Tensor], along: bool) -> torch.Tensor:
        """The micro-batch's loss; in a call this replica trains ``along`` with (no row with labels), 0 when the
        model gives none, its gradient 0 for every parameter (DDP then reduces them as the others')."""
        if along and isinstance(out, Mapping) and out.get("loss") is None:
            return sum(p.sum() * 0.0 for p in self.model.parameters() if p.requires_grad)  # type: ignore[return-value]
        return loss_of(out)

    def train_step(self, batch: TensorBatch) -> StepResult:
        check_trainable(self.optimizer, self.plan)
        along, self._along = self._along, False  # what trains() decided for this call, for this call only
        hooks = self.hooks
        hooks.set_training(True)
        mine, batch = self._shard(batch)
        lay, bare, keep = mine.lay, mine.lay.partial, set(mine.lay.kept)
        updates = mine.updates
        if self.plan.loss_normalization is LossNormalization.TOKEN and LOSS_TOKENS in batch:
            updates = self._token_weights(mine, batch[LOSS_TOKENS])
        factor = hooks.loss_factor(bare)
        kept: dict[int, dict[str, torch.Tensor]] = {}
        kept_losses: dict[int, torch.Tensor] = {}
        losses, flags, halt, reads = [], [], None, 0
        spans = [(s[0][0], s[-1][1]) if s else None for s in updates]
        sim = _ReplicaGrads(self.optimizer) if self.world_size == 1 and self.plan.replication_factor > 1 else None
        streams = CallStreams(hooks.generator(), lay.num_micro_batches)
        for u, (steps, (offset, chunk)) in enumerate(zip(updates, self._feed(batch, spans))):
            hooks.zero_grad()
            local = torch.zeros((), dtype=torch.float32, device=self.device)
            for i, (start, stop, weight, j) in enumerate(steps):
                if sim is not None:
                    sim.switch(lay.replica[j])
                streams.enter(j)
                with hooks.no_sync(i == len(steps) - 1, bare):
                    out = hooks.forward(model_inputs(slice_rows(chunk, start - offset, stop - offset)), bare)
                    loss = self._loss(out, along)
                    hooks.backward(loss if weight * factor == 1.0 else loss * (weight * factor))
                local += loss.detach().float()
                if j in keep:
                    kept[j] = _detached(out)
                    kept_losses[j] = loss.detach().float()
            if sim is not None:
                sim.reduce()
            total = hooks.reduce(local, bare).float()
            bad = ~torch.isfinite(total)
            if hooks.host_check():
                reads += 1
                if not bad.item():
                    reads += hooks.step() or 0
                elif self.skip_nan:
                    hooks.zero_grad()
                else:
                    self.host_syncs += reads
                    raise NonFiniteLoss(_nan_text(total.item(), u, lay.num_updates, 0))
            else:
                halt = bad if (self.skip_nan or halt is None) else halt | bad
                hooks.step_unless(halt, u)
            losses.append(total)
            flags.append(bad)
        streams.end()
        self._issue_staged()
        self.host_syncs += reads
        mine_kept = [j for j in lay.kept if lay.replica[j] == self.rank or self.world_size == 1]
        outputs: Any = {j: kept[j] for j in mine_kept}
        reported = sorted(kept_losses)
        packed, outputs = self._read(torch.cat([torch.stack(losses), torch.stack(flags).float()]
                                               + [kept_losses[j].reshape(1) for j in reported]), outputs)
        packed = packed.tolist()
        values, bad_flags = packed[:len(losses)], packed[len(losses):2 * len(losses)]
        skipped = [u for u, b in enumerate(bad_flags) if b]
        if skipped and not self.skip_nan:
            hooks.rollback(skipped[0])
            raise NonFiniteLoss(_nan_text(values[skipped[0]], skipped[0], lay.num_updates,
                                          lay.num_updates - skipped[0] - 1))
        # the reported loss: the micro-batches the output mode returns (all of them for Sum), as an IPU
        # returns them, in applied updates; with R processes this replica's, averaged over replicas later
        shown = [(j, v) for j, v in zip(reported, packed[2 * len(losses):]) if not bad_flags[lay.update[j]]]
        outputs, rows = self._outputs(mine, outputs)
        extras: dict[str, Any] = {"micro_batches": lay.num_micro_batches, "partial": lay.partial,
                                  "skipped_updates": len(skipped), "host_syncs": 1 + reads}
        if self.world_size > 1:
            extras.update(replica=self.rank, shard_rows=mine.rows)
        first = lay.starts if self.inputs == "full" else mine.starts
        return StepResult(outputs=outputs, rows=rows, updates=lay.num_updates - len(skipped), extras=extras,
                          loss=_reported_loss(lay, shown),
                          loss_parts=tuple((first[j], first[j] + lay.micro_rows(j), v) for j, v in shown))

    def _token_weights(self, mine: _Mine, loss_tokens: torch.Tensor
                       ) -> tuple[tuple[tuple[int, int, float, int], ...], ...]:
        """This process's updates with the token weights of ``--loss-normalization token``: each micro-batch's
        tokens (from the host's ``loss_tokens``) over its update's, summed over the replicas by one small
        all-reduce when R processes run (each sees only its own rows)."""
        cum = token_prefix(loss_tokens)
        tokens = {j: cum[stop] - cum[start] for steps in mine.updates for start, stop, _, j in steps}
        totals = update_totals(mine.lay, tokens)
        if self.world_size > 1:
            summed = torch.tensor(totals, dtype=torch.float64, device=self.device)
            dist.all_reduce(summed, group=self.group)
            totals = summed.tolist()
        weights = mine.lay.token_weights(tokens, totals)
        return tuple(tuple((start, stop, weights[j], j) for start, stop, _, j in steps) for steps in mine.updates)

    def _shard(self, batch: TensorBatch) -> tuple[_Mine, TensorBatch]:
        """This process's part of the call, and its rows (cut here from a whole call with inputs="full")."""
        local_rows = total = batch_rows(batch)
        if self.world_size > 1 and self.inputs == "full":
            self.plan.layout(total)  # validates
            batch = self.plan.shard(batch, self.rank)
            local_rows = batch_rows(batch)
        elif self.world_size > 1 and self.plan.drop_last:
            total = local_rows * self.world_size
        elif self.world_size > 1:  # shard sizes differ in an epoch tail: every replica learns the row count
            counts = torch.zeros(self.world_size, dtype=torch.int64, device=self.device)
            counts[self.rank] = local_rows
            dist.all_reduce(counts, group=self.group)
            got = counts.tolist()
            total = sum(got)
            expected = [self._part(total, r).rows for r in range(self.world_size)]
            if got != expected:  # every rank sees the same counts, so every rank raises
                raise PlanError(f"replica shards have {got} rows but the plan's layout of a {total}-row call "
                                f"gives {expected}: cut shards with plan.shard(batch, rank)")
        mine = self._part(total, self.rank)
        if mine.rows != local_rows:
            raise PlanError(f"replica {self.rank} got {local_rows} rows; a {total}-row call gives it "
                            f"{mine.rows} (the plan's [D, G, b] slice: plan.shard(batch, rank))")
        return mine, batch

    def _part(self, total: int, rank: int) -> _Mine:
        if (total, rank) not in self._mine:
            lay = self.plan.layout(total)
            js = range(lay.num_micro_batches) if self.world_size == 1 else lay.replica_micro_batches(rank)
            starts, pos = {}, 0
            for j in js:
                starts[j], pos = pos, pos + lay.micro_rows(j)
            updates = tuple(tuple((starts[j], starts[j] + lay.micro_rows(j), lay.weight[j], j)
                                  for j in u if j in starts) for u in lay.updates)
            if len(self._mine) > 64:
                self._mine.clear()
            self._mine[(total, rank)] = _Mine(lay, updates, pos, starts)
        return self._mine[(total, rank)]

    def _outputs(self, mine: _Mine, kept: dict[int, dict[str, torch.Tensor]]
                 ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """The outputs the layout keeps: all of them in one process or when gathered (every rank gets the
        whole call's, in the plan's order); else this replica's, rows indexing the batch it was given."""
        lay = mine.lay
        if self.world_size > 1 and self.gather_outputs:
            kept = self._gather(kept)
        if self.world_size == 1 or self.gather_outputs:
            return combine_outputs(lay, [kept[j] for j in lay.kept]), lay.out_rows
        js = tuple(kept)
        own = dataclasses.replace(lay, kept=js, sum_groups=None if lay.sum_groups is None else (js,))
        if lay.sum_groups is not None:
            return combine_outputs(own, [kept[j] for j in js]), None
        first = lay.starts if self.inputs == "full" else mine.starts
        rows = [torch.arange(first[j], first[j] + lay.micro_rows(j)) for j in js]
        index = torch.cat(rows) if rows else torch.empty(0, dtype=torch.long)
        return combine_outputs(own, [kept[j] for j in js]), index

    def _gather(self, kept: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
        """Every replica's kept outputs, gathered as device tensors: one small exchange of their shapes,
        then one all-gather per output name (no pickled tensors)."""
        meta = {j: {k: (tuple(v.shape), str(v.dtype).split(".")[-1]) for k, v in out.items()}
                for j, out in kept.items()}
        metas: list[Any] = [None] * self.world_size
        dist.all_gather_object(metas, meta, group=self.group)
        names = sorted({k for m in metas for out in m.values() for k in out})
        gathered: dict[int, dict[str, torch.Tensor]] = {j: {} for m in metas for j in m}
        for name in names:
            dtype = next(getattr(torch, out[name][1]) for m in metas for out in m.values() if name in out)
            sizes = [sum(math.prod(out[name][0]) for out in m.values() if name in out) for m in metas]
            local = [kept[j][name].reshape(-1) for j in sorted(kept) if name in kept[j]]
            flat = torch.cat(local) if local else torch.empty(0, dtype=dtype, device=self.device)
            padded = torch.zeros(max(sizes), dtype=dtype, device=self.device)
            padded[:flat.numel()] = flat
            parts = [torch.empty_like(padded) for _ in range(self.world_size)]
            dist.all_gather(parts, padded, group=self.group)
            for part, m in zip(parts, metas):
                offset = 0
                for j in sorted(m):
                    if name in m[j]:
                        shape = m[j][name][0]
                        gathered[j][name] = part[offset:offset + math.prod(shape)].view(shape)
                        offset += math.prod(shape)
        return gathered

    @torch.no_grad()
    def eval_step(self, batch: TensorBatch) -> StepResult:
        n = batch_rows(batch)
        lay = self.eval_plan.layout(n)
        self.hooks.set_training(False)
        spans = [(lay.starts[js[0]], lay.stops[js[-1]]) for js in lay.updates]
        outs: list[dict[str, torch.Tensor]] = []
        loss_sum: torch.Tensor | None = None
        means, spans_of = [], []  # each micro-batch's mean loss and rows, read with the sum
        for js, (offset, chunk) in zip(lay.updates, self._feed(batch, spans)):
            for j in js:
                s, e = lay.starts[j], lay.stops[j]
                out = self.hooks.forward(model_inputs(slice_rows(chunk, s - offset, e - offset)), True)
                outs.append(_detached(out))  # a forward that returns no dict is named here
                if out.get("loss") is not None:
                    means.append(out["loss"].detach().float().reshape(1))
                    spans_of.append((s, e))
                    part = means[-1][0] * (e - s)
                    loss_sum = part if loss_sum is None else loss_sum + part
        self._issue_staged()
        read = None if loss_sum is None else torch.cat([loss_sum.reshape(1), *means])
        values, outputs = self._read(read, combine_outputs(lay, outs))
        values = None if values is None else values.tolist()
        return StepResult(outputs=outputs, rows=lay.out_rows, updates=0,
                          loss=None if values is None else values[0] / n,
                          extras={"micro_batches": lay.num_micro_batches, "host_syncs": 1},
                          loss_parts=None if values is None else tuple(
                              (s, e, v) for (s, e), v in zip(spans_of, values[1:])))

    @property
    def stages(self) -> bool:
        return self.hooks.copier is not None

    def stage(self, batch: TensorBatch) -> None:
        """Copy ``batch`` to the device ahead of its step: the copy is issued once the kernels of the next
        call are queued (so it overlaps them), and the step given this same object uses it."""
        if self.hooks.copier is None or self.hooks.on_device(batch) or id(batch) in self._staged:
            return
        pin_ahead = getattr(self.hooks.copier, "pin_ahead", None)
        self._staged[id(batch)] = _Staged(batch, pinned=pin_ahead(batch) if pin_ahead is not None else None)
        while len(self._staged) > self.max_staged:
            self._staged.popitem(last=False)

    def _issue_staged(self) -> None:
        for entry in self._staged.values():
            if entry.pending is None and entry.pinned is not None:   # pinned meanwhile on the pin thread
                entry.pending = self.hooks.copier.start(entry.pinned.result(), pinned=True)
            elif entry.pending is None:
                entry.pending = self.hooks.copier.start(entry.batch)

    def _feed(self, batch: TensorBatch, spans: list[tuple[int, int] | None]
              ) -> Iterator[tuple[int, TensorBatch | None]]:
        """(row offset, rows on the device) per span; span u+1 is copied once span u's work is queued."""
        entry, copier = self._staged.pop(id(batch), None), self.hooks.copier
        whole: Any = None
        if entry is not None and entry.pending is not None:
            whole = copier.finish(entry.pending)
        elif copier is None or self.hooks.on_device(batch):
            whole = batch
        elif not self.hooks.prefetch or len(spans) == 1:
            whole = copier.finish(copier.start(batch))
        for span in spans:
            if span is None or whole is not None:
                yield 0, None if span is None else whole
            else:
                yield span[0], copier.finish(copier.start(slice_rows(batch, span[0], span[1])))

    def _read(self, values: torch.Tensor | None, outputs: Any) -> tuple[Any, Any]:
        self.host_syncs += 1
        return self.hooks.to_host((values, outputs))


class _ReplicaGrads:
    """R replicas simulated in one process: each accumulates its own micro-batches' gradients, and the
    update's gradient is their sum in replica order, as R processes' all-reduce (and the IPU emulator) add
    them; one ``.grad`` for all would add the same terms in another order (other float roundings)."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        self.grads: dict[int, list[torch.Tensor | None]] = {}
        self.current: int | None = None

    def switch(self, replica: int) -> None:
        """Put ``replica``'s gradients in ``.grad``, keeping those of the replica that ran before."""
        if replica == self.current:
            return
        if self.current is not None:
            self.grads[self.current] = [p.grad for p in self.params]
        for i, p in enumerate(self.params):
            p.grad = self.grads[replica][i] if replica in self.grads else None
        self.current = replica

    def reduce(self) -> None:
        """The replicas' gradients, added in replica order, into ``.grad``; ready for the next update."""
        if self.current is not None:
            self.grads[self.current] = [p.grad for p in self.params]
        for i, p in enumerate(self.params):
            total = None
            for r in sorted(self.grads):
                g = self.grads[r][i]
                total = g if total is None else total if g is None else total + g
            p.grad = total
        self.grads.clear()
        self.current = None


def _nan_text(value: float, update: int, updates: int, after: int) -> str:
    what = f"it and the {after} update{'s' * (after > 1)} after it were not applied" if after else \
        "the update was not applied"
    return (f"non-finite training loss ({value}) in weight update {update + 1} of {updates} of this call; "
            f"{what}. Lower --learning-rate, or pass --skip-nan to skip such steps")


def _reported_loss(lay: CallLayout, shown: list[tuple[int, float]]) -> float | None:
    """The loss a step reports from its shown micro-batches' (index, mean loss): their mean, each weighted by
    its rows in a tail (whose micro-batches differ in rows), so that it is the mean loss of the rows trained."""
    if not shown:
        return None
    if not lay.partial:
        return sum(v for _, v in shown) / len(shown)
    rows = [lay.stops[j] - lay.starts[j] for j, _ in shown]
    return sum(n * v for n, (_, v) in zip(rows, shown)) / sum(rows)


__all__ = ["LayoutEngine", "check_outputs", "check_trainable", "loss_of", "slice_rows"]
