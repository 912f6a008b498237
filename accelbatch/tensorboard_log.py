"""TensorBoard scalars from the metrics log's records (optional: needs the ``tensorboard`` package).

``TensorBoardLog(log_dir).write(record)`` takes the records :class:`accelbatch.run.MetricsLog` writes
(``{"split": "train", "step": 12, "loss": 0.5, "exs_per_s": 900.0, ...}``) and adds one scalar per numeric
field, tagged ``split/metric`` (``train/loss``, ``valid/accuracy``), at the record's ``step``. Records
without a step (validation and test reports) go at the step of the last record that had one, so they
line up with training. ``step`` itself and non-numbers are not written; booleans are not numbers here.

Without tensorboard installed (or with ``log_dir`` None) every call is a no-op; a missing tensorboard is
said once, on stderr, when the writer is made.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Callable, Mapping

__all__ = ["TensorBoardLog"]

NOT_SCALARS = frozenset({"step", "split"})


def _notice(text: str) -> None:
    print(text, file=sys.stderr)


class TensorBoardLog:
    """Writes metric records as TensorBoard scalars to ``log_dir`` (a no-op without tensorboard)."""

    def __init__(self, log_dir: str | None, *, notice: Callable[[str], None] = _notice,
                 flush_secs: int = 30):
        self.log_dir = log_dir
        self.writer: Any = None
        self.last_step = 0
        if not log_dir:
            return
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            notice(f"accelbatch: --tensorboard-logdir {log_dir}: the tensorboard package is not installed, so no "
                   "scalars are written there (pip install tensorboard); the run goes on")
            return
        self.writer = SummaryWriter(log_dir=log_dir, flush_secs=flush_secs)

    @property
    def enabled(self) -> bool:
        return self.writer is not None

    @staticmethod
    def scalars(record: Mapping[str, Any]) -> dict[str, float]:
        """``{"split/metric": value}`` for each finite numeric field of a record."""
        split = record.get("split") if isinstance(record.get("split"), str) else "train"
        out = {}
        for key, value in record.items():
            if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                out[f"{split}/{key}"] = float(value)
        return out

    def write(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool):
            self.last_step = step
        if self.writer is None:
            return
        for tag, value in self.scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=self.last_step)

    def flush(self) -> None:
        if self.writer is not None:
            self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
            self.writer = None

    def __enter__(self) -> "TensorBoardLog":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
