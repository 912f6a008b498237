"""fp16 dynamic loss scaling whose every decision stays on the device (no host read), for both engines.

The policy is torch's ``GradScaler``'s (same defaults, same arithmetic, same ``state_dict`` keys, so a
checkpoint written with either loads into the other): the loss is multiplied by the scale before
``backward``; before a step the gradients are unscaled and checked; an update whose gradients hold an inf
or NaN is not applied and the scale is multiplied by ``backoff_factor``; after ``growth_interval`` clean
updates in a row it is multiplied by ``growth_factor`` (kept only when finite).

Unlike ``GradScaler.step``, which reads the overflow flag on the host before stepping a non-fused
optimizer, :meth:`LossScaler.unscale_` returns the flag as a device tensor: the CUDA engine hands it to
its :class:`~accelbatch.backends.cuda.StepGuard`, so D updates cost no host wait. An update the engine
masks for a non-finite loss (its NaN policy, ``active`` False) leaves the scale as it was.
"""

from __future__ import annotations

from typing import Any

import torch


class LossScaler:
    """Dynamic loss scale and growth tracker as 0-dim tensors on ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device | str, init_scale: float = 65536.0, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.device = torch.device(device)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval = int(growth_interval)
        self._scale = torch.full((), float(init_scale), dtype=torch.float32, device=self.device)
        self._tracker = torch.zeros((), dtype=torch.int32, device=self.device)

    def is_enabled(self) -> bool:
        return True

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """``loss`` times the current scale (backward of this gives scaled gradients)."""
        return loss * self._scale

    def unscale_(self, params: Any) -> torch.Tensor:
        """Divide the gradients of ``params`` by the scale in place; the 0-dim bool device tensor "some
        gradient is inf or NaN" (not read here)."""
        found = torch.zeros(1, dtype=torch.float32, device=self.device)
        inv = self._scale.double().reciprocal().float()   # as GradScaler computes it
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for p in params:
            if p.grad is not None:
                by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
        for grads in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(grads, found, inv)
        return found.reshape(()) > 0

    def update(self, found: torch.Tensor, active: torch.Tensor | None = None) -> None:
        """Back off after an overflow (``found``), grow after ``growth_interval`` clean updates; only where
        ``active`` (default: always), all on the device."""
        grown = (self._tracker + 1) >= self.growth_interval
        larger = self._scale * self.growth_factor
        grow = grown & torch.isfinite(larger)
        scale = torch.where(found, self._scale * self.backoff_factor, torch.where(grow, larger, self._scale))
        tracker = torch.where(found | grown, torch.zeros_like(self._tracker), self._tracker + 1)
        if active is not None:
            scale = torch.where(active, scale, self._scale)
            tracker = torch.where(active, tracker, self._tracker)
        self._scale.copy_(scale)
        self._tracker.copy_(tracker)

    def get_scale(self) -> float:
        """The current scale (a host read)."""
        return float(self._scale.item())

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker."""
        return {"scale": self.get_scale(), "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "_growth_tracker": int(self._tracker.item())}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.growth_factor = float(state.get("growth_factor", self.growth_factor))
        self.backoff_factor = float(state.get("backoff_factor", self.backoff_factor))
        self.growth_interval = int(state.get("growth_interval", self.growth_interval))
        self._scale.fill_(float(state["scale"]))
        self._tracker.fill_(int(state.get("_growth_tracker", 0)))


__all__ = ["LossScaler"]
