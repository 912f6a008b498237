"""When a run saves and stops: :class:`PeriodicSaver` (``--save-every-n-secs``) and :class:`StopSignals`
(SIGINT/SIGTERM become a flag the run loop checks between world steps)."""

from __future__ import annotations

import math
import signal
import sys
import time
from typing import Any, Callable, Sequence


class PeriodicSaver:
    """``--save-every-n-secs``: :meth:`due` is True once per period (and then the period restarts).

    ``every_n_secs <= 0`` turns it off (never due). ``clock`` is injectable for tests. Call :meth:`mark`
    after a save made for another reason (end of training, a signal) to restart the period.
    """

    def __init__(self, every_n_secs: float, clock: Callable[[], float] = time.monotonic):
        self.every_n_secs = float(every_n_secs)
        self.clock = clock
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return self.every_n_secs > 0 and not math.isinf(self.every_n_secs)

    def due(self) -> bool:
        if not self.enabled:
            return False
        now = self.clock()
        if now - self.last >= self.every_n_secs:
            self.last = now
            return True
        return False

    def mark(self) -> None:
        self.last = self.clock()


class StopSignals:
    """Turn SIGINT/SIGTERM into a flag checked between world steps (then save and exit cleanly).

    ``with StopSignals() as stop: ... if stop.requested: save; break``. A second signal of the same
    run raises KeyboardInterrupt at once (so a hung save can still be interrupted). The previous
    handlers come back on exit. Outside the main thread (where handlers cannot be set) it does nothing.
    ``announce=False`` keeps it quiet (replicas other than rank 0: one line per run, not one per replica).
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM), announce: bool = True):
        self.signals = tuple(signals)
        self.announce = announce
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        if self.announce:
            print(f"accelbatch: {signal.Signals(signum).name} received: saving a checkpoint after this step, "
                  "then stopping (send it again to stop at once)", file=sys.stderr, flush=True)

    @property
    def name(self) -> str | None:
        return None if self.requested is None else signal.Signals(self.requested).name

    def __enter__(self) -> "StopSignals":
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
