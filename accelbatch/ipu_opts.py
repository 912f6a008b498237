"""The checks of the IPU's options (its pipeline and input replica grouping): well formed, and given with
``--device ipu`` only, which alone reads them."""

from __future__ import annotations

import dataclasses
from typing import Any

from accelbatch.option_error import OptionError
from accelbatch.split_points import parse_split_points


def validate_ipu_options(opts: Any) -> None:
    """Raise :class:`OptionError` naming the IPU option of ``opts`` (an Opts) at fault."""
    _validate_pipeline(opts)
    _validate_ipu_only(opts)
    _validate_input_grouping(opts)


def _validate_pipeline(opts: Any) -> None:
    """--pipeline names IPU split points: well formed, and only with --device ipu."""
    try:
        points = parse_split_points(opts.pipeline)
    except ValueError as exc:
        raise OptionError(f"--pipeline: {exc}") from None
    if points and opts.device != "ipu":
        raise OptionError(f"--pipeline splits the model over IPUs and applies to --device ipu only (this run is "
                          f"--device {opts.device}, where the model runs whole): drop it, or use --device ipu")
    if not points and opts.ipu_execution_strategy != "pipelined":
        raise OptionError(f"--ipu-execution-strategy {opts.ipu_execution_strategy}: places the stages of --pipeline; "
                          "give --pipeline NAME,... too, or leave it out")


IPU_ONLY = ("ipu_loss_scaling", "ipu_cache_dir", "ipu_available_memory_proportion", "ipu_synthetic_data",
            "ipu_input_replica_grouping", "ipu_input_replica_grouping_type")  # the IPU's plan and compiler


def _validate_ipu_only(opts: Any) -> None:
    """The IPU's options are refused on another device, which would not use them."""
    given = [f for f in dataclasses.fields(opts) if f.name in IPU_ONLY and getattr(opts, f.name) != f.default]
    if given and opts.device != "ipu":
        value = getattr(opts, given[0].name)
        raise OptionError(f"{given[0].metadata['flags'][0]}{'' if value is True else f' {value}'}: applies to "
                          f"--device ipu only (this run is --device {opts.device}, which does not use it): drop it, "
                          "or use --device ipu")


def _validate_input_grouping(opts: Any) -> None:
    """--ipu-input-replica-grouping N: a factor of -rf, only with --device ipu; its type only with N > 1."""
    n, r = opts.ipu_input_replica_grouping, opts.replication_factor
    if r % n:
        fits = ", ".join(str(k) for k in range(1, r + 1) if r % k == 0)
        raise OptionError(f"--ipu-input-replica-grouping {n}: groups of replicas must divide "
                          f"-rf/--replication-factor {r}; use one of {fits}")
    if n == 1 and opts.ipu_input_replica_grouping_type != "consecutive":
        raise OptionError(f"--ipu-input-replica-grouping-type {opts.ipu_input_replica_grouping_type}: arranges "
                          "the groups of --ipu-input-replica-grouping N; give N > 1 too, or leave it out")


__all__ = ["IPU_ONLY", "validate_ipu_options"]
