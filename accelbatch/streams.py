"""Random streams of a training call's micro-batches, so that random ops (dropout) draw the same numbers
however the call's micro-batches are spread over replicas and processes.

A training call of several micro-batches (``-di``, ``-ga`` or ``-rf`` above 1) seeds the generator its model
draws from before each micro-batch ``j`` (in the layout's [D, G, R] row order) with a seed made from the
generator's initial seed and ``j``, and after the call with one made from the initial seed alone. So
micro-batch ``j`` draws the same dropout mask whether one process runs every micro-batch in turn (simulated
replicas, ``-ga``, the IPU emulator) or replica processes, seeded alike, run theirs; the next call's seeds
follow from this one's, whatever else drew numbers in between (an evaluation, one replica more than another);
a checkpoint's RNG state holds the initial seed, so a resume goes on with the same seeds. A call of one
micro-batch leaves the generator alone (the stream of one process, as plain torch).
"""

from __future__ import annotations

import torch

__all__ = ["CallStreams"]

_MASK = (1 << 64) - 1
_MULTIPLIER, _INCREMENT = 6364136223846793005, 1442695040888963407  # Knuth's MMIX LCG constants


def _seed(base: int, k: int) -> int:
    """A 63-bit seed from ``base`` and ``k``: one LCG step from ``base + k``, then xorshift-mixed."""
    x = ((base + k * _INCREMENT) * _MULTIPLIER + _INCREMENT) & _MASK
    x ^= x >> 31
    return x & (_MASK >> 1)


class CallStreams:
    """The seeds of one training call of ``micro_batches`` micro-batches on ``generator`` (see the module
    docstring); no-ops for a call of one micro-batch or without a generator."""

    def __init__(self, generator: torch.Generator | None, micro_batches: int):
        self.generator = generator if micro_batches > 1 else None
        self.base = self.generator.initial_seed() if self.generator is not None else 0

    def enter(self, j: int) -> None:
        """Before micro-batch ``j``'s forward."""
        if self.generator is not None:
            self.generator.manual_seed(_seed(self.base, j + 1))

    def end(self) -> None:
        """After the call's last micro-batch: the seed the next call starts from."""
        if self.generator is not None:
            self.generator.manual_seed(_seed(self.base, 0))
