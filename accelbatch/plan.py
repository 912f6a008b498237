"""ExecutionPlan: the single source of the batching semantics every backend runs.

Names follow PopTorch: ``b`` the micro batch (``--batchsize``), ``D`` device iterations, ``R`` replication
factor, ``G`` gradient accumulation. One host call (one world step) carries the *combined batch* of
``b x D x R x G`` rows in the *host layout* ``[D, G, R, b]``: row ``((d * G + g) * R + r) * b + i`` is row
``i`` of the micro-batch that replica ``r`` runs at accumulation step ``g`` of weight update ``d``.
Micro-batch ``j = (d * G + g) * R + r`` is therefore a contiguous block of ``b`` rows, and weight update
``d`` uses the contiguous block of ``G x R`` micro-batches ``j`` in ``[d*G*R, (d+1)*G*R)``.

Training call, as in PopTorch:

* ``D`` weight updates; update ``d`` combines the gradients of its ``G x R`` micro-batch losses:
  ``Reduction.MEAN`` (default) divides their sum by ``G x R``, ``Reduction.SUM`` keeps the sum.
* Outputs per :class:`OutputMode` (the model's per-row outputs; ``(D*G)`` "iterations" per replica):

  ====================  ===========================================================  ==================
  mode                  micro-batches returned, in this order                        dim0 multiplier
  ====================  ===========================================================  ==================
  ``ALL``               every one, order ``[D, G, R]`` (= the input row order)       ``D x G x R``
  ``EVERY_N`` (N)       device iterations ``N-1, 2N-1, ...`` of ``D``: each with its  ``D x G x R / N``
                        G micro-batches, for every R (PopART's anchor return period)
  ``FINAL``             the last iteration of each replica                           ``R``
  ``SUM``               per replica, the elementwise sum over its ``D x G``          ``R``
  ====================  ===========================================================  ==================

  A per-row output ``[b, ...]`` of one micro-batch becomes ``[multiplier x b, ...]``; a 0-dim output
  becomes ``[multiplier]``, and stays 0-dim when the multiplier is 1 (the *multiplier-1 rule*: a plan
  with ``D = G = R = 1`` changes no shape). ``"default"`` resolves to ``FINAL`` in training and ``ALL`` in
  inference. The row indices the selected outputs came from are returned with them (``None`` for SUM).

* A call whose row count is a multiple of ``D x R x G`` other than the combined batch is accepted, as
  PopTorch does: its micro batch is ``rows / (D x R x G)`` (dynamic batching changes ``b``, never ``D``,
  ``R`` or ``G``), with ``drop_last`` or without. Any other row count fails
  :meth:`ExecutionPlan.validate_batch` with PopTorch's "Invalid batch dimension" text, unless the plan has
  ``drop_last=False``: then it is an epoch tail (below).

Inference (:meth:`ExecutionPlan.for_inference`): the same world rows, micro batch ``b x G``, ``G = 1`` (an
inference plan with ``G > 1`` is refused, as PopTorch's ``inferenceModel`` refuses it), output ``ALL``:
evaluation always needs every row's reply. An eval call may carry fewer rows than the combined batch (the
last batch of an evaluation); it is cut into micro-batches of the eval micro batch, the last one shorter.

Partial tail policy (``drop_last=False`` only; with ``drop_last=True``, the default, the batch plan leaves
the tail out and counts it, ``dropped_exs``, an epoch still being one pass over the data). A training call
with ``n`` rows, ``n`` not a multiple of ``F = D x R x G``, is a tail (a pass's partial batch) and runs as
follows, identically on every backend:

1. it is cut, in row order, into ``M = ceil(n / b')`` micro-batches of ``b' = max(b, ceil(n / F))`` rows
   (the plan's micro batch, unless the tail has more rows than the combined batch: then ``M <= F``); only
   the last one may be shorter;
2. micro-batch ``j`` goes where it would go in a full call: weight update ``j // (G x R)`` and replica
   ``j % R`` (so replica shards stay contiguous in row order, filled replica-fastest, and a replica
   may have fewer micro-batches than another, or none, in the last update);
3. there are ``ceil(M / (G x R))`` weight updates (at most ``D``; the last accumulation window may be
   partial); each averages over the rows actually present: with ``Reduction.MEAN`` micro-batch ``j``'s
   loss is weighted ``n_j / N_u`` (``n_j`` its rows, ``N_u`` the rows of its update), so the update's
   gradient is exactly the gradient of the mean per-row loss over those rows (for a mean-loss model);
   with ``Reduction.SUM`` the weight is ``n_j / b'``, so a full micro-batch counts 1 and a short one in
   proportion to its rows;
4. the call returns every row's outputs (as ``ALL``), since the mode's shapes do not apply to a tail.

Loss normalisation (``--loss-normalization``, training): ``micro`` (the default) is the above, each
micro-batch's mean loss weighted by its rows (PopTorch's Mean reduction). ``token`` weighs micro-batch ``j``
by ``t_j / T_u``, its tokens over those of its update's G x R micro-batches (all replicas), so the update's
gradient is that of the per-token mean over the whole update, as one big batch would give, when micro-batches
hold different token counts. A batch gives each row's tokens as the optional per-row tensor
``"loss_tokens"`` (:data:`LOSS_TOKENS`; engines read it and never pass it to the model); without it every
row counts one token, which is ``micro``'s weighting. It needs ``--reduction mean``.

Input replica grouping (``--ipu-input-replica-grouping N``, PopTorch's ``Options.inputReplicaGrouping``;
IPU only): the R replicas form R / N *input groups* of N replicas that read the same rows. ``consecutive``
groups replicas ``q*N .. q*N+N-1``; ``orthogonal`` puts replica ``r`` in group ``r % (R / N)``. The host feeds
each group once, so everything above holds with the R / N groups in place of R (:attr:`input_groups`): a call
carries ``b x D x (R / N) x G`` rows in the layout ``[D, G, R / N, b]``, and its outputs are those of each
group's first replica (:attr:`group_leaders`), one per row fed. The gradients of a group's N replicas are
equal, so with MEAN an update equals that of R / N replicas without grouping (N equal gradients over R);
with SUM it is N times it.

For full calls the same weights reduce to ``1 / (G x R)`` (MEAN) and ``1`` (SUM), so one formula covers
both. :meth:`ExecutionPlan.layout` gives the whole layout of a call with ``n`` rows (micro-batch bounds,
replica, update and loss weight of each micro-batch, which outputs are kept); engines only execute it.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from accelbatch.layout import (
    LOSS_TOKENS,
    CallLayout,
    LossNormalization,
    OutputMode,
    PlanError,
    Reduction,
    batch_rows,
    combine_outputs,
    compute_layout,
    rows_of,
)
from accelbatch.opts import INPUT_GROUP_TYPES

if TYPE_CHECKING:
    from accelbatch.opts import Opts


MAX_MICRO_BATCHES = 2 ** 24  # D x G x R of one call (PopTorch's largest plans are some 10**6)
_FLAGS = {
    "micro_batch": "--batchsize",
    "device_iterations": "--device-iterations",
    "replication_factor": "--replication-factor",
    "gradient_accumulation": "--gradient-accumulation",
    "output_return_period": "--output-return-period",
    "input_group_size": "--ipu-input-replica-grouping",
}


@dataclass(frozen=True)
class ExecutionPlan:
    """Micro batch, D, R, G, output mode and reduction of one model's steps (frozen, validated)."""

    micro_batch: int = 1
    device_iterations: int = 1
    replication_factor: int = 1
    gradient_accumulation: int = 1
    output_mode: OutputMode = OutputMode.FINAL  # "default" (or any name) is accepted and resolved
    output_return_period: int = 1
    reduction: Reduction = Reduction.MEAN
    training: bool = True
    drop_last: bool = True
    loss_normalization: LossNormalization = LossNormalization.MICRO
    input_group_size: int = 1
    input_group_type: str = "consecutive"

    def __init__(self, micro_batch: int = 1, device_iterations: int = 1, replication_factor: int = 1,
                 gradient_accumulation: int = 1, output_mode: OutputMode | str | None = "default",
                 output_return_period: int = 1, reduction: Reduction | str = Reduction.MEAN,
                 training: bool = True, drop_last: bool = True,
                 loss_normalization: LossNormalization | str = LossNormalization.MICRO,
                 input_group_size: int = 1, input_group_type: str = "consecutive") -> None:
        set_ = functools.partial(object.__setattr__, self)
        set_("micro_batch", micro_batch)
        set_("device_iterations", device_iterations)
        set_("replication_factor", replication_factor)
        set_("gradient_accumulation", gradient_accumulation)
        set_("output_return_period", output_return_period)
        set_("training", bool(training))
        set_("drop_last", bool(drop_last))
        set_("output_mode", OutputMode.parse(output_mode, bool(training)))
        set_("reduction", Reduction.parse(reduction))
        set_("loss_normalization", LossNormalization.parse(loss_normalization))
        set_("input_group_size", input_group_size)
        set_("input_group_type", str(input_group_type).lower())
        self._check()

    # --- construction ------------------------------------------------------------------------
    @classmethod
    def from_opts(cls, opts: "Opts", training: bool) -> "ExecutionPlan":
        """The plan of ``opts`` (``--batchsize`` is the micro batch b) for training or inference.

        For inference the training options are mapped as :meth:`for_inference` does: the same world rows
        with micro batch ``b x G`` and ``G = 1``.
        """
        plan = cls(micro_batch=opts.batchsize, device_iterations=opts.device_iterations,
                   replication_factor=opts.replication_factor,
                   gradient_accumulation=opts.gradient_accumulation if training else 1,
                   output_mode=opts.output_mode if training else "all",
                   output_return_period=opts.output_return_period if training else 1,
                   reduction=opts.reduction, training=training, drop_last=opts.drop_last,
                   loss_normalization=opts.loss_normalization if training else "micro",
                   input_group_size=opts.ipu_input_replica_grouping,
                   input_group_type=opts.ipu_input_replica_grouping_type)
        if not training and opts.gradient_accumulation > 1:
            plan = dataclasses.replace(plan, micro_batch=opts.batchsize * opts.gradient_accumulation)
        return plan

    def _check(self) -> None:
        for name, flag in _FLAGS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlanError(f"{flag}: must be an integer of at least 1, got {value!r}")
        d, g, r = self.device_iterations, self.gradient_accumulation, self.replication_factor
        if d * g * r > MAX_MICRO_BATCHES:  # a call's layout holds an entry per micro-batch
            raise PlanError(f"--device-iterations {d} x --gradient-accumulation {g} x --replication-factor {r} = "
                            f"{d * g * r:,} micro-batches a call, more than the {MAX_MICRO_BATCHES:,} a call is laid "
                            "out for; lower them")
        n, r = self.input_group_size, self.replication_factor
        if r % n:
            fits = ", ".join(str(k) for k in range(1, r + 1) if r % k == 0)
            raise PlanError(f"--ipu-input-replica-grouping {n}: groups of replicas must divide "
                            f"--replication-factor {r}; use one of {fits}")
        if self.input_group_type not in INPUT_GROUP_TYPES:
            raise PlanError(f"--ipu-input-replica-grouping-type: {self.input_group_type!r} is not one of "
                            f"{', '.join(INPUT_GROUP_TYPES)}")
        n = self.output_return_period
        if self.output_mode is OutputMode.EVERY_N:
            d = self.device_iterations
            if d % n:
                fits = [k for k in range(1, d + 1) if d % k == 0]
                raise PlanError(
                    f"--output-return-period {n}: --output-mode everyn returns the last device iteration of "
                    f"each period of N (with all its --gradient-accumulation micro-batches), as PopTorch does, "
                    f"and a call has --device-iterations {d}, not a multiple of {n}; use a period dividing "
                    f"{d} ({', '.join(map(str, fits))}) or change --device-iterations")
        elif n != 1:
            raise PlanError(f"--output-return-period {n} applies only to --output-mode everyn "
                            f"(the output mode is {self.output_mode.value}); drop it or use everyn")
        if self.loss_normalization is LossNormalization.TOKEN and self.reduction is Reduction.SUM:
            raise PlanError("--loss-normalization token makes each update the per-token mean over its G x R "
                            "micro-batches, which --reduction sum (a sum of micro-batch means) contradicts: "
                            "use --reduction mean with it, or --loss-normalization micro")
        if not self.training and self.gradient_accumulation != 1:
            raise PlanError(
                f"--gradient-accumulation {self.gradient_accumulation}: gradient accumulation is a training "
                "option and an inference plan must have 1 (PopTorch's inferenceModel refuses it too); "
                "evaluate with plan.for_inference(), which keeps the world's rows with micro batch b x G")

    # --- sizes -------------------------------------------------------------------------------
    @property
    def input_groups(self) -> int:
        """R / N: the replica groups the host feeds (each replica its own without input grouping)."""
        return self.replication_factor // self.input_group_size

    def input_group_of(self, replica: int) -> int:
        """The input group replica ``replica`` reads (its host layout index in ``[D, G, R / N, b]``)."""
        if self.input_group_type == "orthogonal":
            return replica % self.input_groups
        return replica // self.input_group_size

    @property
    def group_leaders(self) -> tuple[int, ...]:
        """The first replica of each input group, in group order: the replicas whose outputs are kept."""
        step = 1 if self.input_group_type == "orthogonal" else self.input_group_size
        return tuple(q * step for q in range(self.input_groups))

    @property
    def factor(self) -> int:
        """D x (R / N) x G: the number of micro-batches of one call; rows must be a multiple of it."""
        return self.device_iterations * self.input_groups * self.gradient_accumulation

    @property
    def combined_batch(self) -> int:
        """b x D x (R / N) x G: the rows of one host call (the world's rows per step)."""
        return self.micro_batch * self.factor

    @property
    def iterations(self) -> int:
        """D x G: the micro-batches each replica runs per call."""
        return self.device_iterations * self.gradient_accumulation

    def for_inference(self) -> "ExecutionPlan":
        """The eval plan for the same world rows: micro batch b x G, same D and R, G = 1, output ALL."""
        if not self.training:
            return self
        return ExecutionPlan(micro_batch=self.micro_batch * self.gradient_accumulation,
                             device_iterations=self.device_iterations,
                             replication_factor=self.replication_factor, gradient_accumulation=1,
                             output_mode=OutputMode.ALL, output_return_period=1, reduction=self.reduction,
                             training=False, drop_last=False, input_group_size=self.input_group_size,
                             input_group_type=self.input_group_type)

    def describe(self) -> str:
        mode = self.output_mode.value + (f"({self.output_return_period})"
                                         if self.output_mode is OutputMode.EVERY_N else "")
        return (f"{'training' if self.training else 'inference'} plan: micro batch {self.micro_batch} x "
                f"D {self.device_iterations} x R {self.replication_factor} x G {self.gradient_accumulation} "
                f"= {self.combined_batch} rows per call, output {mode}, reduction {self.reduction.value}"
                + (", loss per token" if self.loss_normalization is LossNormalization.TOKEN else "")
                + (f", inputs shared by {self.input_group_type} groups of {self.input_group_size} replicas"
                   if self.input_group_size > 1 else ""))

    # --- validation --------------------------------------------------------------------------
    def validate_batch(self, rows: "int | torch.Tensor | Sequence[int]", name: str = "input") -> int:
        """Check that a call's row count is a multiple of D x R x G; return the row count.

        ``rows`` is a row count, a shape or a tensor. The error text is PopTorch's, then what to change.
        """
        if isinstance(rows, torch.Tensor):
            shape: Any = rows.shape
        elif isinstance(rows, int):
            shape = None
        else:
            shape = torch.Size(rows)
        n = (1 if len(shape) == 0 else shape[0]) if shape is not None else int(rows)
        if n >= 1 and n % self.factor == 0:
            return n
        what = repr(shape) if shape is not None else f"'{name}'"
        d, r, g = self.device_iterations, self.replication_factor, self.gradient_accumulation
        k = self.input_group_size
        grouped = f" / --ipu-input-replica-grouping({k})" if k > 1 else ""
        raise PlanError(
            f"Invalid batch dimension: In the input {what}, the batch dimension ({n}) must be a multiple of "
            f"Options.deviceIterations({d}) * (Options.replicationFactor({r}) / "
            f"Options.inputReplicaGrouping.input_group_size({k})) * "
            f"Options.Training.gradientAccumulation({g}) = {self.factor} because it is used to calculate "
            f"the batch size which will be executed on the device in any given iteration. "
            f"In accelbatch the rows per call ('{name}') are the combined batch --batchsize({self.micro_batch}) "
            f"x --device-iterations({d}) x --replication-factor({r}){grouped} x --gradient-accumulation({g}) = "
            f"{self.combined_batch}: give the engine batches of that size (or any multiple of {self.factor}), "
            f"or change --batchsize, --device-iterations, --replication-factor or --gradient-accumulation.")

    def is_tail(self, rows: int) -> bool:
        """True when a call of ``rows`` rows is run by the partial-tail policy: ``drop_last=False`` and rows
        not a multiple of D x R x G (a multiple runs as a full call with micro batch rows / (D x R x G))."""
        return not self.drop_last and rows > 0 and rows % self.factor != 0

    # --- layout ------------------------------------------------------------------------------
    def layout(self, rows: int, name: str = "input") -> CallLayout:
        """The layout of a call with ``rows`` rows (cached per row count); PlanError when invalid.

        Training plans: a multiple of D x R x G runs with micro batch rows / (D x R x G); a tail
        (``drop_last=False``, any other row count) runs by the partial-tail policy.
        Inference plans: up to the combined batch, cut into micro-batches of the micro batch (last shorter);
        more rows must be a multiple of D x R (micro batch rows / (D x R)). Outputs are always ALL.
        """
        if rows < 1:
            raise PlanError(f"'{name}' has no rows: a call needs at least one row")
        if (self.training and not self.is_tail(rows)) or (not self.training and rows > self.combined_batch):
            self.validate_batch(rows, name)
        return _layout(self, rows)

    # --- host layout -------------------------------------------------------------------------
    def split(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """View every tensor of a full call as the host layout ``[D, G, R, b, ...]`` (no copy; ``R / N`` input
        groups in place of ``R`` with input replica grouping)."""
        out = {}
        for key, t in batch.items():
            n = self.validate_batch(t, key)
            out[key] = t.reshape(self.device_iterations, self.gradient_accumulation,
                                 self.input_groups, n // self.factor, *t.shape[1:])
        return out

    def merge(self, batch: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Inverse of :meth:`split`: ``[D, G, R, b, ...]`` back to ``[D*G*R*b, ...]``."""
        out = {}
        for key, t in batch.items():
            if tuple(t.shape[:3]) != (self.device_iterations, self.gradient_accumulation, self.input_groups):
                raise PlanError(f"'{key}' of shape {tuple(t.shape)} is not in the host layout [D, G, R, b, ...]"
                                f" = [{self.device_iterations}, {self.gradient_accumulation}, "
                                f"{self.input_groups}, b, ...]")
            out[key] = t.reshape(-1, *t.shape[4:])
        return out

    def shard(self, batch: Mapping[str, torch.Tensor], replica: int) -> dict[str, torch.Tensor]:
        """The rows one replica runs (its ``[D, G, b]`` slice of a full call, or its part of a tail): those of
        its input group with input replica grouping."""
        if not 0 <= replica < self.replication_factor:
            raise PlanError(f"replica {replica} is outside --replication-factor {self.replication_factor}")
        rows = rows_of(batch)
        if self.input_groups == 1:
            return dict(batch)
        group = self.input_group_of(replica)
        lay = self.layout(rows)
        if not lay.partial and rows % (self.iterations * self.input_groups) == 0:  # equal micro-batches
            return {k: v.reshape(self.iterations, self.input_groups, -1, *v.shape[1:])[:, group]
                    .reshape(-1, *v.shape[1:]) for k, v in batch.items()}
        index = lay.replica_index(group)
        return {k: v.index_select(0, index) for k, v in batch.items()}

    # --- outputs -----------------------------------------------------------------------------
    def select_outputs(self, per_micro_batch: Sequence[Mapping[str, torch.Tensor]], rows: int | None = None
                       ) -> tuple[dict[str, torch.Tensor], torch.Tensor | None]:
        """Apply the output mode to the outputs of every micro-batch of one call (in order ``j``).

        Returns the selected outputs (per-row tensors concatenated along dim0, 0-dim outputs stacked unless
        the multiplier is 1) and the row indices they came from (None for SUM). ``rows`` defaults to the
        sum of the micro-batches' row counts (taken from their first per-row output).
        """
        if rows is None:
            rows = sum(rows_of(o) for o in per_micro_batch)
        lay = self.layout(rows)
        if len(per_micro_batch) != lay.num_micro_batches:
            raise PlanError(f"{len(per_micro_batch)} micro-batch outputs given, the call has "
                            f"{lay.num_micro_batches}")
        return combine_outputs(lay, [per_micro_batch[j] for j in lay.kept]), lay.out_rows

    def select_tensor(self, t: torch.Tensor) -> torch.Tensor:
        """Apply the output mode to one tensor of a full call in the ALL layout.

        ``t`` has dim0 = ``m x k`` (``m = D x G x R`` micro-batches of ``k`` rows each, ``R / N`` input groups in
        place of ``R``); the result has dim0 = ``multiplier x k``. A 0-dim tensor (m = 1) is returned unchanged.
        """
        m = self.factor
        if t.dim() == 0:
            return t
        if t.shape[0] % m:
            raise PlanError(f"an output of shape {tuple(t.shape)} is not {m} micro-batches stacked on dim0")
        r, mode = self.input_groups, self.output_mode
        if not self.training or mode is OutputMode.ALL:
            return t
        v = t.reshape(self.iterations, r, t.shape[0] // m, *t.shape[1:])
        if mode is OutputMode.FINAL:
            v = v[-1]
        elif mode is OutputMode.SUM:
            v = v.sum(0)
        else:  # every micro-batch of device iterations N-1, 2N-1, ...
            v = v.reshape(self.device_iterations, -1, *v.shape[1:])[self.output_return_period - 1::
                                                                        self.output_return_period]
        return v.reshape(-1, *t.shape[1:])


@functools.lru_cache(maxsize=256)
def _layout(plan: ExecutionPlan, rows: int) -> CallLayout:
    return compute_layout(plan, rows)


def reserved_ipus(n: int) -> int:
    """The IPUs PopTorch reserves for a model on ``n`` IPUs: a power of 2 or a multiple of 64 (the next one
    up); a real IPU system refuses any other count unless ``Options.autoRoundNumIPUs`` is set."""
    if n & (n - 1) == 0 or n % 64 == 0:
        return n
    return 1 << n.bit_length() if n < 64 else -(-n // 64) * 64


__all__ = ["ExecutionPlan", "LOSS_TOKENS", "LossNormalization", "OutputMode", "Reduction", "PlanError", "CallLayout",
           "combine_outputs", "batch_rows", "reserved_ipus"]
