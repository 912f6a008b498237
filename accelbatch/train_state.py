"""A training run's counters, as its checkpoint keeps them: steps, examples, validations, the best validation
so far (and the -vmt/-vmm it was judged by), the validations without improvement, the training time, and
what ended the training once it has ended (so a resume of a finished run only evaluates), and the part of
the time spent validating (left out of the examples per second trained)."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any


@dataclass
class TrainState:
    """Counters of a training run; ``judged_by`` is the -vmt and -vmm that ``best`` and ``stale`` count by."""

    steps: int = 0
    exs: int = 0
    validations: int = 0
    best: float = -math.inf
    stale: int = 0
    last_valid: float | None = math.nan  # the -vmt value of the latest validation (None: a checkpoint's that
    # kept none, written before it was kept)
    started: float = field(default_factory=time.monotonic)
    judged_by: str = ""
    ended_by: str = ""  # what stopped the training, once it has stopped ("" while it goes on)
    validating_s: float = 0.0  # of elapsed(): the time spent in validations

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def exs_per_s(self) -> float:
        """Examples trained per second of training: the validations' time left out."""
        return self.exs / max(self.elapsed() - self.validating_s, 1e-9)

    def to_json(self) -> dict[str, Any]:
        return {"steps": self.steps, "exs": self.exs, "validations": self.validations, "best": self.best,
                "stale": self.stale, "last_valid": self.last_valid, "elapsed_s": self.elapsed(),
                "judged_by": self.judged_by, "ended_by": self.ended_by, "validating_s": self.validating_s}

    def load_json(self, data: dict[str, Any]) -> str | None:
        """Take a checkpoint's counters. A best judged by another -vmt/-vmm than this run's is dropped (the
        next validation sets it afresh): the line saying so, else None."""
        self.steps, self.exs, self.validations = data["steps"], data["exs"], data["validations"]
        self.started = time.monotonic() - data["elapsed_s"]
        self.ended_by, self.last_valid = data.get("ended_by", ""), data.get("last_valid")
        self.validating_s = data.get("validating_s", 0.0)
        then = data.get("judged_by", self.judged_by)
        if then == self.judged_by or data["best"] == -math.inf:
            self.best, self.stale = data["best"], data["stale"]
            return None
        self.last_valid = math.nan  # another metric's value: not this run's to judge
        return (f"--resume: the best validation so far was judged by -vmt/-vmm {then}, this run judges by "
                f"{self.judged_by}: its next validation sets the best afresh (and saves -mf)")
