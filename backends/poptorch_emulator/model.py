"""``trainingModel`` / ``inferenceModel`` and the ``PoplarExecutor`` they return, run on the CPU.

What is reproduced from PopTorch (python/__init__.py, python/_poplar_executor.py):

- The wrapper calls a shallow copy of the user's module, so parameters and buffers are shared: training
  updates the user's ``nn.Module`` in place (PopTorch copies the weights back to the host on access).
- The options are frozen when the wrapper is made, and the wrapper keeps an unfrozen-then-frozen clone.
  The default output mode is ``Final`` for training and ``All`` for inference; a training model without
  an optimizer gets ``SGD(lr=0.01)``.
- The first call (or ``compile()``) "compiles": the batch dimension of every tensor input must be a
  multiple of D * (R / input_group_size) * G (AssertionError "Invalid batch dimension: ..."), and the
  input shapes, dtypes and constant values are recorded. A later call must match them exactly
  ("Shape mismatch for {name}: expected ... but got ..."). ``compile_count`` counts compilations.
- One call runs D device iterations. For training, each iteration runs G micro-batches on each of the R
  replicas, reduces the gradients (Mean: divided by G*R, the default; Sum: summed) and makes one
  optimizer step. The loss is found as PopTorch finds it (a torch loss or ``identity_loss`` that no other
  loss uses: see ops.py), whichever output holds it.
- The optimizer's hyper-parameters (lr, momentum, ...) are read when the model is made and by
  ``setOptimizer``; changing them on the host optimizer alone has no effect, as on an IPU.
- The optimizer's state (momenta, Adam's moments and step) lives on the device, one per executor: a new
  executor starts from none, the host optimizer's ``state`` is never stepped. Only a ``poptorch.optim``
  optimizer moves it (optim.py): ``optimizer.state_dict()`` reads it back when the device has stepped since
  (the executor that last took the optimizer answers), detaching reads it back too, and a state loaded with
  ``optimizer.load_state_dict`` or read back from another executor is written to the device when this one
  compiles, attaches or runs next. With torch's optimizers each executor keeps its own state and a
  checkpoint of the host optimizer holds none, as on an IPU. ``trainingModel`` refuses an optimizer
  PopTorch cannot run (``optim.optimizer_type``).
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import logging
import time
from collections import defaultdict
from typing import Any

import torch

from accelbatch.streams import CallStreams

from . import _device, _outputs, _structure, blocks, device_ops, execution_strategy, module_state, optim
from ._inputs import ArgBinder, Batching, BoundInputs, CompiledInputs
from ._mixed_precision import has_half_state, promoting
from ._optim_state import step_on_device, to_device, to_host
from ._replicas import ReplicaState, refusing_broadcast
from .anchors import AnchorMemory
from .auto_loss_scale import AutoLossScale
from .enums import ConnectionType, OutputMode, ReductionType
from .ops import _running_on_device, final_loss, finding_losses
from .options import Options, adopt_optimizer_accum_type
from .perf_counters import PerfCounterMethods
from .poptorch_core import py_error

logger = logging.getLogger("poptorch_emulator")

NO_EXECUTABLE_ERR = "Model has not been compiled or has been destroyed."
ALREADY_WRAPPED_ERR = ("Model has already been wrapped in 'poptorch.trainingModel'. Call model.destroy() "
                       "on the model to unwrap before wrapping again.")


class PoplarExecutor(PerfCounterMethods):
    """A model "compiled" for the (emulated) IPU; call it like the wrapped module."""

    def __init__(self, model: torch.nn.Module, options: Options | None, training: bool,
                 optimizer: torch.optim.Optimizer | None = None,
                 user_model: torch.nn.Module | None = None) -> None:
        if options is not None:
            if not isinstance(options, Options):
                raise py_error(f"Invalid type: 'options' is of type {type(options)} "
                               "(Expected poptorch.Options)")
            options._freeze()
            options = options.clone()
        else:
            options = Options()
        self._user_model, self._model, self._training = user_model or model, model, training
        if training:
            if options.defaultOutputMode():
                options.outputMode(OutputMode.Final)
            if optimizer is None:
                optimizer = optim.SGD(self._user_model.parameters(), lr=0.01)
        else:
            if options.defaultOutputMode():
                options.outputMode(OutputMode.All)
            execution_strategy.check_inference_accumulation(options)
            if optimizer is not None:
                raise AssertionError("Optimizer should be None for inference")
        self._options = options
        self._replicas = ReplicaState(model, options, self._params if training else None)
        self._binder = ArgBinder(model)
        self._compiled: CompiledInputs | None = None
        self._compile_count = 0
        self._compilation_time: datetime.timedelta | None = None
        self._is_attached = False
        self._optimizer: torch.optim.Optimizer | None = None
        self._optimizer_hparams: list[dict[str, Any]] = []
        self._loss_scaling = 1.0
        self._half = _device.HalfUpdates()
        self._als = AutoLossScale(options._Popart.options, training)
        self._anchors = AnchorMemory(options)
        self._synthetic: torch.Generator | None = None
        self._loaded_from_cache = False
        self._device_state: defaultdict[torch.Tensor, dict[str, Any]] = defaultdict(dict)  # "on the IPU"
        if optimizer is not None:
            self.setOptimizer(optimizer)
        self._options._freeze()
        if training:
            _device.set_wrapped(self._user_model, True)

    # -- attributes ---------------------------------------------------------------------------------
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__") or attr in ("_user_model", "_model") or attr in device_ops.EXECUTOR_NOT_EMULATED:
            raise device_ops.not_emulated(f"PoplarExecutor.{attr}") if attr[0] != "_" else AttributeError(attr)
        return getattr(self._user_model, attr)

    def __repr__(self) -> str:
        return blocks.module_repr(self._user_model)

    @property
    def model(self) -> torch.nn.Module:
        """The user's module (its parameters are the ones trained)."""
        return self._user_model

    @property
    def options(self) -> Options:
        return self._options

    @property
    def training(self) -> bool:
        return self._training

    # -- emulator extras ----------------------------------------------------------------------------
    @property
    def compile_count(self) -> int:
        """How many times this wrapper compiled (1 after the first call; +1 after each destroy+call)."""
        return self._compile_count

    @property
    def compiled_input_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Input name -> (shape, dtype) the current executable was compiled for (empty if none)."""
        return self._compiled.shapes() if self._compiled is not None else {}

    @property
    def loaded_from_cache(self) -> bool:
        """True when the last compilation loaded its executable from the executable cache."""
        return self._loaded_from_cache

    @property
    def batching(self) -> Batching:
        return Batching.of(self._options)

    # -- compilation --------------------------------------------------------------------------------
    def isCompiled(self) -> bool:
        return self._compiled is not None

    def compile(self, *args: Any, **kwargs: Any) -> None:
        """Compile for these inputs without running (ignored with a warning if already compiled)."""
        inputs = self._binder(args, kwargs)
        if self.isCompiled():
            logger.warning("Call to compile() ignored: the executable is already compiled")
            return
        self._compile(inputs)
        b = self.batching
        with self._tracing(True), execution_strategy.dry_run(self._model):
            self._forward(inputs.map(lambda t: b.micro_batch(t.detach(), 0, 0, 0)))

    @contextlib.contextmanager
    def _tracing(self, compiling: bool):
        """PopTorch compiles by tracing the model: a trace that fails leaves no executable."""
        try:
            yield
        except BaseException:
            if compiling:
                self._compiled = None
            raise

    def compilationTime(self) -> datetime.timedelta:
        if not self.isCompiled():
            raise py_error("Please compile the model before obtaining compilation time.")
        if not self._options._show_compilation_progress_bar:
            raise py_error("Please set showCompilationProgressBar option to obtain compilation time.")
        assert self._compilation_time is not None
        return self._compilation_time

    def _compile(self, inputs: BoundInputs) -> None:
        start = time.perf_counter()
        batching = self.batching
        for name, value in (("Options.deviceIterations", batching.device_iterations),
                            ("Options.replicationFactor", batching.replication_factor),
                            ("Options.Training.gradientAccumulation", batching.gradient_accumulation)):
            if value < 1:
                raise py_error(f"{name} must be at least 1, got {value}")
        _outputs.check_period(OutputMode(self._options.output_mode), self._options.output_return_period,
                              batching.device_iterations)
        for tensor in inputs.tensors():
            batching.check_batch_dim(tensor)
        self._als.check(self._params() if self._training else [])
        self._anchors.check(self._training, self._als.enabled, [n for n, _ in self._model.named_parameters()],
                            batching.device_iterations)
        if any(t.requires_grad for t in inputs.tensors()):
            logger.warning("Input tensor has requires_grad=True set. This tensor will be detached because "
                           "backward pass via inputs is not supported.")
        self._compiled = CompiledInputs(inputs)
        self._replicas.reset()
        self._half_state = has_half_state(self._model, inputs.tensors())  # PopTorch's mixed-precision casts
        self._modes = _device.compiled_modes(self._model)
        key = _device.cache_key(self._user_model, self._training, self._compiled.shapes(), self._options,
                                self._optimizer)
        self._loaded_from_cache = bool(_device.cache_lookup(self._options, key))
        if self._loaded_from_cache:
            logger.info("Loaded the executable from the cache (%s)", self._options._Popart.options["cachePath"])
        self._loss_output: int | None = None  # which output is the final loss, once a training run found it
        self._placement: execution_strategy.Placement | None = None  # blocks and IPUs, once traced
        self._compile_count += 1
        self._compilation_time = datetime.timedelta(seconds=time.perf_counter() - start)
        self._is_attached = self._options.connection_type != ConnectionType.Never
        if self._is_attached:
            self._on_device_attach()

    # -- device ---------------------------------------------------------------------------------------
    def isAttachedToDevice(self) -> bool:
        return self.isCompiled() and self._is_attached

    def attachToDevice(self) -> None:
        if not self.isCompiled():
            raise py_error(NO_EXECUTABLE_ERR)
        if self._options.connection_type == ConnectionType.Never:
            raise AssertionError("Trying to attach to an offline device (ConnectionType.Never)")
        if self._is_attached:
            raise py_error("Device is already attached")
        self._is_attached = True
        self._on_device_attach()

    def detachFromDevice(self) -> None:
        if not self.isCompiled():
            raise py_error(NO_EXECUTABLE_ERR)
        if not self._is_attached:
            raise py_error("Device is not attached")
        if self._training:
            self._read_optimizer_state()
        self._is_attached = False

    def destroy(self) -> None:
        """Release the executable; a training model's module can then be wrapped again."""
        if not self.isCompiled():
            return
        if self._training and self._optimizer is not None:
            self._optimizer.state_dict()  # read the state back while there is an executable (as PopTorch)
        self._compiled = None
        self._is_attached = False
        self._device_state = defaultdict(dict)
        if self._training:
            _device.set_wrapped(self._user_model, False)

    def getAnchoredTensor(self, short_name: str) -> torch.Tensor:
        """The last run's value of an anchored tensor (see :mod:`.anchors`)."""
        return self._anchors.get(short_name)

    # -- weights and optimizer ------------------------------------------------------------------------
    # Host and device share one copy of the weights, so the copies only check the state PopTorch checks.
    def copyWeightsToHost(self) -> None:
        if not self.isCompiled():
            raise py_error(NO_EXECUTABLE_ERR)

    def copyWeightsToDevice(self) -> None:
        if not self.isCompiled():
            raise py_error(NO_EXECUTABLE_ERR)
        self._replicas.reset()

    def copyWeightsToHostIfNeeded(self) -> bool:
        return False

    def load_state_dict(self, state_dict: dict[str, torch.Tensor], strict: bool = True) -> Any:
        out = self._user_model.load_state_dict(state_dict, strict)
        if self.isAttachedToDevice():
            self.copyWeightsToDevice()
        return out

    def setOptimizer(self, optimizer: torch.optim.Optimizer) -> None:
        """Use ``optimizer`` with its current hyper-parameters (call again after changing them); a poptorch
        optimizer's ``state_dict()`` then reads the state back from this executor."""
        optim.optimizer_type(optimizer)
        adopt_optimizer_accum_type(self._options, optimizer, self.isCompiled())
        old = self._optimizer
        if self.isCompiled() and optimizer is not old:
            if isinstance(old, optim.Optimizer):  # keep the old one's state, and unhook it from this executor
                self._read_optimizer_state()
                old.__dict__.pop("state_dict", None)
            if isinstance(optimizer, optim.Optimizer):
                optimizer.ipu_state_is_dirty = True
        if isinstance(optimizer, optim.Optimizer):
            optimizer.state_dict = self._optimizer_state_dict
        self._optimizer = optimizer
        self._optimizer_hparams = [{k: copy.copy(v) for k, v in group.items() if k != "params"}
                                   for group in optimizer.param_groups]
        self._loss_scaling = _device.loss_scaling(optimizer)
        if self.isAttachedToDevice():
            self._write_optimizer_state()

    # The optimizer state on the device and its copies to and from a poptorch optimizer's host dict.
    def _optimizer_state_dict(self) -> dict[str, Any]:
        assert isinstance(self._optimizer, optim.Optimizer)
        self._read_optimizer_state()
        return self._optimizer.get_state_dict()

    def _read_optimizer_state(self) -> None:
        opt = self._optimizer
        if not isinstance(opt, optim.Optimizer) or not opt.host_state_is_dirty:
            return
        if not self.isCompiled():
            raise py_error(NO_EXECUTABLE_ERR)
        assert not opt.ipu_state_is_dirty, "Both host and ipu states cannot be dirty at the same time."
        ipu_state = to_host(self._device_state, self._user_model, self._als)
        opt.set_state_dict({"ipu_state": ipu_state, "ipu_param": copy.deepcopy(self._optimizer_hparams),
                            **torch.optim.Optimizer.state_dict(opt)})
        opt.ipu_state_is_dirty = False

    def _write_optimizer_state(self) -> None:
        opt = self._optimizer
        if not isinstance(opt, optim.Optimizer) or not opt.ipu_state_is_dirty:
            return
        assert not opt.host_state_is_dirty, "Both host and ipu states cannot be dirty at the same time."
        if opt.has_state():
            self._device_state = to_device(opt.get_state_dict()["ipu_state"], self._user_model, self._als)
        opt.ipu_state_is_dirty = False

    def _on_device_attach(self) -> None:
        """A state the host holds goes to the device; without one the device's state is the current one."""
        opt = self._optimizer
        if not self._training or not isinstance(opt, optim.Optimizer):
            return
        if opt.has_state():
            opt.ipu_state_is_dirty = True
            self._write_optimizer_state()
        else:
            opt.host_state_is_dirty = True
            opt.ipu_state_is_dirty = False

    def _optimizer_step(self) -> None:
        assert self._optimizer is not None
        step_on_device(self._optimizer, self._optimizer_hparams, self._device_state, self._params())

    # -- running ----------------------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._options.connection_type == ConnectionType.Never:
            raise AssertionError("Trying to run a model on an offline device (ConnectionType.Never): use "
                                 "model.compile(inputs) instead of model(inputs)")
        inputs = self._binder(args, kwargs)
        compiling = not self.isCompiled()
        if compiling:
            self._compile(inputs)
        if not self._is_attached:
            self.attachToDevice()
        assert self._compiled is not None
        self._compiled.validate(inputs)
        inputs = inputs.map(lambda t: t.detach())
        if _device.synthetic_mode(self._options):
            self._synthetic = self._synthetic or _device.synthetic_generator(self._options)
            inputs = inputs.map(lambda t, gen=self._synthetic: _device.synthetic(t, gen))
        with self._tracing(compiling):
            per_micro, structure = self._execute(inputs)
        flat = _outputs.select(per_micro, OutputMode(self._options.output_mode),
                               self._options.output_return_period)
        if structure is None:
            return None
        _outputs.forbid_backward(flat)
        return _structure.rebuild(structure, iter(flat))

    def _execute(self, inputs: BoundInputs) -> tuple[_outputs.MicroOutputs, Any]:
        if self._training:
            self._write_optimizer_state()
        with _running_on_device(), self._perf_counters.recording(self._options, self.batching), \
                _device.in_compiled_modes(self._modes):
            if not self._training:
                with torch.no_grad():
                    return self._run(inputs, lambda _out, _marked: None)
            result = self._run_training(inputs)
            self._anchors.end_call()
            if isinstance(self._optimizer, optim.Optimizer):
                self._optimizer.host_state_is_dirty = True  # the device stepped: the host copy is stale
            return result

    def _run(self, inputs: BoundInputs, on_output, find_losses: bool = False) -> tuple[_outputs.MicroOutputs, Any]:
        """Run every micro-batch of the call, in [D, G, R] order, each training one on its own random stream
        (accelbatch.streams); ``on_output`` sees each raw output (and the losses marked: ``find_losses``)."""
        b = self.batching
        per_micro: _outputs.MicroOutputs = []
        structure = None
        streams = CallStreams(torch.default_generator if self._training else None, b.split)
        for d in range(b.device_iterations):
            per_g = []
            for g in range(b.gradient_accumulation):
                per_r = []
                for r in range(b.replication_factor):
                    streams.enter(b.micro_index(d, g, r))
                    micro = self._perf_counters.load(inputs, lambda t, d=d, g=g, r=r: b.micro_batch(t, d, g, r))
                    with self._replicas.replica(r):
                        with finding_losses() if find_losses else contextlib.nullcontext() as marked:
                            out = self._forward(micro)
                        on_output(out, marked)
                        structure = out
                        flat = self._replicas.host_copies(_structure.flatten(out))
                        per_r.append(self._perf_counters.store(flat, _outputs.to_host_dtype))
                per_g.append(per_r)
            per_micro.append(per_g)
            if self._training:
                self._end_of_iteration()
        streams.end()
        return per_micro, structure

    def _forward(self, micro: BoundInputs) -> Any:
        """One micro-batch; the first of a compilation is traced, and its placement checked (IPUs acquired
        unless ConnectionType.Never, pipeline depth) before anything is updated."""
        if self._placement is not None:
            with promoting(self._half_state, self._als.activation_hook), module_state.from_constants(self._consts):
                return self._model(*micro.args, **micro.kwargs)
        stored, self._consts = module_state.addresses(self._model), module_state.tensor_constants(self._model)
        with execution_strategy.tracing(self._options, micro) as trace, \
                promoting(self._half_state, self._als.activation_hook), refusing_broadcast(self._model, self._options):
            out = self._model(*micro.args, **micro.kwargs)
        module_state.check_addresses(stored, self._model)
        execution_strategy.check_trace(trace, out, self._options, self._training)
        self._placement = trace.placement
        return out

    def _run_training(self, inputs: BoundInputs) -> tuple[_outputs.MicroOutputs, Any]:
        """Each micro-batch backpropagates from its final loss (PopTorch's rule, see ops.final_loss). The
        first call finds it among the losses marked while the model ran; when it is one of the outputs (the
        usual case), later calls take that output without marking again."""
        self._zero_grad()

        def backward(out: Any, marked: list[torch.Tensor] | None = None) -> None:
            if marked is None:
                loss = _structure.flatten(out)[self._loss_output]
            else:
                loss = final_loss(marked)
                if self._loss_output is None:
                    self._loss_output = next((i for i, t in enumerate(_structure.flatten(out)) if t is loss), None)
            loss_scale = self._als.loss_scale(self._loss_scaling)
            if loss.requires_grad:  # scaled: the update divides it out again; frozen parameters: nothing to train
                loss.backward(torch.full_like(loss, loss_scale) if loss_scale != 1.0 or loss.dim() else None)
            self._als.observe(self._params())
            self._half.accumulate(self._params())

        return self._run(inputs, backward, find_losses=self._loss_output is None)

    def _params(self) -> list[torch.nn.Parameter]:
        assert self._optimizer is not None
        return [p for group in self._optimizer.param_groups for p in group["params"]]

    def _zero_grad(self) -> None:
        self._replicas.clear_grads()
        for p in self._params():
            p.grad = None
        self._half.clear()

    def _end_of_iteration(self) -> None:
        """Reduce the accumulated gradients over G micro-batches x R replicas and update the weights."""
        self._replicas.reduce_grads()
        b = self.batching
        reduction = self._options.Training.accumulation_and_replication_reduction_type
        scale = 1.0 / (b.gradient_accumulation * b.replication_factor) if reduction == ReductionType.Mean else 1.0
        loss_scale = self._als.loss_scale(self._loss_scaling)
        scale /= loss_scale
        if scale != 1.0:
            for p in self._params():
                if p.grad is not None:
                    p.grad.mul_(scale)
            self._half.scale_(scale)
        self._half.step(self._params(), self._optimizer, self._optimizer_step)
        self._zero_grad()
        self._anchors.record_step(loss_scale, dict(self._model.named_parameters()))
        self._als.end_step()


def trainingModel(model: torch.nn.Module | PoplarExecutor, options: Options | None = None,
                  optimizer: torch.optim.Optimizer | None = None) -> PoplarExecutor:
    """Wrap ``model`` for training; its forward returns ``(output..., loss)`` or ``loss``."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    if _device.is_wrapped(model):
        raise RuntimeError(ALREADY_WRAPPED_ERR)
    return PoplarExecutor(copy.copy(model), options, training=True, optimizer=optimizer, user_model=model)


def inferenceModel(model: torch.nn.Module | PoplarExecutor,
                   options: Options | None = None) -> PoplarExecutor:
    """Wrap ``model`` for inference (forward only, no gradient)."""
    if isinstance(model, PoplarExecutor):
        model = model._user_model
    return PoplarExecutor(copy.copy(model), options, training=False, user_model=model)


__all__ = ["PoplarExecutor", "inferenceModel", "trainingModel"]
