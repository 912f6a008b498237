"""``PoplarExecutor.getPerfCounters()`` and the latency figures derived from it, with host timestamps.

PopTorch (python/_poplar_executor.py) returns, for the last call, a dict with the keys ``input``,
``input_complete``, ``output`` and ``output_complete``; each holds one list per input (or output) tensor of
timestamps in fractional seconds, one per transfer. Inputs are transferred once per micro-batch
(D * G * R per call); outputs once per micro-batch the output mode returns (All: D*G*R, EveryN(N):
D/N*G*R, Final and Sum: R). A model that has not run gives ``[[]]`` under every key; with synthetic data
nothing is transferred, so each tensor's list is empty and every latency is ``(0.0, 0.0, 0.0)``.

The emulator stamps the host clock (``time.perf_counter``) around slicing each micro-batch out of the
call's inputs and around copying each output back: the structure is PopTorch's, the values are host times.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Sequence, Tuple

import torch

from ._device import synthetic_mode
from .enums import OutputMode

Counters = Dict[str, List[List[float]]]
Latency = Tuple[float, float, float]
KEYS = ("input", "input_complete", "output", "output_complete")


def returned_steps(mode: OutputMode, period: int, D: int, G: int, R: int) -> list[int]:
    """Indices, in [D, G, R] order, of the micro-batches whose outputs the output mode sends to the host."""
    if mode == OutputMode.All:
        iterations = range(D)
    elif mode == OutputMode.EveryN:
        iterations = range(period - 1, D, period)
    else:  # Final and Sum: the last micro-batch of each replica
        return [((D - 1) * G + (G - 1)) * R + r for r in range(R)]
    return [(d * G + g) * R + r for d in iterations for g in range(G) for r in range(R)]


def _per_tensor(steps: list[list[tuple[float, float]]], n: int) -> tuple[list[list[float]], list[list[float]]]:
    """Transpose [step][tensor](start, end) into [tensor][step] starts and ends."""
    starts = [[step[i][0] for step in steps] for i in range(n)]
    ends = [[step[i][1] for step in steps] for i in range(n)]
    return starts, ends


class PerfCounters:
    """Host timestamps of one executor's micro-batch transfers; the last finished call's are published."""

    def __init__(self) -> None:
        self._inputs: list[list[tuple[float, float]]] = []
        self._outputs: list[list[tuple[float, float]]] = []
        self.last: Counters = {key: [[]] for key in KEYS}

    def load(self, inputs: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
        """``inputs.map(fn)`` (one micro-batch), stamping each tensor's transfer."""
        stamps: list[tuple[float, float]] = []

        def timed(t: torch.Tensor) -> torch.Tensor:
            start = time.perf_counter()
            out = fn(t)
            stamps.append((start, time.perf_counter()))
            return out

        micro = inputs.map(timed)
        self._inputs.append(stamps)
        return micro

    def store(self, tensors: Sequence[torch.Tensor], fn: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
        """``fn`` applied to each detached output of one micro-batch, stamping each copy."""
        stamps, out = [], []
        for t in tensors:
            start = time.perf_counter()
            out.append(fn(t.detach()))
            stamps.append((start, time.perf_counter()))
        self._outputs.append(stamps)
        return out

    @contextmanager
    def recording(self, options: Any, batching: Any) -> Iterator[None]:
        """Stamp one call; when it ends without an error, publish its counters as ``last``."""
        self._inputs, self._outputs = [], []
        yield
        n_in = len(self._inputs[0]) if self._inputs else 0
        n_out = len(self._outputs[0]) if self._outputs else 0
        if synthetic_mode(options):
            self.last = {"input": [[] for _ in range(n_in)], "input_complete": [[] for _ in range(n_in)],
                         "output": [[] for _ in range(n_out)], "output_complete": [[] for _ in range(n_out)]}
            return
        keep = returned_steps(OutputMode(options.output_mode), options.output_return_period,
                              batching.device_iterations, batching.gradient_accumulation,
                              batching.replication_factor)
        inputs = _per_tensor(self._inputs, n_in)
        outputs = _per_tensor([self._outputs[i] for i in keep if i < len(self._outputs)], n_out)
        counters = {"input": inputs[0], "input_complete": inputs[1],
                    "output": outputs[0], "output_complete": outputs[1]}
        self.last = {key: value or [[]] for key, value in counters.items()}
        self._inputs, self._outputs = [], []


def latency(counters: Counters, start_key: str, first: Callable, end_key: str, last: Callable) -> Latency:
    """(min, max, mean) over the call's returned outputs of the time from ``first`` of the ``start_key``
    stamps of the inputs that output depends on to ``last`` of its ``end_key`` stamps."""
    starts = [first(column) for column in zip(*counters[start_key])]
    ends = [last(column) for column in zip(*counters[end_key])]
    if not ends:
        return (0.0, 0.0, 0.0)
    per_output = max(1, len(starts) // len(ends))  # input transfers behind each returned output (G, or D*G)
    spans = [end - min(starts[i * per_output:(i + 1) * per_output]) for i, end in enumerate(ends)]
    return (min(spans), max(spans), sum(spans) / len(spans))


class PerfCounterMethods:
    """PopTorch's performance-counter methods of ``PoplarExecutor``."""

    @property
    def _perf_counters(self) -> PerfCounters:
        store = self.__dict__.get("_perf_counter_store")
        if store is None:
            store = self.__dict__["_perf_counter_store"] = PerfCounters()
        return store

    def getPerfCounters(self) -> Counters:
        """Timestamps (fractional seconds, host clock) of the last call's transfers: see the module doc."""
        if not self.isCompiled():  # type: ignore[attr-defined]
            return {key: [[]] for key in KEYS}
        return {key: [list(v) for v in values] for key, values in self._perf_counters.last.items()}

    def getHostIpuLatency(self) -> Latency:
        """First input requested to last input transferred: (min, max, mean) seconds."""
        return latency(self.getPerfCounters(), "input", min, "input_complete", max)

    def getComputeLatency(self) -> Latency:
        """Last input transferred to last output available: (min, max, mean) seconds."""
        return latency(self.getPerfCounters(), "input_complete", max, "output", max)

    def getIpuHostLatency(self) -> Latency:
        """First output available to last output transferred: (min, max, mean) seconds."""
        return latency(self.getPerfCounters(), "output", min, "output_complete", max)

    def getLatency(self) -> Latency:
        """Round trip, first input requested to last output transferred: (min, max, mean) seconds."""
        return latency(self.getPerfCounters(), "input", min, "output_complete", max)
