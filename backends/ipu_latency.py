"""Round-trip latency of the IPU calls, from PopTorch's ``PoplarExecutor.getLatency()``.

PopTorch times each call's transfers (``getPerfCounters``) and ``getLatency()`` gives (min, max, mean)
seconds from the first input requested to the last output written back, over the call's returned outputs.
The engine reads it after every call when the poptorch in use has it (real, or the emulator, whose figures
are host times); the run's report shows the min, mean and max over calls in milliseconds. These figures
vary from run to run; nothing else in the report depends on them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Optional

log = logging.getLogger(__name__)


@dataclass
class LatencyStats:
    """Per-call round-trip latencies seen so far (calls that transferred nothing are left out)."""

    calls: int = 0
    sum_s: float = 0.0
    min_s: float = math.inf
    max_s: float = 0.0

    def record(self, executor: Any) -> None:
        """Add the latency of ``executor``'s last call, if its poptorch reports one."""
        get_latency = getattr(type(executor), "getLatency", None)
        if get_latency is None:
            return
        try:
            low, high, mean = get_latency(executor)
        except Exception as exc:  # a report figure never stops a run: PopTorch asserts on odd counter sets
            log.debug("ipu: getLatency() failed (%s); this call's latency is left out", exc)
            return
        if high <= 0.0:  # synthetic data: nothing transferred
            return
        self.calls += 1
        self.sum_s += mean
        self.min_s = min(self.min_s, low)
        self.max_s = max(self.max_s, high)

    def merge(self, other: "LatencyStats") -> None:
        self.calls += other.calls
        self.sum_s += other.sum_s
        self.min_s = min(self.min_s, other.min_s)
        self.max_s = max(self.max_s, other.max_s)

    def report(self) -> Optional[Dict[str, float]]:
        """``latency_{min,mean,max}_ms`` over the calls, or None if no call reported one."""
        if self.calls == 0:
            return None
        return {"latency_min_ms": round(self.min_s * 1e3, 3),
                "latency_mean_ms": round(self.sum_s / self.calls * 1e3, 3),
                "latency_max_ms": round(self.max_s * 1e3, 3)}


def combined(stats: Iterable[LatencyStats]) -> LatencyStats:
    """One :class:`LatencyStats` over several engines'."""
    total = LatencyStats()
    for s in stats:
        total.merge(s)
    return total
