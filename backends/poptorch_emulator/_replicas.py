"""What each replica keeps for itself on the device: its buffers and its accumulated gradients.

Buffers, as PopTorch treats them (python/options.py ``broadcastBuffers``, source/InplaceOps.cpp, user
guide "Buffers"):

- With input replication (``input_group_size < R``) and ``broadcastBuffers(True)`` (the default), a model
  that updates a buffer (or parameter) in place in its forward does not compile: PopTorch raises
  ``BROADCAST_ERR``. A buffer that is only read is fine.
- With ``broadcastBuffers(False)`` every replica holds its own buffers, never synchronised. Host and
  replica 0 share the module's buffers (the emulator's weights live on the host, and ``copyWeightsToHost``
  reads replica 0); replicas 1..R-1 keep copies, taken from the host when the model compiles and on
  ``copyWeightsToDevice``, that are swapped into the module around each of their micro-batches.

Gradients: each replica sums its own G micro-batches' gradients, then the replicas' sums are added in
replica order (the all-reduce), as an IPU (and R processes) do; floating-point sums depend on that order.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from .poptorch_core import py_error

BROADCAST_ERR = ("PopTorch does not support broadcasting buffers. If your model is able to tolerate buffers "
                 "becoming out of sync between replicas, you can disable buffer broadcasting using "
                 "poptorch.Options.broadcastBuffers(False).")


@contextmanager
def refusing_broadcast(model: torch.nn.Module, options: object) -> Iterator[None]:
    """Around the traced forward: PopTorch's compile error when replicas would need their buffers
    broadcast; the weights are left as they were, since nothing ran on the device."""
    replicated = options.input_group_size < options.replication_factor  # type: ignore[attr-defined]
    if not (options.broadcast_buffers and replicated):  # type: ignore[attr-defined]
        yield
        return
    state = [*model.parameters(), *model.buffers()]
    versions = [t._version for t in state]
    saved = [t.detach().clone() for t in state]
    yield
    if any(t._version != v for t, v in zip(state, versions)):
        with torch.no_grad():
            for t, s in zip(state, saved):
                t.copy_(s)
        raise py_error(BROADCAST_ERR, "poptorch_cpp_error")


class ReplicaState:
    """Replicas 1..R-1's own buffers under ``broadcastBuffers(False)`` (replica 0 uses the module's), and,
    when training, every replica's gradients of the current update (``params``: the trained ones)."""

    def __init__(self, model: torch.nn.Module, options: object,
                 params: Callable[[], list[torch.nn.Parameter]] | None) -> None:
        self._model = model
        self._replicas: int = options.replication_factor  # type: ignore[attr-defined]
        self._own_buffers = not options.broadcast_buffers and self._replicas > 1  # type: ignore[attr-defined]
        self._params = params if self._replicas > 1 else None
        self._buffers: list[list[torch.Tensor]] | None = None
        self._grads: dict[int, list[torch.Tensor | None]] = {}

    def reset(self) -> None:
        """The host's buffers go to every replica (compilation, ``copyWeightsToDevice``)."""
        if self._own_buffers:
            self._buffers = [[b.detach().clone() for b in self._model.buffers()] for _ in range(self._replicas - 1)]

    def host_copies(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``outputs``, those that share memory with a buffer copied (a later run, or another replica's
        buffers swapped in, would change them)."""
        shared = {b.untyped_storage().data_ptr() for b in self._model.buffers()}
        return [t.clone() if t.untyped_storage().data_ptr() in shared else t for t in outputs]

    @contextmanager
    def replica(self, r: int) -> Iterator[None]:
        """Run as replica ``r``: its buffers in the module, its gradients in ``.grad``; keep what it left."""
        params = self._params() if self._params is not None else []
        for p, g in zip(params, self._grads.get(r, [None] * len(params))):
            p.grad = g
        try:
            with self._buffers_of(r):
                yield
        finally:
            if params:
                self._grads[r] = [p.grad for p in params]
            for p in params:
                p.grad = None

    def reduce_grads(self) -> None:
        """The replicas' gradient sums, added in replica order, into ``.grad`` (the update's gradient)."""
        if self._params is None or not self._grads:
            return
        for i, p in enumerate(self._params()):
            total = None
            for r in sorted(self._grads):
                g = self._grads[r][i]
                total = g if total is None else (total if g is None else total + g)
            p.grad = total
        self._grads.clear()

    def clear_grads(self) -> None:
        self._grads.clear()

    @contextmanager
    def _buffers_of(self, r: int) -> Iterator[None]:
        if not self._own_buffers or r == 0:
            yield
            return
        buffers = list(self._model.buffers())
        if self._buffers is None:
            self.reset()
        assert self._buffers is not None
        mine = self._buffers[r - 1]
        host = [b.detach().clone() for b in buffers]
        with torch.no_grad():
            for b, c in zip(buffers, mine):
                b.copy_(c)
        try:
            yield
        finally:
            with torch.no_grad():
                for b, c, h in zip(buffers, mine, host):
                    c.copy_(b)
                    b.copy_(h)
