"""A CPU emulator of the PopTorch subset accelbatch's IPU backend uses.

Import it where ``poptorch`` is not installed::

    from accelbatch.backends import poptorch_emulator as poptorch

and the same code runs on an IPU with ``import poptorch``. The emulator reproduces PopTorch's batching
semantics (device iterations, replication, gradient accumulation, output modes), its DataLoader and
AsynchronousDataAccessor, ``poptorch.optim`` (the optimizer state kept per executor and read back),
option freezing, execution strategies and block annotations (the unsplit model's numbers, PopTorch's
placement errors: execution_strategy.py), compilation on the first call with fixed input shapes, and
PopTorch's error texts. It
adds ``PoplarExecutor.compile_count`` and ``compiled_input_shapes`` to make recompilations measurable, and
``IS_EMULATOR = True``.
"""

from __future__ import annotations

from . import enums, optim, poptorch_core
from .accessor import AsynchronousDataAccessor
from .blocks import BeginBlock, Block, BlockFunction, module_repr, removeBlocks
from .custom_args import ICustomArgParser, registerCustomArgParser
from .dataloader import DataLoader
from .device_ops import (
    NOT_EMULATED,
    cond,
    dynamic_slice,
    dynamic_update,
    for_loop,
    ipu_print_tensor,
    nop,
    not_emulated,
    recomputationCheckpoint,
    serializedMatMul,
    set_available_memory,
    set_overlap_for_input,
    set_overlap_for_output,
)
from .enums import (
    AutoStage,
    CommGroupType,
    ConnectionType,
    DataLoaderMode,
    HalfFloatCastingBehavior,
    Liveness,
    MatMulSerializationMode,
    MeanReductionStrategy,
    OutputMode,
    OverlapMode,
    ReductionType,
    SharingStrategy,
    SyncPattern,
)
from .execution_strategy import (
    ParallelPhasedExecution,
    Phase,
    PipelinedExecution,
    SerialPhasedExecution,
    ShardedExecution,
    Stage,
)
from .model import PoplarExecutor, inferenceModel, trainingModel
from .ops import identity_loss, isRunningOnIpu
from .options import ConfigFileError, Options
from .poptorch_core import Error, RecoverableError, UnrecoverableError
from .tensor_locations import TensorLocationSettings

__version__ = "3.3.0+emulator"
IS_EMULATOR = True


def ipuHardwareIsAvailable(num_ipus: int = 1) -> bool:
    """There is no IPU behind the emulator."""
    return False


def setLogLevel(level: str | int) -> None:
    """Accepted for compatibility; the emulator logs through the ``poptorch_emulator`` logger."""


def __getattr__(name: str) -> object:
    """A PopTorch name the emulator leaves out is named in one line (not a bare AttributeError)."""
    if name in NOT_EMULATED:
        raise not_emulated(name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "AsynchronousDataAccessor", "AutoStage", "BeginBlock", "Block", "BlockFunction",
    "CommGroupType", "ConfigFileError", "ConnectionType", "DataLoader", "DataLoaderMode", "Error",
    "HalfFloatCastingBehavior", "ICustomArgParser",
    "IS_EMULATOR", "Liveness", "ParallelPhasedExecution", "Phase", "PipelinedExecution", "SerialPhasedExecution",
    "ShardedExecution", "Stage", "module_repr", "removeBlocks",
    "MeanReductionStrategy", "Options", "OutputMode", "PoplarExecutor", "RecoverableError", "ReductionType",
    "SharingStrategy", "SyncPattern", "TensorLocationSettings", "UnrecoverableError", "enums", "identity_loss",
    "inferenceModel",
    "ipuHardwareIsAvailable", "isRunningOnIpu", "optim", "poptorch_core", "registerCustomArgParser", "setLogLevel",
    "trainingModel", "MatMulSerializationMode", "OverlapMode", "cond", "dynamic_slice", "dynamic_update", "for_loop",
    "ipu_print_tensor", "nop", "recomputationCheckpoint", "serializedMatMul", "set_available_memory",
    "set_overlap_for_input", "set_overlap_for_output",
]
