"""The PopTorch enumerations the emulator supports, with PopTorch's member names and values."""

from __future__ import annotations

import enum


class DataLoaderMode(enum.IntEnum):
    """How ``poptorch.DataLoader`` reads its dataset.

    - ``Sync``: in the calling process, as ``torch.utils.data.DataLoader`` does.
    - ``Async``: through an ``AsynchronousDataAccessor`` filling a ring buffer in a background process.
    - ``AsyncRebatched``: as ``Async``, but the workers produce small batches and the accessor
      re-forms full combined batches, so an ``IterableDataset`` split over several workers loses no
      tail elements. Identical to ``Async`` for map-style datasets.
    """

    Sync = 0
    Async = 1
    AsyncRebatched = 2


class SharingStrategy(enum.IntEnum):
    """How the dataset reaches the accessor's process (accepted for API compatibility)."""

    SharedMemory = 0
    FileSystem = 1
    Fork = 2
    ForkServer = 3


class OutputMode(enum.IntEnum):
    """Which micro-batches' outputs a call returns.

    - ``Final``: the last micro-batch of each replica.
    - ``EveryN``: every micro-batch of device iterations N-1, 2N-1, ... (N = ``output_return_period``).
    - ``All``: every micro-batch.
    - ``Sum``: per replica, the element-wise sum over all micro-batches.
    - ``Default``: ``All`` for an inference model, ``Final`` for a training model.
    """

    Final = 0
    EveryN = 1
    All = 2
    Sum = 3
    Default = 4


class HalfFloatCastingBehavior(enum.IntEnum):
    """Deprecated in PopTorch 3.3, kept so that code passing it to ``Precision.halfFloatCasting`` runs: mixed
    float16 / float32 operations are always computed in float32 (``HalfUpcastToFloat``), whatever is given."""

    FloatDowncastToHalf = 0
    HalfUpcastToFloat = 1
    Default = 2


class ReductionType(enum.IntEnum):
    """How gradients are reduced over accumulated micro-batches and replicas."""

    Sum = 0
    Mean = 1
    NoReduction = 2


class MeanReductionStrategy(enum.IntEnum):
    """When the Mean reduction divides (equal results in float32; kept for API compatibility)."""

    Running = 0
    Post = 1
    PostAndLoss = 2


class CommGroupType(enum.IntEnum):
    """How replicas are grouped for ``Options.inputReplicaGrouping``.

    - ``All``: one group of every replica (not valid for inputs).
    - ``Consecutive``: groups of consecutive replicas {0..k-1}, {k..2k-1}, ...
    - ``Orthogonal``: with m = R / k groups, {0, m, 2m, ...}, {1, m+1, ...}, ...
    - ``NoGrouping``: every replica on its own.
    """

    All = 0
    Consecutive = 1
    Orthogonal = 2
    NoGrouping = 3


class ConnectionType(enum.IntEnum):
    """When to attach to the device; ``Never`` means compile only."""

    Always = 0
    OnDemand = 1
    Never = 2


class SyncPattern(enum.IntEnum):
    """How IPUs synchronise with the host: ``Full`` (all together), ``SinglePipeline`` (each IPU with the
    host alone) or ``ReplicaAndLadder`` (groups alternate host IO and compute). Recorded by the emulator."""

    Full = 0
    SinglePipeline = 1
    ReplicaAndLadder = 2


class AutoStage(enum.IntEnum):
    """How a pipeline given no explicit stages numbers its blocks' stages: ``SameAsIpu`` (stage = the block's
    ``ipu_id``, the default) or ``AutoIncrement`` (each new block its own next stage)."""

    SameAsIpu = 0
    AutoIncrement = 1


class Liveness(enum.IntEnum):
    """Where phased execution keeps tensors between phases (recorded; a CPU has one memory)."""

    AlwaysLive = 0
    OffChipAfterFwd = 1
    OffChipAfterFwdNoOverlap = 2
    OffChipAfterEachPhase = 3


class MatMulSerializationMode(enum.Enum):
    """Which dimension ``serializedMatMul`` splits (the emulator multiplies in one piece: same numbers)."""

    InputChannels = "input_channels"
    ReducingDim = "reducing_dim"
    OutputChannels = "output_channels"
    Disabled = "none"


class OverlapMode(enum.Enum):
    """How far host I/O of a tensor overlaps computation (``set_overlap_for_input``; recorded only)."""

    NoOverlap = "no_overlap"
    OverlapAccumulationLoop = "overlap_accumulation_loop"
    OverlapDeviceIterationLoop = "overlap_device_iteration_loop"


__all__ = [
    "AutoStage",
    "Liveness",
    "HalfFloatCastingBehavior",
    "MatMulSerializationMode",
    "OverlapMode",
    "CommGroupType",
    "ConnectionType",
    "DataLoaderMode",
    "MeanReductionStrategy",
    "OutputMode",
    "ReductionType",
    "SharingStrategy",
    "SyncPattern",
]
