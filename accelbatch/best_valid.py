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
from accelbatch.train_state import TrainState


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


def write_best(model_file: str, best: BestValid | None) -> None:
    """Keep ``best`` with the model just saved to ``model_file``; None: it was saved without a validation, so no
    record describes it (any earlier one is removed)."""
    if best is not None:
        write_json_file(stats_path(model_file), asdict(best))
        return
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


def judge(metric: float, opts: Opts, state: TrainState) -> tuple[bool, bool]:
    """A validation's -vmt ``metric`` against the best so far (``state``, updated): whether its model is the new
    best, and whether training stops (:func:`validation_ends`). A value that is not a number (NaN) is never the
    best."""
    state.last_valid = metric
    value = -metric if metric_mode(opts) == "min" else metric
    improved = value > state.best
    if improved:
        state.best, state.stale = value, 0
    elif state.best > -math.inf:  # no best yet: only a NaN (or infinite loss) is not one, and nothing was lost
        state.stale += 1
    return improved, validation_ends(opts, state) is not None


def validation_ends(opts: Opts, state: TrainState) -> str | None:
    """What ends training after the validations ``state`` counts, under ``opts``: -vp of them in a row that did
    not improve on the best, or the last one meeting -vcut (in words, what would go on); None: nothing."""
    if 0 < opts.validation_patience <= state.stale:
        return f"patience: {state.stale} validations without improvement; a -vp above {state.stale} trains on"
    mode, cutoff, last = metric_mode(opts), opts.validation_cutoff, state.last_valid
    if cutoff != -1 and last is None:  # a checkpoint that kept no value: its end by -vcut stands
        return f"-vcut {cutoff:g} (the checkpoint keeps no validation value to judge another by)"
    if cutoff != -1 and (last <= cutoff if mode == "min" else last >= cutoff):
        return f"-vcut {cutoff:g} met by {opts.validation_metric} {last:.4g}; another -vcut trains on"
    return None
