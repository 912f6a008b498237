"""Backends: where and how a training or inference step runs (cpu, cuda, ipu).

Installed as ``accelbatch.backends``. Backends know tensors and execution plans, never teachers or
worlds. Pick one with :func:`accelbatch.backends.base.get_backend`.
"""

from __future__ import annotations

from .base import Backend, Engine, StepResult, available_backends, get_backend

__all__ = ["Backend", "Engine", "StepResult", "available_backends", "get_backend"]
