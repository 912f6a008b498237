"""The best validation of the model in ``-mf PATH``, kept next to it in ``PATH.trainstats`` (as ParlAI keeps
its best_valid): a run that continues from PATH replaces the model only with one that validates better."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import asdict, dataclass

from accelbatch.checkpoint import read_json_file, unreadable_sidecar, write_json_file
from accelbatch.opts import Opts
from accelbatch.teachers import task_metric_spelled


@dataclass(frozen=True)
class BestValid:
    """The validation that chose the model: the metric's name and mode (max or min) and its value."""

    metric: str
    mode: str
    value: float

    def score(self) -> float:
        """The value as the run compares it: larger is better."""
        return -self.value if self.mode == "min" else self.value


def stats_path(model_file: str) -> str:
    return f"{model_file}.trainstats"


def read_best(model_file: str) -> BestValid | None:
    """The record kept with ``model_file``; None when there is none (a model saved without validation). A
    record that is not one is an error naming the file: ignoring it would let a worse model replace this one."""
    path = stats_path(model_file)
    data = read_json_file(path)
    if data is None:
        return None
    try:
        best = BestValid(str(data["metric"]), str(data["mode"]), float(data["value"]))
    except (ValueError, KeyError, TypeError):
        best = None
    if best is None or best.mode not in ("max", "min") or not math.isfinite(best.value):
        raise unreadable_sidecar(path, 'expected {"metric": NAME, "mode": "max" or "min", "value": NUMBER}')
    return best


def write_best(model_file: str, best: BestValid) -> None:
    """Keep ``best`` with the model just saved to ``model_file``."""
    write_json_file(stats_path(model_file), asdict(best))


def forget_best(model_file: str) -> None:
    """The model in ``model_file`` was saved without a validation: no record describes it."""
    try:
        os.remove(stats_path(model_file))
    except FileNotFoundError:
        pass


def metric_mode(opts: Opts) -> str:
    """'max' or 'min': -vmm, else min for the metrics that fall as a model learns (ParlAI's defaults)."""
    if opts.validation_metric_mode:
        return opts.validation_metric_mode
    return "min" if opts.validation_metric in ("loss", "ppl", "mean_rank") else "max"


def continued_best(opts: Opts, main: bool) -> float:
    """Training continues from the model in -mf: the score its validation had, which this run's model must beat
    to replace it (-inf when it was chosen otherwise: on another metric, or not validated); said by ``main``."""
    best = read_best(opts.model_file)
    wanted = (opts.validation_metric, metric_mode(opts))
    if best is not None and (task_metric_spelled(best.metric, opts.task, opts.datapath), best.mode) == wanted:
        if main:
            print(f"accelbatch: -mf {opts.model_file} holds a model whose validation had {best.metric} "
                  f"{best.value:.4g}; only a better one replaces it", file=sys.stderr)
        return best.score()
    if best is not None and main:
        print(f"accelbatch: -mf {opts.model_file} holds a model chosen on {best.metric} ({best.mode}); this run "
              f"chooses on {wanted[0]} ({wanted[1]}): its first validation replaces it", file=sys.stderr)
    return -math.inf
