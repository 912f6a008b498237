"""The IPU engine: an :class:`~accelbatch.plan.ExecutionPlan` run through the poptorch API.

Written once against ``poptorch`` (real, or :mod:`accelbatch.backends.poptorch_emulator` with the same API):

* :func:`plan_options` maps the plan to ``poptorch.Options``: ``deviceIterations(D)``,
  ``replicationFactor(R)``, ``Training.gradientAccumulation(G)``,
  ``Training.accumulationAndReplicationReductionType(Mean|Sum)``, ``outputMode(mode, period)`` and
  ``randomSeed``. PopTorch's ``EveryN`` counts device iterations while the plan's counts the ``D x G``
  iterations of a call; the two agree when ``G = 1``. With ``G > 1`` the device returns ``All`` and the
  host applies the plan's selection (:meth:`ExecutionPlan.select_tensor`).
* Input replica grouping (``plan.input_group_size`` N > 1): ``inputReplicaGrouping(N, type)``; a call carries
  the rows of the R / N input groups and the device returns all R replicas' outputs, of which the engine keeps
  each group's first replica's (:func:`~.ipu_graph.group_leaders_only`): one output per row fed.
* accelbatch models take a dict and return a dict; an IPU graph takes positional tensors and returns
  ``(outputs..., loss)`` with the loss last. :class:`InputsAdapter` does the translation in a fixed key
  order (the batch's keys, sorted), so PopTorch's errors name the batch keys.
* Static shapes: a graph is compiled per input signature (keys, shapes, dtypes). The engine keeps one
  ``trainingModel`` / ``inferenceModel`` per signature, each around its own adapter of the *same* user
  module (host weights are shared), counts compilations (:attr:`IPUEngine.compilations`,
  ``StepResult.extras["compilations"]``) and keeps one executor attached at a time: switching copies the
  weights to the host (``copyWeightsToHost``), detaches, attaches the next and copies the weights to it
  (``copyWeightsToDevice``), as a real IPU needs.
* The optimizer: torch's SGD / Adam / AdamW / RMSprop become ``poptorch.optim``'s (:mod:`.ipu_optim`), whose
  state PopTorch reads back from the device: ``state_dict()`` holds it (``"ipu_state"``), a loaded one goes
  to the device before the next step. Detaching a graph reads the state back and attaching the next writes
  it, so every training graph (one per bucket shape) continues one state; before stepping a graph the
  engine gives it the optimizer again (``setOptimizer``), so ``optimizer.state_dict()`` reads from the
  graph that stepped last, and it evicts an old graph before wrapping a new one.
* Evaluation: a call with fewer rows than the eval combined batch is padded with whole micro-batches of
  zero rows and the outputs are cut back; a remainder of fewer rows than a micro-batch runs through a
  graph of micro batch 1 and b x D device iterations (one call; one more compilation per input shape),
  so no micro-batch mixes real and padding rows. The loss averages the micro-batch losses weighted by
  their real rows, as the CPU engine does, and is exact whatever the model does with padding rows.
* Training runs full calls (any multiple of D x R x G rows, as the plan allows); a partial training tail
  (``--no-drop-last``) has no static shape and is refused with a PlanError saying to use ``--drop-last``.
* A batch's ``loss_tokens`` (per-row token counts) never reaches the model. Under ``--loss-normalization
  token`` it becomes a per-row ``_loss_scale`` input (micro-batch j's rows hold t_j / T_u x G x R) that the
  adapter multiplies the marked loss by, so the device's Mean reduction yields the per-token mean of each
  update; the loss the graph returns for reporting stays the model's own.
* ``StepResult.loss`` is the mean of the losses the output mode brings back: every micro-batch's for All
  and Sum (exactly the CPU engine's number), the last of each replica for Final, every N-th for EveryN
  (``extras["loss_micro_batches"]`` says how many). ``int64`` outputs, which an IPU returns as ``int32``,
  are cast back to the dtype the model produced.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import os
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Mapping, Tuple

import torch

from accelbatch.layout import token_prefix, update_totals
from accelbatch.plan import LOSS_TOKENS, ExecutionPlan, LossNormalization, OutputMode, PlanError, batch_rows

from .base import Engine, NonFiniteLoss, StepResult, TensorBatch
from .engine import check_trainable
from .ipu_graph import LOSS_SCALE, InputsAdapter, group_leaders_only, make_adapter, plan_options
from .ipu_latency import LatencyStats
from .ipu_optim import dropped_state_notice, load_optimizer_state, to_poptorch_optimizer
from .ipu_settings import IPUSettings

log = logging.getLogger("accelbatch.ipu")

Signature = Tuple[Tuple[str, Tuple[int, ...], torch.dtype], ...]
# --- the engine ------------------------------------------------------------------------------------------

def signature_of(batch: Mapping[str, torch.Tensor]) -> Signature:
    """What a compiled graph is specialised for: each input's key, shape and dtype (keys sorted)."""
    return tuple((k, tuple(batch[k].shape), batch[k].dtype) for k in sorted(batch))


@dataclass
class _Executor:
    training: bool
    signature: Signature
    adapter: InputsAdapter
    executor: Any
    plan: ExecutionPlan
    compilations: int = 0
    calls: int = 0
    hparams: str | None = None

    @property
    def keys(self) -> tuple[str, ...]:
        return self.adapter.keys


class IPUEngine(Engine):
    """Runs an :class:`ExecutionPlan` through ``poptorch`` (see the module docstring).

    ``poptorch`` is the module to use (real or emulator); ``seed`` goes to ``Options.randomSeed``;
    ``max_executors`` bounds the graphs kept (least recently used ones are destroyed and, if needed
    again, compiled again and counted).
    """

    def __init__(self, poptorch: Any, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None,
                 plan: ExecutionPlan | None = None, seed: int | None = None, max_executors: int = 16,
                 settings: IPUSettings | None = None):
        self.poptorch = poptorch
        self.settings = settings if settings is not None else IPUSettings()
        self._cache_loads = 0
        self.model = model
        self.optimizer = to_poptorch_optimizer(poptorch, optimizer)  # its state can come back from the device
        # said when a training graph is first made: an evaluation uses no optimizer state
        self._dropped_state = dropped_state_notice(optimizer) if self.optimizer is not optimizer else None
        self._bound: _Executor | None = None  # the executor whose state optimizer.state_dict() reads back
        self.plan = plan if plan is not None else ExecutionPlan()
        self.eval_plan = self.plan.for_inference()
        self.seed = seed
        self.max_executors = max(2, int(max_executors))
        self._executors: OrderedDict[tuple[bool, int, Signature], _Executor] = OrderedDict()
        self._active: _Executor | None = None
        self._compilations = 0
        self._history: list[dict[str, Any]] = []
        self.latency = LatencyStats()  # getLatency() of each call, when the poptorch in use has it

    # --- reporting -------------------------------------------------------------------------------
    @property
    def compilations(self) -> int:
        """Graphs compiled so far (training and inference, recompilations after eviction included)."""
        return self._compilations

    @property
    def cache_loads(self) -> int:
        """Graphs loaded from --ipu-cache-dir instead of compiled (not counted in ``compilations``)."""
        return self._cache_loads

    @property
    def compiled_graphs(self) -> list[dict[str, Any]]:
        """One record per compilation: {"training", "inputs": {key: shape}} in compile order."""
        return list(self._history)

    @property
    def implementation(self) -> str:
        """Which poptorch runs the graphs: "poptorch" or "poptorch-emulator"."""
        return "poptorch-emulator" if getattr(self.poptorch, "IS_EMULATOR", False) else "poptorch"

    @property
    def num_executors(self) -> int:
        return len(self._executors)

    # --- executors -------------------------------------------------------------------------------
    def _executor_for(self, training: bool, batch: Mapping[str, torch.Tensor],
                      plan: ExecutionPlan | None = None) -> _Executor:
        plan = plan if plan is not None else (self.plan if training else self.eval_plan)
        sig = signature_of(batch)
        key = (training, plan.micro_batch, sig)
        entry = self._executors.get(key)
        if entry is not None:
            self._executors.move_to_end(key)
            return entry
        while len(self._executors) >= self.max_executors:  # before a new wrapper takes the optimizer (see above)
            self._evict(next(iter(self._executors)))
        keys = tuple(k for k, _, _ in sig)
        adapter = make_adapter(self.model, keys, training, getattr(self.poptorch, "identity_loss", None))
        options = plan_options(self.poptorch, plan, self.seed, self.settings)
        if training:
            if self._dropped_state:
                log.warning(self._dropped_state)
                self._dropped_state = None
            executor = self.poptorch.trainingModel(adapter, options=options, optimizer=self.optimizer)
        else:
            executor = self.poptorch.inferenceModel(adapter, options=options)
        entry = _Executor(training=training, signature=sig, adapter=adapter, executor=executor, plan=plan)
        self._executors[key] = entry
        return entry

    def _evict(self, key: tuple[bool, int, Signature]) -> None:
        entry = self._executors.pop(key)
        if entry is self._bound:
            self._bound = None
        if entry is self._active:
            self._release(entry)
            self._active = None
        if entry.executor.isCompiled():
            entry.executor.destroy()

    def _release(self, entry: _Executor) -> None:
        """Weights back to the host (training graphs change them), then off the device."""
        ex = entry.executor
        if not ex.isCompiled():
            return
        if entry.training:
            ex.copyWeightsToHost()
        if ex.isAttachedToDevice():
            ex.detachFromDevice()

    def _activate(self, entry: _Executor) -> None:
        """Make ``entry`` the one executor on the device, with the host's current weights."""
        if self._active is entry:
            return
        if self._active is not None:
            self._release(self._active)
        ex = entry.executor
        if ex.isCompiled():  # (a first call compiles, attaches and uploads the host weights itself)
            if ex.isAttachedToDevice():
                ex.copyWeightsToDevice()
            else:
                ex.attachToDevice()  # which uploads the host's weights: no second copy
        self._active = entry

    def _sync_optimizer(self, entry: _Executor) -> None:
        """Send changed hyper-parameters (lr, ...) to the executor: a device reads them only on setOptimizer,
        which also makes ``optimizer.state_dict()`` read the state back from this executor."""
        if self.optimizer is None:
            return
        now = repr([sorted((k, v) for k, v in g.items() if k != "params") for g in self.optimizer.param_groups])
        if entry.hparams is None:
            entry.hparams = now  # the wrapper read them (and took the optimizer) when it was made
        elif entry.hparams != now or entry is not self._bound:
            entry.executor.setOptimizer(self.optimizer)
            entry.hparams = now
        self._bound = entry

    def _call(self, entry: _Executor, batch: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor],
                                                                                 torch.Tensor | None, bool]:
        ex = entry.executor
        compiled_before = ex.isCompiled()
        cache = _cache_files(self.settings.cache_dir) if not compiled_before else None
        batch = self.settings.cast_inputs(dict(batch))
        try:
            result = ex(*[batch[k] for k in entry.keys])
        except getattr(self.poptorch, "Error", ()) as exc:
            if compiled_before:
                raise
            # the model or plan cannot be compiled (e.g. a model's own BeginBlock placement): the user's to fix
            message = str(getattr(exc, "message", "") or exc)
            log.error("ipu: poptorch could not compile the %s graph: %s", "training" if entry.training
                      else "inference", message)
            raise PlanError(f"--device ipu: poptorch could not compile the model: {message.splitlines()[0]}") from exc
        self.latency.record(ex)
        compiled = not compiled_before
        if compiled and cache is not None and not _cache_files(self.settings.cache_dir) - cache:
            self._cache_loads += 1  # an executable found in the cache (nothing new written): not compiled
        elif compiled:
            self._compilations += 1
            entry.compilations += 1
            self._history.append({"training": entry.training,
                                  "inputs": {k: shape for k, shape, _ in entry.signature}})
            if self._compilations > 1:
                log.info("ipu: compiled graph #%d (%s) for inputs %s", self._compilations,
                         "training" if entry.training else "inference",
                         ", ".join(f"{k}{list(s)}" for k, s, _ in entry.signature))
        entry.calls += 1
        flat = (result,) if isinstance(result, torch.Tensor) else tuple(result or ())
        meta = entry.adapter.meta
        keys, has_loss, dtypes = meta["out_keys"] or (), bool(meta["has_loss"]), meta["dtypes"] or {}
        outputs = {}
        for k, t in zip(keys, flat):
            want = dtypes.get(k)
            outputs[k] = t.to(want) if want is not None and t.dtype != want else t
        loss = flat[len(keys)] if has_loss else None
        if entry.plan.input_group_size > 1:  # one output per row fed: each input group's first replica's
            scalars = meta["scalars"] or set()
            outputs = {k: group_leaders_only(entry.plan, t, k in scalars) for k, t in outputs.items()}
            loss = group_leaders_only(entry.plan, loss, False) if loss is not None else None
        return outputs, loss, compiled

    # --- training --------------------------------------------------------------------------------
    def _check_train(self) -> None:
        check_trainable(self.optimizer, self.plan)

    def train_step(self, batch: TensorBatch) -> StepResult:
        self._check_train()
        n = batch_rows(batch)
        plan = self.plan
        lay = plan.layout(n)
        if lay.partial:
            raise PlanError(
                f"a training call of {n} rows is a partial tail (not a multiple of D x R x G = "
                f"{plan.factor}); an IPU graph has static shapes and cannot run it: with --drop-last (the "
                "default) dynamic batching drops such batches and says so; an ordered pass needs -dt train")
        batch = self._with_loss_scale(batch, lay)
        entry = self._executor_for(True, batch)
        self._activate(entry)
        self._sync_optimizer(entry)
        if not self.model.training:
            self.model.train()
        outputs, loss, compiled = self._call(entry, batch)
        mode = plan.output_mode
        loss_value, counted, parts = None, 0, None
        if loss is not None:
            lf = loss.detach().float()
            if mode is OutputMode.SUM:
                loss_value, counted = float(lf.sum()) / plan.factor, plan.factor
            else:
                loss_value, counted = float(lf.mean()), max(1, lf.numel())
                if lf.numel() == len(lay.kept):  # one loss per micro-batch returned, in the layout's order
                    parts = tuple((lay.starts[j], lay.stops[j], v) for j, v in zip(lay.kept, lf.reshape(-1).tolist()))
        if loss_value is not None and not math.isfinite(loss_value):
            scale = self.settings.loss_scaling
            cause = (f"lower --ipu-loss-scaling ({scale:g}: the scaled loss and gradients overflow float16 under "
                     "--mixed-precision fp16; 1 turns it off) or --learning-rate") if self.settings.half and \
                scale > 1 else "lower --learning-rate"
            raise NonFiniteLoss(f"non-finite training loss ({loss_value}) on ipu: the device applies a call's "
                                "updates before its loss is read, so the run stops here (--skip-nan cannot skip "
                                f"them on an IPU); {cause}")
        return StepResult(outputs=outputs, rows=lay.out_rows, loss=loss_value, updates=lay.num_updates,
                          extras={"micro_batches": lay.num_micro_batches, "partial": False,
                                  "compilations": self._compilations, "compiled": compiled,
                                  "loss_micro_batches": counted}, loss_parts=parts)

    def _with_loss_scale(self, batch: TensorBatch, lay: Any) -> TensorBatch:
        """``batch`` without ``loss_tokens``; under ``--loss-normalization token`` with a ``_loss_scale``
        column instead: each row of micro-batch j holds t_j / T_u x (G x R / N), its micro-batch's share of its
        update's tokens, times what the device's Mean reduction divides by (G x R, over the N replicas of
        each input group that run micro-batch j)."""
        tokens = batch.get(LOSS_TOKENS)
        if tokens is None:
            return batch
        batch = {k: v for k, v in batch.items() if k != LOSS_TOKENS}
        if self.plan.loss_normalization is not LossNormalization.TOKEN:
            return batch
        cum = token_prefix(tokens)
        per = {j: cum[e] - cum[s] for j, (s, e) in enumerate(zip(lay.starts, lay.stops))}
        weights = lay.token_weights(per, update_totals(lay, per))
        scale = torch.empty(lay.rows, dtype=torch.float32)
        for j, (s, e) in enumerate(zip(lay.starts, lay.stops)):
            scale[s:e] = weights[j] * self.plan.gradient_accumulation * self.plan.input_groups
        batch[LOSS_SCALE] = scale
        return batch

    # --- inference -------------------------------------------------------------------------------
    def eval_step(self, batch: TensorBatch) -> StepResult:
        """Outputs for ``batch``'s rows; the loss is the mean over its real rows only.

        Rows that fill whole micro-batches run through the eval graph in calls of its combined batch (a
        dynamic batch of more rows in several calls, of one shape), the last padded with whole micro-batches
        of zero rows (left out of the loss). A remainder of r < micro rows runs through a graph of micro
        batch 1 (b x D device iterations, same R), so no micro-batch mixes real and padding rows: a model
        whose loss is the mean over all its rows (padding included) still reports the loss of the real rows.
        """
        n = batch_rows(batch)
        batch = {k: v for k, v in batch.items() if k != LOSS_TOKENS}
        plan = self.eval_plan
        lay = plan.layout(n)
        whole = n - n % plan.micro_batch
        chunks: list[tuple[ExecutionPlan, int, int]] = [
            (plan, s, min(s + plan.combined_batch, whole)) for s in range(0, whole, plan.combined_batch)]
        if whole < n:
            rows_plan = self._rows_plan
            step = rows_plan.combined_batch
            chunks += [(rows_plan, s, min(s + step, n)) for s in range(whole, n, step)]
        if self.model.training:
            self.model.eval()
        parts, loss_parts, compiled, padded_rows = [], [], False, 0
        for chunk_plan, start, stop in chunks:
            outputs, chunk_parts, chunk_compiled, pad = self._eval_call(chunk_plan, batch, n, start, stop)
            parts.append((outputs, stop - start))
            compiled |= chunk_compiled
            padded_rows += pad
            loss_parts += chunk_parts or []
        outputs = parts[0][0] if len(parts) == 1 else _cat_rows(parts)
        loss = sum(v * (e - s) for s, e, v in loss_parts) / n if loss_parts else None
        return StepResult(outputs=outputs, rows=lay.out_rows, loss=loss, loss_parts=tuple(loss_parts) or None,
                          updates=0, extras={"micro_batches": lay.num_micro_batches, "padded_rows": padded_rows,
                                             "compilations": self._compilations, "compiled": compiled})

    @functools.cached_property
    def _rows_plan(self) -> ExecutionPlan:
        """Micro batch 1 with b x D device iterations: the eval call's rows, one per micro-batch, so a
        remainder of fewer rows than a micro-batch runs in one call without mixing in padding rows."""
        p = self.eval_plan
        return dataclasses.replace(p, micro_batch=1, device_iterations=p.micro_batch * p.device_iterations)

    def _eval_call(self, plan: ExecutionPlan, batch: TensorBatch, n: int, start: int,
                   stop: int) -> tuple[dict[str, torch.Tensor], list[tuple[int, int, float]] | None, bool, int]:
        """Rows [start, stop) of ``batch`` padded to ``plan``'s combined batch, run once.

        Returns the real rows' outputs, each micro-batch's (first row, end row, mean loss) over its real rows
        (micro-batches of padding only are left out, their loss may well be NaN), whether the call compiled a
        graph and how many padding rows it carried.
        """
        rows = stop - start
        part = batch if rows == n else {k: (t[start:stop] if t.dim() and t.shape[0] == n else t)
                                        for k, t in batch.items()}
        target = max(rows, plan.combined_batch)
        padded = _pad_rows(part, rows, target) if target > rows else part
        entry = self._executor_for(False, padded, plan)
        self._activate(entry)
        outputs, loss, compiled = self._call(entry, padded)
        if target > rows:
            outputs = {k: (v[:rows] if v.dim() and v.shape[0] == target else v) for k, v in outputs.items()}
        loss_parts = None
        if loss is not None:
            values = loss.detach().double().reshape(-1).tolist()
            per = target // len(values)
            loss_parts = [(start + j * per, start + min((j + 1) * per, rows), v)
                          for j, v in enumerate(values) if j * per < rows]
        return outputs, loss_parts, compiled, target - rows

    # --- weights and lifetime ---------------------------------------------------------------------
    def sync_to_host(self) -> None:
        """Copy the device's weights to the host model (before reading or saving them on a real IPU)."""
        if self._active is not None and self._active.training and self._active.executor.isCompiled():
            self._active.executor.copyWeightsToHost()

    def state_dict(self) -> dict[str, Any]:
        self.sync_to_host()
        return super().state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.optimizer is not None and state.get("optimizer") is not None:
            load_optimizer_state(self.poptorch, self.optimizer, state["optimizer"])
            state = {k: v for k, v in state.items() if k != "optimizer"}
        if self.settings.half:
            # optimizer states stay float32 for a half model (PopTorch's accumulator types): loading them
            # while the weights are float16 would round them (an Adam second moment to 0, then an inf step)
            self.model.float()
            try:
                super().load_state_dict(state)
            finally:
                self.model.half()
        else:
            super().load_state_dict(state)
        active = self._active
        if active is not None and active.executor.isCompiled():
            active.executor.copyWeightsToDevice()

    def close(self) -> None:
        """Weights to the host, every graph destroyed (the engine compiles again if used afterwards)."""
        if self._active is not None:
            self._release(self._active)
            self._active = None
        for entry in self._executors.values():
            if entry.executor.isCompiled():
                entry.executor.destroy()
        self._executors.clear()


def _cache_files(path: str | None) -> set[str] | None:
    """The executables in an --ipu-cache-dir (None without one); a compilation adds one, a load none."""
    if path is None:
        return None
    try:
        return set(os.listdir(path))
    except OSError:
        return set()


def _cat_rows(parts: list[tuple[dict[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    """The outputs of consecutive row ranges (outputs, rows) joined; an output without those rows: the first's."""
    first, rows = parts[0]
    return {k: (torch.cat([p[k] for p, _ in parts]) if v.dim() and v.shape[0] == rows else v)
            for k, v in first.items()}


def _pad_rows(batch: Mapping[str, torch.Tensor], n: int, target: int) -> dict[str, torch.Tensor]:
    """Zero rows appended to every tensor with ``n`` rows, up to ``target`` rows."""
    out = {}
    for k, t in batch.items():
        if t.dim() and t.shape[0] == n:
            t = torch.cat([t, t.new_zeros((target - n, *t.shape[1:]))])
        out[k] = t
    return out


__all__ = ["IPUEngine", "InputsAdapter", "make_adapter", "plan_options", "signature_of"]
