"""IPU settings beyond the execution plan: half precision, executable caching, synthetic data.

``--mixed-precision fp16`` on ``--device ipu`` is PopTorch's half precision, not autocast: the model is
cast with ``model.half()`` and trains its float16 weights directly (PopTorch keeps no float32 master copy;
its gradient accumulators and optimizer states default to float32, as the emulator does too), inputs that
are floating point are cast to float16 by the engine, matmul/convolution partials are float32
(``Options.Precision.setPartialsType(torch.float)``) and the loss is scaled by the optimizer's
``loss_scaling`` attribute (``--ipu-loss-scaling``), which PopTorch reads from any optimizer. IPUs have no
bfloat16 arithmetic, so bf16 is refused.

``--ipu-cache-dir DIR`` -> ``Options.enableExecutableCaching(DIR)``: a graph compiled once is loaded from
DIR by later runs (the report counts ``cached`` graphs apart from ``compilations``).
``--ipu-synthetic-data`` -> ``Options.enableSyntheticData(True)``: no host I/O, the device makes its own
inputs, which measures the model alone (figures of such a run mean nothing else).
``--ipu-available-memory-proportion P`` -> ``Options.setAvailableMemoryProportion({"IPU0": P, ...})``, one
entry per IPU of a replica (more than one with ``--pipeline``); the emulator records it.
``--pipeline NAME,...`` / ``--ipu-execution-strategy``: the model split over IPUs (:mod:`.ipu_pipeline`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import torch

from accelbatch.plan import PlanError

from .ipu_pipeline import PipelineSettings

DEFAULT_LOSS_SCALING = 128.0


@dataclass(frozen=True)
class IPUSettings:
    half: bool = False
    loss_scaling: float = 1.0
    cache_dir: str | None = None
    synthetic_data: bool = False
    memory_proportion: float | None = None
    pipeline: PipelineSettings = field(default_factory=PipelineSettings)

    @classmethod
    def from_opts(cls, opts: Any) -> "IPUSettings":
        """The settings ``opts`` ask for; PlanError (one line naming the option) for what an IPU cannot do."""
        precision = getattr(opts, "mixed_precision", None) or "no"
        if precision == "bf16":
            raise PlanError("--mixed-precision bf16: IPUs have no bfloat16 arithmetic; use --mixed-precision "
                            "fp16 (model.half(), float32 partials, loss scaling) or leave it out")
        half = precision == "fp16"
        scaling = getattr(opts, "ipu_loss_scaling", None)
        if scaling is not None and (not math.isfinite(float(scaling)) or float(scaling) <= 0):
            raise PlanError(f"--ipu-loss-scaling {scaling}: the loss scaling must be a positive number "
                            f"(e.g. {DEFAULT_LOSS_SCALING:g}; 1 turns it off)")
        if scaling is not None and not half:
            raise PlanError(f"--ipu-loss-scaling {scaling} applies to --mixed-precision fp16 on the IPU: "
                            "add --mixed-precision fp16 or leave it out")
        cache_dir = getattr(opts, "ipu_cache_dir", None) or None
        if cache_dir is not None and os.path.exists(cache_dir) and not os.path.isdir(cache_dir):
            raise PlanError(f"--ipu-cache-dir {cache_dir}: it is a file, not a directory; name a directory "
                            "(it is created if missing)")
        proportion = getattr(opts, "ipu_available_memory_proportion", None)
        if proportion is not None and not (math.isfinite(float(proportion)) and 0 < float(proportion) <= 1):
            raise PlanError(f"--ipu-available-memory-proportion {proportion}: give a proportion in (0, 1], "
                            "e.g. 0.3 when a graph runs out of memory")
        return cls(half=half, loss_scaling=float(scaling if scaling is not None else
                                                 (DEFAULT_LOSS_SCALING if half else 1.0)),
                   cache_dir=cache_dir, synthetic_data=bool(getattr(opts, "ipu_synthetic_data", False)),
                   memory_proportion=None if proportion is None else float(proportion),
                   pipeline=PipelineSettings.from_opts(opts))

    def apply(self, options: Any) -> Any:
        """Set these settings on a ``poptorch.Options`` (returned)."""
        if self.half:
            options.Precision.setPartialsType(torch.float)
        if self.cache_dir is not None:
            options.enableExecutableCaching(self.cache_dir)
        if self.synthetic_data:
            options.enableSyntheticData(True)
        if self.memory_proportion is not None:
            options.setAvailableMemoryProportion({f"IPU{k}": self.memory_proportion
                                                  for k in range(self.pipeline.ipus_per_replica)})
        return options

    def prepare(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> None:
        """Half precision: the model's floating-point weights to float16 in place (the optimizer keeps the
        same parameters) and the optimizer's ``loss_scaling`` set."""
        if not self.half:
            return
        model.half()
        if optimizer is not None:
            optimizer.loss_scaling = self.loss_scaling  # type: ignore[attr-defined]

    def cast_inputs(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """float16 copies of the floating-point inputs when the model runs in half precision."""
        if not self.half:
            return batch
        return {k: (t.half() if t.is_floating_point() and t.dtype != torch.float16 else t) for k, t in batch.items()}


__all__ = ["DEFAULT_LOSS_SCALING", "IPUSettings"]
