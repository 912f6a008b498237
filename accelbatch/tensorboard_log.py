"""TensorBoard scalars from the metrics log's records (optional: needs the ``tensorboard`` package).

``TensorBoardLog(log_dir).write(record)`` takes the records :class:`accelbatch.run.MetricsLog` writes
(``{"split": "train", "step": 12, "loss": 0.5, "exs_per_s": 900.0, ...}``) and adds one scalar per numeric
field, tagged ``split/metric`` (``train/loss``, ``valid/accuracy``; ``valid_final/loss`` for the evaluations
after training, of the model -mf kept), at the record's ``step``. Records
without a step (validation and test reports) go at the step of the last record that had one, so they
line up with training. ``step`` itself and non-numbers are not written; booleans are not numbers here.

Across a resume: a checkpoint keeps :meth:`TensorBoardLog.position` (the last step and the scalars written at
it); :meth:`TensorBoardLog.resume_at` starts a new event file whose ``purge_step`` is that step, so TensorBoard
drops what the stopped run wrote from it on (the steps the resumed run trains and evaluates again), and writes
the step's saved scalars again.

Without tensorboard installed (or with ``log_dir`` None) every call is a no-op; a missing tensorboard is
said once, on stderr, when the writer is made.
"""

from __future__ import annotations

import math
import os
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
        self._at_last_step: list[dict[str, float]] = []  # the scalars written at last_step, for a checkpoint
        self._flush_secs = flush_secs
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
        if record.get("final") is True and split != "test":  # the kept model's evaluation after training
            split = f"{split}_final"
        out = {}
        for key, value in record.items():
            if key in NOT_SCALARS or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            if math.isfinite(value):
                out[f"{split}/{key}"] = float(value)
        return out

    def write(self, record: Mapping[str, Any]) -> None:
        step = record.get("step")
        if isinstance(step, int) and not isinstance(step, bool) and step != self.last_step:
            self.last_step, self._at_last_step = step, []
        if self.writer is None:
            return
        scalars = self.scalars(record)
        self._at_last_step.append(scalars)
        self._add(scalars)

    def _add(self, scalars: Mapping[str, float]) -> None:
        for tag, value in scalars.items():
            self.writer.add_scalar(tag, value, global_step=self.last_step)

    def position(self) -> dict[str, Any] | None:
        """What a checkpoint keeps to resume this log: its folder, the last step and the scalars written at it
        (None when nothing is written)."""
        if self.writer is None:
            return None
        return {"path": os.path.abspath(self.log_dir or ""), "step": self.last_step,
                "scalars": [dict(s) for s in self._at_last_step]}

    def resume_at(self, saved: Mapping[str, Any] | None) -> None:
        """--resume: a new event file that purges the events of steps from the checkpoint's on (written after
        the checkpoint, before the run stopped, or at its step after the save), then the scalars the checkpoint
        saw written at its step again. A checkpoint of another folder (or none) leaves the log alone."""
        if self.writer is None or not saved or saved.get("path") != os.path.abspath(self.log_dir or ""):
            return
        step = int(saved.get("step", 0))
        self.writer.close()
        from torch.utils.tensorboard import SummaryWriter
        self.writer = SummaryWriter(log_dir=self.log_dir, flush_secs=self._flush_secs, purge_step=step)
        self.last_step, self._at_last_step = step, []
        for scalars in saved.get("scalars", []):
            self._at_last_step.append(dict(scalars))
            self._add(scalars)

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
