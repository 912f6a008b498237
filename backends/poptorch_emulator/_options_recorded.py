"""PopTorch 3.3 option setters that change nothing the emulator computes: each one sets what PopTorch's sets
(python/options.py, tag sdk/poptorch/3.3.0), so it reads back the same and freezes the same, and the emulator
goes on as without it.

- ``logCycleCount``, ``enableStableNorm``: PopART options (``instrumentWithHardwareCycleCounter``,
  ``enableStableNorm``). A CPU counts no IPU cycles, and torch's CPU norms are already the accurate ones.
- ``enableProfiling``: the Poplar engine options of a profile report; the emulator writes no report.
- ``useIpuId``: recorded as ``ipu_id``; the emulator has no devices to choose from.
- ``relaxOptimizerAttributesChecks``, ``sourceLocationExcludes``, ``appendToLocationExcludes``: warnings and
  IR printing, which the emulator does not have.
- ``Training.setConvolutionDithering``: tile layout (PopTorch replaces ``convolutionOptions`` with it).
- ``Jit.traceModel`` and ``Precision.halfFloatCasting``: deprecated in PopTorch 3.3; same warnings, and
  ``traceModel(True)`` raises PopTorch's ``ValueError``.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from ._options_dict import _OptionsDict

logger = logging.getLogger("poptorch_emulator")

# PopTorch's default (python/_options_impl.py default_source_location_excludes)
DEFAULT_SOURCE_LOCATION_EXCLUDES = ["install/poptorch", "site-packages/torch", "site-packages/poptorch"]


class _JitOptions(_OptionsDict):
    """``opts.Jit``: options of PyTorch's JIT compiler (none left in PopTorch 3.3 but a deprecated one)."""

    def traceModel(self, trace_model: bool) -> "_JitOptions":
        logger.warning("[Deprecated] Do not call options.Jit.traceModel(): options.Jit.traceModel(False) is now "
                       "the default, and True is no longer supported, therefore this function will be removed "
                       "shortly")
        if trace_model:
            raise ValueError("options.Jit.traceModel(True) is no longer supported")
        return self


class PrecisionRecorded:
    """``opts.Precision`` setters that change nothing here."""

    def halfFloatCasting(self, half_float_casting: Any) -> Any:
        """Deprecated: HalfUpcastToFloat is PopTorch 3.3's only behaviour (a warning, nothing else)."""
        logger.warning("[Deprecated] Do not call options.Precision.halfFloatCasting(): HalfUpcastToFloat is now "
                       "the only supported option and matches PyTorch's behaviour so you don't need to "
                       "explicitly set it.")
        return self


class TrainingRecorded:
    """``opts.Training`` setters that change nothing here."""

    _popart_options: Any

    def setConvolutionDithering(self, enabled: bool) -> Any:
        """Lay convolutions out from different tiles (recorded: a CPU has no tiles)."""
        self._popart_options.set("convolutionOptions", {"enableConvDithering": enabled})
        return self


class OptionsRecorded:
    """``poptorch.Options`` setters that change nothing here (see the module docstring)."""

    _Popart: Any
    _popart: Any
    _jit: _JitOptions
    createOrSet: Any

    @property
    def Jit(self) -> _JitOptions:
        return self._jit

    def logCycleCount(self, log_cycle_count: bool) -> Any:
        """Log the IPU cycles of the main graph (recorded: a CPU counts none)."""
        self._Popart.set("instrumentWithHardwareCycleCounter", log_cycle_count)
        return self

    def enableStableNorm(self, enabled: bool) -> Any:
        """The slower, more accurate norm operators (recorded: torch's CPU norms are the accurate ones)."""
        self._Popart.set("enableStableNorm", enabled)
        return self

    def useIpuId(self, ipu_id: int) -> Any:
        """Run on the IPU device of this id (recorded as ``ipu_id``: the emulator has no devices)."""
        assert isinstance(ipu_id, int)
        self.createOrSet(ipu_id=ipu_id)
        return self

    def enableProfiling(self, profile_dir: str | None = None) -> Any:
        """Ask Poplar for a profile report in ``profile_dir`` (recorded: the emulator writes no report)."""
        env_engine_opts = os.getenv("POPLAR_ENGINE_OPTIONS", default="")
        if any(key in env_engine_opts for key in ("debug.allowOutOfMemory", "autoReport.directory",
                                                  "autoReport.all")):
            logger.warning("Profiling setting overridden by environment variable. "
                           "Check content of POPLAR_ENGINE_OPTIONS.")
        opts = self._popart.options.get("engineOptions", {})
        opts["debug.allowOutOfMemory"] = "true"
        opts["autoReport.directory"] = profile_dir or "."
        opts["autoReport.all"] = "true"
        self._popart.setEngineOptions(opts)
        return self

    def relaxOptimizerAttributesChecks(self, relax: bool = True) -> Any:
        """Unexpected optimizer attributes: debug messages instead of warnings (recorded)."""
        self._relax_optimizer_checks = relax
        return self

    def sourceLocationExcludes(self, excludes: list[str]) -> Any:
        """Frames left out of the IR's source locations (recorded: the emulator prints no IR)."""
        self._source_location_excludes = excludes
        return self

    def appendToLocationExcludes(self, *excludes: str) -> Any:
        """Add to :meth:`sourceLocationExcludes` (recorded)."""
        self._source_location_excludes += excludes
        return self


__all__ = ["DEFAULT_SOURCE_LOCATION_EXCLUDES", "OptionsRecorded", "PrecisionRecorded", "TrainingRecorded",
           "_JitOptions"]
