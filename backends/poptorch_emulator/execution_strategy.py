"""Execution strategies (``PipelinedExecution``, ``ShardedExecution``, ``SerialPhasedExecution``,
``ParallelPhasedExecution``), ``Stage`` and ``Phase``, and the trace that checks a model's blocks.

On an IPU the strategy only decides where each block runs; the numbers are those of the unsplit model, so
the emulator runs the model unchanged. What it reproduces (PopTorch python/options.py, _options_impl.py and
popart_compiler Compiler.cpp / CompilerImpl.cpp) is the placement and its errors. While the first
micro-batch of a compilation runs, a :class:`_Trace` follows the block annotations (:mod:`.blocks`) and
every torch op:

- each block gets its stage from the strategy: explicit stages (``PipelinedExecution("A", Stage("B",
  "C"))``; an unknown block is an AssertionError "Unknown Block ..."), ``AutoStage.SameAsIpu`` (stage =
  ``ipu_id``, which the block must give) or ``AutoStage.AutoIncrement``; its IPU is the stage's ``ipu()``,
  else the block's ``ipu_id``, else the stage id. Ops before any block run on IPU 0, stage 0; an op after
  a ``with Block`` ended and before the next block is an error ("No active Block, ...").
- the model uses max(IPUs used, highest IPU id + 1) IPUs per replica, times the replication factor
  (more than 64: "Too many IPUs requested"; not a power of two: refused unless ``autoRoundNumIPUs``).
- a pipeline has one forward stage per change of IPU (+1, starting from IPU 0), and 2F - 1 stages when
  training: ``gradientAccumulation`` must be at least that, and an inference pipeline's
  ``deviceIterations`` at least F. Sharded and phased execution have no such rule.
- phased execution needs explicit phases; in parallel phases even phases run on even IPUs, odd on odd.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from accelbatch.plan import reserved_ipus

from . import _overlap, blocks
from .enums import AutoStage, ConnectionType, Liveness
from .poptorch_core import compiler_error, py_error

logger = logging.getLogger("poptorch_emulator")

NO_ACTIVE_BLOCK_ERR = "No active Block, all the ops must belong to a Block"
PARALLEL_PHASES_ERR = ("When phases are executed in parallel: even phases must run on even IPUs and odd phases "
                       "on odd IPUs")
# ops that read a tensor's metadata and make no node in the graph
_METADATA = frozenset({"__get__", "__set__", "size", "dim", "numel", "__len__", "__repr__", "__format__",
                       "data_ptr", "is_floating_point", "is_complex", "element_size"})


class Stage:
    """One or more blocks (by ``user_id``) run on one IPU: ``Stage("A", "B").ipu(1)``."""

    def __init__(self, *block_ids: str) -> None:
        assert all(isinstance(b, str) for b in block_ids), f"Block IDs are supposed to be strings but got {block_ids}"
        self._blocks = block_ids
        self._stage_id = -1
        self._phase_id = -1
        self._ipu: int | None = None

    @property
    def blocks(self) -> tuple[str, ...]:
        return self._blocks

    def ipu(self, ipu: int) -> "Stage":
        """Run this stage on IPU ``ipu`` (whatever its blocks say)."""
        assert isinstance(ipu, int)
        self._ipu = ipu
        return self

    def _setStage(self, stage: int | None) -> "Stage":
        if stage is not None:
            self._stage_id = stage
        return self


class Phase:
    """Stages that run in parallel within one execution phase: ``Phase(Stage("A"), Stage("B"))`` or, for
    one stage of several blocks, ``Phase("A", "B")``."""

    def __init__(self, *arg: str | Stage) -> None:
        if all(isinstance(elt, Stage) for elt in arg):
            self.stages: list[Stage] = list(arg)  # type: ignore[arg-type]
        else:
            assert all(isinstance(elt, str) for elt in arg), (
                "All arguments must either be block IDs (strings) or Stages: " + str([type(elt) for elt in arg]))
            self.stages = [Stage(*arg)]  # type: ignore[arg-type]

    def stage(self, idx: int) -> Stage:
        return self.stages[idx]

    def ipus(self, *ipus: int) -> None:
        """One IPU per stage of this phase."""
        assert len(ipus) == len(self.stages), (
            f"Phase contains {len(self.stages)} stages but you provided {len(ipus)} ipus")
        for stage, ipu in zip(self.stages, ipus):
            stage.ipu(ipu)


class _StageManager:
    """Block id -> Stage for one trace: the explicit map, or stages made as blocks appear (AutoStage)."""

    def __init__(self, block_map: dict[str, Stage], auto_stage: AutoStage | None) -> None:
        self._block_map = dict(block_map)
        self._auto_stage = auto_stage
        self._next_id = 1
        self.current_ipu: int | None = None

    def get_stage(self, block_id: Any) -> Stage:
        if self._auto_stage is None:
            assert block_id in self._block_map, (
                f"Unknown Block '{block_id}' list of expected Blocks: {list(self._block_map.keys())}")
            return self._block_map[block_id]
        if block_id not in self._block_map:
            stage = Stage(block_id) if isinstance(block_id, str) else Stage()
            if self._auto_stage == AutoStage.SameAsIpu:
                assert self.current_ipu is not None, (
                    f"poptorch.AutoStage.SameAsIpu was selected but no IPU was specified for block {block_id}")
                stage._setStage(self.current_ipu)
            else:
                stage._setStage(self._next_id)
                self._next_id += 1
            self._block_map[block_id] = stage
        return self._block_map[block_id]


class _IExecutionStrategy:
    """What every strategy has: a block -> stage map (possibly empty) and how stages are made."""

    mode = "pipelined"

    def __init__(self, block_map: dict[str, Stage], auto_stage: AutoStage | None) -> None:
        self._block_map = block_map
        self._auto_stage = auto_stage

    def stage(self, block_id: str) -> Stage:
        """The Stage ``block_id`` belongs to."""
        assert block_id in self._block_map, f"Unknown block {block_id}"
        return self._block_map[block_id]

    def _stage_manager(self) -> _StageManager:
        return _StageManager(self._block_map, self._auto_stage)

    def backendOptions(self) -> dict[str, Any]:
        return {}


class PipelinedExecution(_IExecutionStrategy):
    """Pipeline the stages over IPUs: ``PipelinedExecution()`` (AutoStage.SameAsIpu), an AutoStage, or the
    stages as block ids, lists of block ids or ``Stage``s (stage k is the k-th argument)."""

    def __init__(self, *args: Any) -> None:
        block_map: dict[str, Stage] = {}
        auto_stage = AutoStage.SameAsIpu
        if len(args) == 1 and isinstance(args[0], AutoStage):
            auto_stage = args[0]
        else:
            for stage_id, arg in enumerate(args):
                if isinstance(arg, Stage):
                    stage = arg
                elif isinstance(arg, str):
                    stage = Stage(arg)
                else:
                    assert all(isinstance(elt, str) for elt in arg)
                    stage = Stage(*arg)
                stage._setStage(stage_id)
                for block in stage.blocks:
                    assert block not in block_map, f"{block} associated with more than one stage"
                    block_map[block] = stage
        super().__init__(block_map, None if block_map else auto_stage)

    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 0}


class ShardedExecution(PipelinedExecution):
    """The stages run one after the other on their IPUs (no pipelining: no rule on G or D)."""

    mode = "sharded"

    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 1}


class _IPhasedExecution(_IExecutionStrategy):
    """Blocks run in phases, each a ``Phase``, a list of ``Stage``s or a list of block ids."""

    mode = "phased"
    serial = True

    def __init__(self, *phases: Any) -> None:
        self._tensors_liveness = Liveness.AlwaysLive
        self._separate_backward_phase = False
        self._phases: list[Phase] = []
        block_map: dict[str, Stage] = {}
        for phase_id, args in enumerate(phases):
            if isinstance(args, Phase):
                phase = args
            else:
                phase = Phase(*(args if isinstance(args, list) else [args]))
            self._phases.append(phase)
            for stage in phase.stages:
                stage._phase_id = phase_id
                for block in stage.blocks:
                    assert block not in block_map, f"{block} associated with more than one stage"
                    block_map[block] = stage
        assert phases, "There is currently no AutoStage for PhasedExecution, please explicitly specify the phases"
        super().__init__(block_map, None)

    def phase(self, phase: int) -> Phase:
        assert isinstance(phase, int) and phase >= 0, "Phases are identified by positive integers"
        return self._phases[phase]

    def useSeparateBackwardPhase(self, use: bool = True) -> "_IPhasedExecution":
        assert isinstance(use, bool)
        self._separate_backward_phase = use
        return self

    def backendOptions(self) -> dict[str, Any]:
        return {"execution_mode": 2, "separate_backward_phase": self._separate_backward_phase,
                "tensors_liveness": self._tensors_liveness.value, "serial_phases_execution": self.serial}


class ParallelPhasedExecution(_IPhasedExecution):
    """Phases alternate between two groups of IPUs (even phases on even IPUs, odd on odd)."""

    serial = False

    def sendTensorsOffChipAfterFwd(self, off_chip: bool = True) -> "ParallelPhasedExecution":
        assert isinstance(off_chip, bool)
        self._tensors_liveness = Liveness.OffChipAfterFwd if off_chip else Liveness.AlwaysLive
        return self


class SerialPhasedExecution(_IPhasedExecution):
    """All phases run one after the other on one group of IPUs."""

    def setTensorsLiveness(self, liveness: Liveness) -> "SerialPhasedExecution":
        assert isinstance(liveness, Liveness)
        self._tensors_liveness = liveness
        return self


@dataclass
class Placement:
    """Where a traced model ran: blocks in the order begun, IPUs used and IPU changes."""

    mode: str
    blocks: list[tuple[Any, int, int, int]] = field(default_factory=list)  # (user_id, stage, phase, ipu)
    used_ipus: set[int] = field(default_factory=set)
    ipu_switches: int = 0

    @property
    def ipus_per_replica(self) -> int:
        return max(len(self.used_ipus), max(self.used_ipus) + 1) if self.used_ipus else 1

    @property
    def forward_stages(self) -> int:
        return self.ipu_switches + 1


class _Trace:
    """The compiler's view of one traced forward: the active block's stage, phase and IPU."""

    def __init__(self, strategy: _IExecutionStrategy) -> None:
        self._strategy = strategy
        self._stages = strategy._stage_manager()
        self._next_auto_id = 0
        self.placement = Placement(strategy.mode)
        self.overlap: _overlap.OverlapMarks | None = None
        self._active_ipu = 0
        self._last_ipu = 0

    def next_auto_id(self) -> str:
        self._next_auto_id += 1
        return str(self._next_auto_id - 1)

    def reset_auto_id(self) -> None:
        self._next_auto_id = 0

    def begin(self, user_id: Any, ipu_id: int | None) -> None:
        user_id = user_id or self.next_auto_id()
        self._stages.current_ipu = ipu_id
        stage = self._stages.get_stage(user_id)
        ipu = stage._ipu if stage._ipu is not None else ipu_id
        if ipu is None:
            ipu = stage._stage_id
        if self._strategy.mode == "phased":
            if stage._phase_id < 0:
                raise compiler_error("Invalid phase for ExecutionMode::Phased")
            if not self._strategy.serial and stage._phase_id % 2 != ipu % 2:
                raise compiler_error(PARALLEL_PHASES_ERR)
        if ipu != self._last_ipu:
            self.placement.ipu_switches += 1
        self._active_ipu = self._last_ipu = ipu
        self.placement.blocks.append((user_id, stage._stage_id, stage._phase_id, ipu))

    def end(self) -> None:
        self._active_ipu = -1

    def op(self) -> None:
        if self._active_ipu < 0:
            raise compiler_error(NO_ACTIVE_BLOCK_ERR)
        self.placement.used_ipus.add(self._active_ipu)


class _SeeOps(TorchFunctionMode):
    def __init__(self, trace: _Trace, marks: _overlap.OverlapMarks | None) -> None:
        super().__init__()
        self._trace, self._marks = trace, marks

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        if getattr(func, "__name__", "") not in _METADATA and not (self._marks and self._marks.marking):
            self._trace.op()
            if self._marks is not None:
                self._marks.saw_op(args, kwargs)
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def tracing(options: Any, inputs: Any = None) -> Iterator[_Trace]:
    """Within: the model's blocks and ops are traced under ``options``' strategy, and with ``inputs`` (the
    forward's BoundInputs) its overlap marks; then :func:`check_trace`."""
    trace = _Trace(options._execution_strategy)
    trace.overlap = _overlap.OverlapMarks(inputs) if inputs is not None else None
    token, marks_token = blocks.set_trace(trace), _overlap.ACTIVE.set(trace.overlap)
    try:
        with _SeeOps(trace, trace.overlap):
            yield trace
    finally:
        _overlap.ACTIVE.reset(marks_token)
        blocks.reset_trace(token)


def check_trace(trace: _Trace, outputs: Any, options: Any, training: bool) -> None:
    """PopTorch's compile-time errors for a traced forward that returned ``outputs``: its overlap marks, then
    its placement (:func:`check_placement`)."""
    if trace.overlap is not None:
        trace.overlap.check(outputs, options)
    check_placement(trace.placement, options, training)


def check_placement(placement: Placement, options: Any, training: bool) -> None:
    """PopTorch's errors for this placement under ``options`` (IPU count, then pipeline depth)."""
    if not placement.used_ipus:
        logger.info("No IPUs are used by this model. This may happen if the model is trivial")
        return
    num_ipus = placement.ipus_per_replica * options.replication_factor
    if num_ipus > 64:
        raise compiler_error(f"Too many IPUs requested ({num_ipus}). Experiments that need more than 64 IPUs "
                             "require distributed execution.")
    if options.connection_type != ConnectionType.Never:  # a device is acquired: whole IPUs count
        check_ipus(num_ipus, bool(options.auto_round_num_ipus))
    if placement.mode != "pipelined":
        return
    forward = placement.forward_stages
    if training:
        stages = 2 * forward - 1
        if options.Training.gradient_accumulation < stages:
            raise compiler_error(
                "poptorch.Options().Training.gradientAccumulation must be greater than or equal to the number "
                f"of pipeline stages ({stages}) when using poptorch.PipelinedExecution. Please note that a model "
                f"with {forward} pipeline stages in PopTorch will have an additional {forward - 1} stages when "
                "training.")
    elif options.device_iterations < forward:
        raise compiler_error(
            "poptorch.Options().deviceIterations must be greater than or equal to the number of pipeline "
            f"stages ({forward}) when using PopTorch.PipelinedExecution.")


def check_ipus(num_ipus: int, auto_round: bool) -> None:
    """PopTorch's rule when it acquires a device: error unless ``autoRoundNumIPUs`` (then a warning)."""
    rounded = reserved_ipus(num_ipus)
    if rounded == num_ipus:
        return
    why = ", because PopTorch must reserve a power of 2 or a multiple of 64 IPUs."
    if auto_round:
        logger.warning("Reserving %d IPUs when the model specifices the use of only %d%s %d will be reserved but "
                       "not used.", rounded, num_ipus, why, rounded - num_ipus)
        return
    raise py_error(f"The model specifies the use of {num_ipus} IPUs, however PopTorch must reserve a minimum of "
                   f"{rounded} in order to allow the model to run{why} Please reconfigure your model to use a "
                   "different number of IPUs or set poptorch.Options().autoRoundNumIPUs(True).")


def is_pipelined(options: Any) -> bool:
    """True when ``options`` pipeline (PipelinedExecution and not ShardedExecution)."""
    return getattr(options._execution_strategy, "mode", "") == "pipelined"


def check_inference_accumulation(options: Any) -> None:
    """An inference model accumulates no gradients: PopTorch refuses gradientAccumulation > 1."""
    if options.Training.gradient_accumulation != 1:
        raise py_error(
            "You must set poptorch.Options().Training.gradientAccumulation to 1 or leave it as its "
            "default value (1) when running a poptorch.inferenceModel()." + (
                " Use poptorch.Options().deviceIterations to process a sufficient number of batches "
                "each run for pipelined execution instead." if is_pipelined(options) else ""))


@contextlib.contextmanager
def dry_run(model: torch.nn.Module) -> Iterator[None]:
    """Run ``model`` for its trace alone: no gradient, the random generator and the buffers left as they were."""
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    with torch.no_grad(), torch.random.fork_rng(devices=[]):
        try:
            yield
        finally:
            for b, saved in buffers:
                b.copy_(saved)


__all__ = ["ParallelPhasedExecution", "Phase", "PipelinedExecution", "Placement", "SerialPhasedExecution",
           "ShardedExecution", "Stage", "check_inference_accumulation", "check_ipus", "check_placement", "check_trace",
           "dry_run", "is_pipelined", "tracing"]
