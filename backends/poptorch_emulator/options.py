"""``poptorch.Options``: the subset of PopTorch's options the emulator honours, with PopTorch's freezing.

Behaviour reproduced from PopTorch (python/options.py, python/_options_impl.py):

- Every option lives in a dictionary of known keys; setting an unknown key or a value of another type
  fails with an ``AssertionError`` naming the option.
- Setters return the options object, so calls chain: ``Options().deviceIterations(4).randomSeed(0)``.
- Options are frozen once a model wrapper or a ``DataLoader`` uses them: every later setter, on the
  options or on one of their categories (``Training``, ``Distributed``, ``_Popart``), raises
  ``AttributeError("Can't modify frozen Options")``. ``clone()`` and ``copy.deepcopy`` give an unfrozen
  copy.
- Values are read back as attributes: ``opts.device_iterations``, ``opts.replication_factor``,
  ``opts.input_group_size``, ``opts.output_mode``, ``opts.output_return_period``, ``opts.random_seed``
  (only once set: check with ``opts.exists("random_seed")``), ``opts.Training.gradient_accumulation``,
  ``opts.Training.accumulation_and_replication_reduction_type``, ``opts.Distributed.numProcesses``.
- Settings the emulator records without effect (a CPU has one memory): ``opts.TensorLocations``
  (:mod:`.tensor_locations`) and ``setAvailableMemoryProportion`` (read back as
  ``opts.available_memory_proportion``, ``{ipu_index: proportion}``); ``maxRepeatLogs``, ``syncPattern``,
  ``disableModuleNamescope`` and ``_Popart.setPatterns``, which change nothing the emulator computes; the
  other such setters of PopTorch 3.3 are in :mod:`._options_recorded`. A name PopTorch 3.3 has but the
  emulator lacks is said to be one (:mod:`._options_names`); a misspelled one gets PopTorch's error.
- ``Training.setAutomaticLossScaling`` (:mod:`.auto_loss_scale`), ``anchorTensor`` (:mod:`.anchors`) and
  ``loadFromFile`` (:mod:`._options_config`) behave as in PopTorch.
"""

from __future__ import annotations

import copy
import json
import logging
import os
from typing import Any

import torch

from . import enums
from ._options_config import ConfigFileError, load_options_file
from ._options_dict import FROZEN_MESSAGE, _OptionsDict
from ._options_recorded import (
    DEFAULT_SOURCE_LOCATION_EXCLUDES,
    OptionsRecorded,
    PrecisionRecorded,
    TrainingRecorded,
    _JitOptions,
)
from .execution_strategy import PipelinedExecution, _IExecutionStrategy
from .tensor_locations import _TensorLocationOptions

logger = logging.getLogger("poptorch_emulator")

MEMORY_PROPORTION_MESSAGE = ('Available memory proportions are expected to be in a dictionary of {"IPU0": 0.5} '
                             "where the 0 in IPU is the index of the IPU. Invalid key: %s")


class _PopartOptions:
    """Free-form backend options (``opts._Popart.set(key, value)``); stored, not interpreted."""

    def __init__(self) -> None:
        self._frozen = False
        self.options: dict[str, Any] = {}

    def _set_frozen(self, frozen: bool) -> None:
        self._frozen = frozen

    def checkIsFrozen(self, option: str | None = None) -> None:
        if self._frozen:
            raise AttributeError(FROZEN_MESSAGE)

    def set(self, key: str, value: Any) -> "_PopartOptions":
        self.checkIsFrozen()
        self.options[key] = value
        return self

    def setEngineOptions(self, engine_options: dict[str, str]) -> "_PopartOptions":
        return self.set("engineOptions", engine_options)

    def setPatterns(self, patterns: dict[str, bool], level: int = 2) -> "_PopartOptions":
        """PopART's graph patterns to enable or disable over a ``PatternsLevel`` (recorded only)."""
        assert isinstance(level, int)
        assert isinstance(patterns, dict)
        self.set("patterns_level", level)
        return self.set("patterns", patterns)

    def __deepcopy__(self, memo: dict[int, Any]) -> "_PopartOptions":
        new = _PopartOptions()
        memo[id(self)] = new
        new.options = copy.deepcopy(self.options, memo)
        return new

    def __repr__(self) -> str:
        return "_PopartOptions(" + ", ".join(f"{k}={v!r}" for k, v in self.options.items()) + ")"


class _TrainingOptions(_OptionsDict, TrainingRecorded):
    """``opts.Training``: options that only apply to a ``trainingModel``."""

    def __init__(self, popart: "_PopartOptions") -> None:
        object.__setattr__(self, "_popart_options", popart)
        super().__init__(
            gradient_accumulation=1,
            accumulation_and_replication_reduction_type=enums.ReductionType.Mean,
            meanAccumulationAndReplicationReductionStrategy=enums.MeanReductionStrategy.Post,
        )

    def gradientAccumulation(self, gradient_accumulation: int) -> "_TrainingOptions":
        """Micro-batches whose gradients are accumulated before each weight update."""
        self.set(gradient_accumulation=gradient_accumulation)
        return self

    def accumulationAndReplicationReductionType(
            self, reduction_type: enums.ReductionType) -> "_TrainingOptions":
        """Mean (default) or Sum of the gradients over accumulated micro-batches and replicas."""
        if (not isinstance(reduction_type, enums.ReductionType)
                or reduction_type == enums.ReductionType.NoReduction):
            raise ValueError("accumulationAndReplicationReductionType must be set to "
                             "poptorch.ReductionType.Mean or poptorch.ReductionType.Sum")
        self.set(accumulation_and_replication_reduction_type=reduction_type)
        return self

    def setMeanAccumulationAndReplicationReductionStrategy(
            self, mean_reduction_strategy: enums.MeanReductionStrategy) -> "_TrainingOptions":
        """When the Mean reduction divides; all strategies give the same float32 result here."""
        self.set(meanAccumulationAndReplicationReductionStrategy=mean_reduction_strategy)
        return self

    def setAutomaticLossScaling(self, enabled: bool) -> "_TrainingOptions":
        """Let the device adjust the loss scale from float16 gradient statistics (see :mod:`.auto_loss_scale`)."""
        self.checkIsFrozen()
        self._popart_options.set("automaticLossScalingSettings.enabled", enabled)
        return self


class _PrecisionOptions(_OptionsDict, PrecisionRecorded):
    """``opts.Precision``: half-precision settings.

    As in PopTorch, the partials type, stochastic rounding and floating-point exceptions are backend
    options (``_Popart``: ``partialsTypeMatMuls``, ``convolutionOptions``, ``enableStochasticRounding``,
    ``enableFloatingPointChecks``). The emulator records them: a CPU's float16 matmul accumulates in float32
    whatever the partials type, and it rounds to nearest (no stochastic rounding).
    """

    def __init__(self, popart: "_PopartOptions") -> None:
        object.__setattr__(self, "_popart_options", popart)
        super().__init__(autocast_enabled=True)

    def autocastEnabled(self, autocast_enabled: bool) -> "_PrecisionOptions":
        if not isinstance(autocast_enabled, bool):
            raise ValueError("autocastEnabled must be set to either True or False")
        self.set(autocast_enabled=autocast_enabled)
        return self

    def runningStatisticsAlwaysFloat(self, value: bool) -> "_PrecisionOptions":
        if not isinstance(value, bool):
            raise ValueError("runningStatisticsAlwaysFloat needs to be set to a bool")
        self.createOrSet(running_statistics_always_float=value)
        return self

    def enableFloatingPointExceptions(self, enabled: bool) -> "_PrecisionOptions":
        assert isinstance(enabled, bool), "enableFloatingPointExceptions needs to be set to a bool"
        self.checkIsFrozen()
        self._popart_options.set("enableFloatingPointChecks", enabled)
        return self

    def enableStochasticRounding(self, enabled: bool) -> "_PrecisionOptions":
        self.checkIsFrozen()
        self._popart_options.set("enableStochasticRounding", enabled)
        return self

    def setPartialsType(self, dtype: torch.dtype) -> "_PrecisionOptions":
        """Type of matmul and convolution partials: ``torch.float`` or ``torch.half``."""
        if dtype in (torch.float, torch.float32):
            name = "float"
        elif dtype in (torch.half, torch.float16):
            name = "half"
        else:
            raise ValueError("parameter to setPartialsType should be either torch.float or torch.half")
        self.checkIsFrozen()
        self._popart_options.set("partialsTypeMatMuls", name)
        self._popart_options.set("convolutionOptions", {"partialsType": name})
        return self


class _DistributedOptions(_OptionsDict):
    """``opts.Distributed``: this process's id among the processes sharing a run.

    As in PopTorch, the defaults come from ``OMPI_COMM_WORLD_RANK`` / ``OMPI_COMM_WORLD_SIZE``.
    """

    def __init__(self) -> None:
        super().__init__(num_distributed_processes=1, distributed_process_id=0)
        self.setEnvVarNames("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK")

    def disable(self) -> "_DistributedOptions":
        self.set(num_distributed_processes=1, distributed_process_id=0)
        return self

    def setEnvVarNames(self, var_num_processes: str, var_process_id: str) -> "_DistributedOptions":
        return self.configureProcessId(int(os.environ.get(var_process_id, "0")),
                                       int(os.environ.get(var_num_processes, "1")))

    def configureProcessId(self, process_id: int, num_processes: int) -> "_DistributedOptions":
        self.set(distributed_process_id=process_id)
        self.set(num_distributed_processes=num_processes)
        return self

    @property
    def processId(self) -> int:
        return self.distributed_process_id

    @property
    def numProcesses(self) -> int:
        return self.num_distributed_processes


class Options(_OptionsDict, OptionsRecorded):
    """How a model is compiled and run; pass it to the model wrappers and to ``poptorch.DataLoader``.

    >>> opts = Options().deviceIterations(4).replicationFactor(2)
    >>> opts.Training.gradientAccumulation(8)
    """

    def __init__(self) -> None:
        object.__setattr__(self, "_tensor_locations", _TensorLocationOptions())
        object.__setattr__(self, "_popart", _PopartOptions())
        object.__setattr__(self, "_training", _TrainingOptions(self._popart))
        object.__setattr__(self, "_distributed", _DistributedOptions())
        object.__setattr__(self, "_module_namescope_enabled", True)
        object.__setattr__(self, "_show_compilation_progress_bar", True)
        object.__setattr__(self, "_precision", _PrecisionOptions(self._popart))
        object.__setattr__(self, "_execution_strategy", PipelinedExecution())
        object.__setattr__(self, "_jit", _JitOptions())
        object.__setattr__(self, "_relax_optimizer_checks", False)
        object.__setattr__(self, "_source_location_excludes", list(DEFAULT_SOURCE_LOCATION_EXCLUDES))
        super().__init__(
            replication_factor=1,
            input_group_size=1,
            input_cgt=enums.CommGroupType.Consecutive,
            broadcast_buffers=True,
            device_iterations=1,
            log_dir=".",
            max_repeat_logs=4,
            auto_round_num_ipus=False,
            anchored_tensors={},
            output_mode=enums.OutputMode.Default.value,
            output_return_period=1,
            connection_type=enums.ConnectionType.Always.value,
            sync_pattern=enums.SyncPattern.Full.value,
            available_memory_proportion={},
        )
        path = os.environ.get("POPTORCH_CACHE_DIR", "")
        if path:
            self.enableExecutableCaching(path)
        self.from_json(os.environ.get("POPTORCH_DEFAULT_OPTIONS", "{}"))

    def from_json(self, string: str) -> "Options":
        """Call setters named by a JSON object: ``{"deviceIterations": 2, "Precision.setPartialsType": ...}``;
        a list value gives the arguments, a string ``"Enum.Member"`` a poptorch enum member."""
        for name, value in json.loads(string).items():
            setter: Any = self
            for part in name.split("."):
                setter = getattr(setter, part)
            if isinstance(value, str) and value.count(".") == 1:
                enum_name, member = value.split(".")
                value = getattr(getattr(enums, enum_name, None), member, value)
            if isinstance(value, list):
                setter(*value)
            else:
                setter(value)
        return self

    # -- categories -------------------------------------------------------------------------------
    @property
    def Training(self) -> _TrainingOptions:
        return self._training

    @property
    def Distributed(self) -> _DistributedOptions:
        return self._distributed

    @property
    def _Popart(self) -> _PopartOptions:
        return self._popart

    @property
    def Precision(self) -> _PrecisionOptions:
        return self._precision

    @property
    def TensorLocations(self) -> Any:
        """Where activations, weights, optimizer states and accumulators are stored (recorded only)."""
        return self._tensor_locations

    # -- batching ---------------------------------------------------------------------------------
    def deviceIterations(self, device_iterations: int) -> "Options":
        """Iterations (weight updates when training) run on the device per host call."""
        self.set(device_iterations=device_iterations)
        return self

    def replicationFactor(self, replication_factor: int) -> "Options":
        """Number of replicas of the model, each fed its own micro-batch (data parallelism)."""
        self.set(replication_factor=replication_factor)
        return self

    def inputReplicaGrouping(self, input_group_size: int,
                             input_group_type: enums.CommGroupType) -> "Options":
        """Replicas in one input group receive the same input data."""
        if input_group_type == enums.CommGroupType.NoGrouping:
            input_group_size = 1
            input_group_type = enums.CommGroupType.Consecutive
        if input_group_type == enums.CommGroupType.All:
            raise ValueError("input_group_type cannot be All")
        if self.replication_factor < input_group_size:
            raise ValueError("input_group_size cannot be larger than replication_factor")
        if self.replication_factor % input_group_size != 0:
            raise ValueError("input_group_size must be a factor of replication_factor")
        self.set(input_group_size=input_group_size)
        self.set(input_cgt=input_group_type)
        return self

    def outputMode(self, output_mode: enums.OutputMode,
                   output_return_period: int | None = None) -> "Options":
        """Which micro-batches' outputs to return: All, Final, Sum, EveryN (with a period) or Default."""
        if not isinstance(output_mode, enums.OutputMode):
            raise AssertionError(f"output_mode must be a poptorch.OutputMode, not {output_mode!r}")
        if output_mode == enums.OutputMode.EveryN:
            if not (output_return_period and output_return_period > 0):
                raise AssertionError(
                    "EveryN anchor must have output_return_period set to valid positive integer")
        elif output_return_period:
            logger.info("Anchor return period argument ignored with output_mode set to %s", output_mode)
        self.set(output_mode=output_mode.value, output_return_period=output_return_period or 1)
        return self

    def defaultOutputMode(self) -> bool:
        return self.output_mode == enums.OutputMode.Default

    def anchorTensor(self, short_name: str, long_name: str, output_mode: enums.OutputMode | None = None,
                     output_return_period: int | None = 1) -> "Options":
        """Return the tensor ``long_name`` (PopART's name) after each run, read back with
        ``model.getAnchoredTensor(short_name)``; without an output mode it follows the model's outputs. The
        emulator's tensors are listed in :mod:`.anchors`."""
        self.checkIsFrozen()
        if output_mode is not None and not isinstance(output_mode, enums.OutputMode):
            raise AssertionError(f"output_mode must be a poptorch.OutputMode, not {output_mode!r}")
        if output_mode != enums.OutputMode.EveryN:
            output_return_period = 1
        elif not (output_return_period and output_return_period > 0):
            raise AssertionError("EveryN anchor must have output_return_period set to valid positive integer")
        self.anchored_tensors[short_name] = [long_name, output_mode is None, output_mode, output_return_period]
        return self

    # -- misc ---------------------------------------------------------------------------------------
    def randomSeed(self, random_seed: int) -> "Options":
        """Seed the device's random generator (and, as PopTorch does, torch's host generator)."""
        if not isinstance(random_seed, int):
            raise AssertionError(f"random_seed must be an int, not {type(random_seed)}")
        torch.manual_seed(random_seed)
        self.createOrSet(random_seed=random_seed)
        return self

    def enableExecutableCaching(self, path: str | None) -> "Options":
        if path is None:
            self._Popart.set("enableEngineCaching", False)
        else:
            self._Popart.set("cachePath", path)
            self._Popart.set("enableEngineCaching", True)
        return self

    def enableSyntheticData(self, enabled: bool) -> "Options":
        """No host I/O: the device makes its own inputs (PopTorch: random normal data, ``syntheticDataMode``
        2). The emulator feeds floating-point inputs from a normal distribution and other inputs as zeros
        (ids in range for an embedding), all of the compiled shapes, and leaves the host's data unread."""
        self._Popart.set("syntheticDataMode", 2 if enabled else 0)
        return self

    def setAvailableMemoryProportion(self, available_memory_proportion: dict[str, float]) -> "Options":
        """Temporary memory for matmuls, convolutions and the like per IPU: ``{"IPU0": 0.5}`` (recorded only)."""
        proportions = {}
        for key, proportion in available_memory_proportion.items():
            if not key.startswith("IPU"):
                raise AssertionError(MEMORY_PROPORTION_MESSAGE % key)
            proportions[int(key[3:])] = proportion
        self.createOrSet(available_memory_proportion=proportions)
        return self

    def connectionType(self, connection_type: enums.ConnectionType) -> "Options":
        if not isinstance(connection_type, enums.ConnectionType):
            raise AssertionError(f"connection_type must be a poptorch.ConnectionType, not {connection_type!r}")
        self.set(connection_type=connection_type.value)
        return self

    def useOfflineIpuTarget(self, ipu_version: int = 2) -> "Options":
        """Compile for an IPU that is not attached (``ConnectionType.Never``): models can compile, not run."""
        self.connectionType(enums.ConnectionType.Never)
        self.createOrSet(ipu_version=ipu_version)
        return self

    def useIpuModel(self, use_model: bool) -> "Options":
        self.createOrSet(use_model=use_model)
        return self

    def setExecutionStrategy(self, strategy: Any) -> "Options":
        """How the model's blocks are placed: ``PipelinedExecution`` (the default), ``ShardedExecution``,
        ``SerialPhasedExecution`` or ``ParallelPhasedExecution`` (see :mod:`.execution_strategy`)."""
        self.checkIsFrozen()
        assert isinstance(strategy, _IExecutionStrategy)
        object.__setattr__(self, "_execution_strategy", strategy)
        return self

    def autoRoundNumIPUs(self, auto_round_num_ipus: bool = True) -> "Options":
        self.set(auto_round_num_ipus=auto_round_num_ipus)
        return self

    def broadcastBuffers(self, broadcast_buffers: bool = True) -> "Options":
        self.set(broadcast_buffers=broadcast_buffers)
        return self

    def logDir(self, log_dir: str) -> "Options":
        self.set(log_dir=log_dir)
        return self

    def maxRepeatLogs(self, max_lines: int | None) -> "Options":
        """Lines of an often-repeated log message shown before the rest are suppressed (None: all); recorded."""
        self.set(max_repeat_logs=(1 << 64) - 1 if max_lines is None else max_lines)
        return self

    def syncPattern(self, sync_pattern: enums.SyncPattern) -> "Options":
        """How IPUs synchronise with the host (recorded: the emulator has one host thread)."""
        if not isinstance(sync_pattern, enums.SyncPattern):
            raise AssertionError(f"sync_pattern must be a poptorch.SyncPattern, not {sync_pattern!r}")
        self.set(sync_pattern=sync_pattern.value)
        return self

    def disableModuleNamescope(self) -> "Options":
        """Leave the module names out of the operators' names (recorded: the emulator names no operators)."""
        self.checkIsFrozen()
        object.__setattr__(self, "_module_namescope_enabled", False)
        return self

    def showCompilationProgressBar(self, show: bool = True) -> "Options":
        """Show a progress bar while compiling (the default); ``compilationTime()`` needs it."""
        self._show_compilation_progress_bar = show
        return self

    def loadFromFile(self, filepath: str) -> "Options":
        """Run the setter calls of a file, one a line without ``options.`` (see :mod:`._options_config`)."""
        load_options_file(self, filepath)
        return self

    def modelName(self, name: str) -> "Options":
        self.createOrSet(model_name=name)
        return self

    def clone(self) -> "Options":
        """An unfrozen deep copy."""
        return copy.deepcopy(self)

    def toDict(self) -> dict[str, Any]:
        out = dict(self._popart.options)
        out.update(self._values)
        out.update(self._training.toDict())
        out.update(self._distributed.toDict())
        return out

    def __repr__(self) -> str:
        body = ", ".join(f"{k}={v!r}" for k, v in self._values.items())
        return (f"Options({body}, Training={self._training!r}, Distributed={self._distributed!r}, "
                f"_Popart={self._popart!r})")



def adopt_optimizer_accum_type(options: Options, optimizer: Any, compiled: bool) -> None:
    """PopTorch's rule: an optimizer accumulating in float16 (``accum_type``), unless it uses the combined
    accumulator, makes the mean reduction Running; once compiled, a model using another strategy refuses it."""
    if getattr(optimizer, "accum_type", None) != torch.float16 or getattr(optimizer, "use_combined_accum", False):
        return
    running = enums.MeanReductionStrategy.Running
    if not compiled:
        frozen = options._frozen
        options._unfreeze()
        options.Training.setMeanAccumulationAndReplicationReductionStrategy(running)
        if frozen:
            options._freeze()
    elif options.Training.meanAccumulationAndReplicationReductionStrategy != running:
        raise ValueError("Invalid optimizer: the new optimizer would require changing options.Training."
                         "meanAccumulationAndReplicationReductionStrategy to poptorch.MeanReductionStrategy."
                         "Running but the executable is already compiled.")


__all__ = ["ConfigFileError", "Options", "FROZEN_MESSAGE", "adopt_optimizer_accum_type"]
