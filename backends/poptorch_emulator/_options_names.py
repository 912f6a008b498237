"""The public names of PopTorch 3.3's option classes, to tell a misspelled option from one the emulator lacks.

Copied from graphcore/poptorch at tag sdk/poptorch/3.3.0: the methods and properties of each class in
python/options.py, plus those of their base ``OptionsDict`` (python/_options_impl.py). PopTorch answers a
name its options do not have with ``AttributeError("Invalid attribute <name>.")``; the emulator keeps that
text for misspellings and says plainly when PopTorch 3.3 has the name but the emulator does not emulate it.
"""

from __future__ import annotations

_OPTIONS_DICT = ("checkIsFrozen", "createOrSet", "deleteIfExists", "exists", "set", "toDict", "update")

POPTORCH_33_NAMES: dict[str, frozenset[str]] = {name: frozenset(names + _OPTIONS_DICT) for name, names in {
    "Options": (
        "Distributed", "Jit", "Precision", "TensorLocations", "Training", "_Popart", "anchorTensor",
        "appendToLocationExcludes", "autoRoundNumIPUs", "broadcastBuffers", "clone", "connectionType",
        "defaultOutputMode", "deviceIterations", "disableModuleNamescope", "enableExecutableCaching",
        "enableProfiling", "enableStableNorm", "enableSyntheticData", "from_json", "inputReplicaGrouping",
        "loadFromFile", "logCycleCount", "logDir", "maxRepeatLogs", "modelName", "outputMode", "randomSeed",
        "relaxOptimizerAttributesChecks", "replicationFactor", "setAvailableMemoryProportion",
        "setExecutionStrategy", "showCompilationProgressBar", "sourceLocationExcludes", "syncPattern",
        "updatableNamedBuffers", "useIpuId", "useIpuModel", "useOfflineIpuTarget"),
    "_TrainingOptions": (
        "accumulationAndReplicationReductionType", "gradientAccumulation", "setAutomaticLossScaling",
        "setConvolutionDithering", "setMeanAccumulationAndReplicationReductionStrategy"),
    "_PrecisionOptions": (
        "enableFloatingPointExceptions", "enableStochasticRounding", "halfFloatCasting",
        "runningStatisticsAlwaysFloat", "setPartialsType"),
    "_DistributedOptions": ("configureProcessId", "disable", "numProcesses", "processId", "setEnvVarNames"),
    "_JitOptions": ("traceModel",),
    "TensorLocationSettings": (
        "minElementsForOffChip", "minElementsForReplicatedTensorSharding", "useIOTilesToLoad",
        "useIOTilesToStore", "useOnChipStorage", "useReplicatedTensorSharding"),
    "_TensorLocationOptions": (
        "numIOTiles", "setAccumulatorLocation", "setActivationLocation", "setOptimizerLocation",
        "setWeightLocation"),
}.items()}

# How a user reaches each class, for the message.
_PATHS = {"Options": "Options", "_TrainingOptions": "Options.Training", "_PrecisionOptions": "Options.Precision",
          "_DistributedOptions": "Options.Distributed", "_JitOptions": "Options.Jit",
          "TensorLocationSettings": "TensorLocationSettings", "_TensorLocationOptions": "Options.TensorLocations"}

# Why a name is left out, where more can be said than that it is.
_REASONS = {
    "updatableNamedBuffers": "it only serves PoplarExecutor.copyNamedBuffersToDevice(), which the emulator lacks",
}

NOT_EMULATED = ("poptorch.{path}.{name} exists in PopTorch 3.3 but accelbatch's emulator does not emulate "
                "it{why}: remove the call to run on the emulator, or run on IPUs with the Poplar SDK's "
                "poptorch")


def missing_option(class_name: str, name: str) -> AttributeError:
    """The error for ``name``, not found on an options object of class ``class_name``."""
    if name in POPTORCH_33_NAMES.get(class_name, ()):
        why = f" ({_REASONS[name]})" if name in _REASONS else ""
        return AttributeError(NOT_EMULATED.format(path=_PATHS[class_name], name=name, why=why))
    return AttributeError(f"Invalid attribute {name}.")


__all__ = ["NOT_EMULATED", "POPTORCH_33_NAMES", "missing_option"]
