"""The best validation of the model in ``-mf PATH``, kept next to it in ``PATH.trainstats`` (as ParlAI keeps
its best_valid): a run that continues from PATH replaces the model only with one that validates better."""

from __future__ import annotations

import math
import os
from dataclasses import asdict, dataclass

from accelbatch.checkpoint import read_json_file, unreadable_sidecar, write_json_file


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
