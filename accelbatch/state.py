"""The state of a run, for checkpoints: every part's ``state_dict()`` collected, RNG streams, resume.

Every part with a position implements ``state_dict()`` / ``load_state_dict()`` (JSON data): the world
(which holds its teacher's feed or its loader's step, each agent clone's conversation and the examples
count; a HogwildWorld holds each process's), the engine (model and optimizer tensors), this module's RNG
streams, and the run's counters. :class:`Checkpointer` collects them from every replica (the backend's
all-gather) and rank 0 writes one checkpoint with :func:`accelbatch.checkpoint.save_checkpoint` (atomic,
SHA-256 manifest, ``weights_only`` loading); :meth:`Checkpointer.resume` puts a freshly built run back.
"""

from __future__ import annotations

import base64
import os
import random
import sys
from typing import Any, Mapping

import numpy as np
import torch

from accelbatch.agents import check_weights
from accelbatch.checkpoint import (
    CheckpointError,
    checkpoint_dir,
    find_checkpoint,
    first_line,
    load_checkpoint,
    save_checkpoint,
)
from accelbatch.model_opts import check_resumed_opts, recorded_model
from accelbatch.optimizers import state_fits, state_misfit
from accelbatch.teachers import portable_task

# --- RNG streams as JSON data ----------------------------------------------------------------------------


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, AttributeError):
        raise CheckpointError(f"rng: {where} is not base64 text; the checkpoint's state.json is damaged") from None


def random_state(rng: random.Random | None = None) -> dict[str, Any]:
    """A ``random.Random``'s state (the module's global one when None) as JSON data."""
    version, internal, gauss_next = (rng.getstate() if rng is not None else random.getstate())
    return {"version": version, "state": list(internal), "gauss_next": gauss_next}


def set_random_state(rng: random.Random | None, data: Mapping[str, Any]) -> None:
    """Set a ``random.Random`` (the global one when None) to a state from :func:`random_state`."""
    try:
        state = (int(data["version"]), tuple(int(x) for x in data["state"]), data["gauss_next"])
        (rng.setstate if rng is not None else random.setstate)(state)
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointError(f"rng: bad Python random state ({first_line(exc)})") from None


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON data: Python ``random``, NumPy's global generator, torch CPU, and
    each CUDA device when CUDA has been initialised in this process."""
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    out: dict[str, Any] = {
        "python": random_state(),
        "numpy": {"kind": str(kind), "keys": _b64(np.asarray(keys, dtype="<u4").tobytes()), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": _b64(torch.get_rng_state().numpy().tobytes()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s.cpu().numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return out


def torch_rng() -> dict[str, Any]:
    """torch's generators' states (CPU, and each CUDA device once CUDA is initialised), as
    :func:`restore_rng` takes them: a world's own stream, taken when it is built and set again when it runs, so
    that another world built in between (which seeds torch with its own --seed) leaves its training alone."""
    return {key: value for key, value in capture_rng().items() if key in ("torch", "cuda")}


def restore_rng(source: Any, rank: int = 0) -> bool:
    """Set the RNG states from a Checkpoint, a :func:`capture_rng` dict, or a list of them (one per replica:
    ``rank`` picks). Returns False when there is nothing to restore (a weights-only file)."""
    states = source if source is None or isinstance(source, (Mapping, list)) else source.rng
    if states is None:
        return False
    if isinstance(states, list):
        if not 0 <= rank < len(states):
            raise CheckpointError(f"rng: the checkpoint has RNG states for {len(states)} replicas, not for rank "
                                  f"{rank}; resume with the same --replication-factor")
        states = states[rank]
    if not isinstance(states, Mapping):
        raise CheckpointError(f"rng: expected a dict of RNG states, got {type(states).__name__}")
    if "python" in states:
        set_random_state(None, states["python"])
    if "numpy" in states:
        data = states["numpy"]
        try:
            keys = np.frombuffer(_unb64(data["keys"], "numpy keys"), dtype="<u4").astype(np.uint32)
            np.random.set_state((data["kind"], keys, int(data["pos"]), int(data["has_gauss"]),
                                 float(data["cached_gaussian"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"rng: bad NumPy state ({first_line(exc)})") from None
    if "torch" in states:
        torch.set_rng_state(_bytes_tensor(_unb64(states["torch"], "torch")))
    if states.get("cuda") and torch.cuda.is_available():
        for device, text in enumerate(states["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_bytes_tensor(_unb64(text, "cuda")), device)
    return True


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


# --- collecting and restoring the parts ------------------------------------------------------------------


FRONT_ENDS = {"loader": "the batched loader (--num-workers, --dataloader-mode, --dynamic-batching, a GPU's "
                        "prefetch)", "clones": "the world of teacher and agent clones", "other": "another world"}
FRONT_END_OPTS = ("device", "num_workers", "dataloader_mode", "dynamic_batching")


def position_kind(state: Any) -> str:
    """Which front end a world's position comes from: "loader" (a step count of the batched loader, the same
    whatever its workers, mode or streaming), "clones" (each row's step and conversation), or "other"; a
    hogwild world's is its processes'."""
    if isinstance(state, Mapping) and "processes" in state and state["processes"]:
        return position_kind(state["processes"][0])
    if isinstance(state, Mapping) and "loader" in state:
        return "loader"
    if isinstance(state, Mapping) and ("agents" in state or "rows" in state or "worlds" in state):
        return "clones"
    return "other"


def unsupported(state: Any) -> list[str]:
    """The reasons, found anywhere in a state, why a part cannot say where its data continues."""
    if isinstance(state, Mapping):
        found = [str(state["unsupported"])] if "unsupported" in state else []
        return found + [r for k, v in state.items() if k != "unsupported" for r in unsupported(v)]
    if isinstance(state, (list, tuple)):
        return [r for item in state for r in unsupported(item)]
    return []


class Checkpointer:
    """Saves and resumes a run: world, engine, RNG and counters of every replica (rank 0 writes).

    ``backend`` gives the collectives (``all_gather_object``, ``barrier``) and the topology; ``engine`` the
    model and optimizer tensors (on a real IPU read back from the device by its ``state_dict``); ``log`` the
    run's --metrics-log (a checkpoint keeps where it ended, a resume cuts it back there) and TensorBoard log
    (purged from the checkpoint's step on).
    """

    def __init__(self, opts: Any, backend: Any, plan: Any, log: Any = None):
        self.opts, self.backend, self.plan, self.log = opts, backend, plan, log
        # a resume from another folder goes on writing the same files (their paths are resumed with the run)
        self._outputs = {name: os.path.abspath(getattr(opts, name)) for name in
                         ("metrics_log", "report_json", "tensorboard_logdir") if getattr(opts, name)}

    def save(self, world: Any, engine: Any, extra: Mapping[str, Any]) -> None:
        """Every replica joins (world states and RNGs gathered); rank 0 writes; all wait for it."""
        states = self.backend.all_gather_object(world.state_dict())
        rngs = self.backend.all_gather_object(capture_rng())
        if self.backend.is_main_process():
            tensors = engine.state_dict()
            end = self.log.end() if self.log is not None else None
            if end is not None:
                extra = {**extra, "metrics_log": {"path": os.path.abspath(self.log.path), "bytes": end,
                                                  "run": self.log.run}}
            board = self.log.tensorboard.position() if self.log is not None and self.log.tensorboard else None
            if board is not None:
                extra = {**extra, "tensorboard": board}
            opts = self.opts.replace(model=_model_trained(world, self.opts),  # as a resume must build it
                                     task=portable_task(self.opts.task, self.opts.datapath), **self._outputs)
            save_checkpoint(self.opts.model_file, model=tensors["model"], optimizer=tensors.get("optimizer"),
                            opts=opts, plan=self.plan, rng=rngs, state={**extra, "data": states},
                            scaler=tensors.get("scaler"))
        self.backend.barrier()

    def resume(self, world: Any, engine: Any) -> dict[str, Any] | None:
        """--resume: the checkpoint's weights into the engine, the data position into the world, the RNG
        streams; returns the checkpoint's other state (counters), or None when there is nothing to resume."""
        path, folder = self.opts.model_file, checkpoint_dir(self.opts.model_file)
        if find_checkpoint(path) in (None, path) and os.path.isdir(folder) and \
                any(name.startswith("gen-") for name in os.listdir(folder)):
            load_checkpoint(folder)  # saves without a manifest: refused naming the folder (not passed over for
            # the weights beside it), never overwritten
        if find_checkpoint(path) is None:
            if self.backend.is_main_process():
                cut = os.path.isdir(folder) and any(name.startswith(".tmp-gen-") for name in os.listdir(folder))
                print(f"accelbatch: --resume: no checkpoint at {path}"
                      f"{' (a first save into ' + folder + ' was cut short)' if cut else ''}; starting afresh "
                      f"with this command's options (-m {self.opts.model}, -t {self.opts.task})", file=sys.stderr)
            return None
        ckpt = load_checkpoint(path)
        # other options (a model's among them) refused before any weight is loaded, and weights of another shape
        check_resumed_opts(ckpt, self.opts, _model_trained(world, self.opts))
        untold = untold_limits(self.opts, ckpt.opts)
        if untold and self.backend.is_main_process():
            print(f"accelbatch: --resume: {untold}", file=sys.stderr)
        check_weights(ckpt.model_state, engine.model.state_dict(), f"--resume: {ckpt.path}: cannot load",
                       type(engine.model).__name__)
        _check_optimizer_kind(ckpt, engine.host_optimizer(), self.opts, engine.model)
        engine.load_state_dict(ckpt.engine_state())  # after compile: the engine moves it to its device
        if ckpt.legacy:
            if self.backend.is_main_process():
                print(f"accelbatch: --resume: {ckpt.path} holds weights only; the data starts from the beginning",
                      file=sys.stderr)
            return None
        states = ckpt.data or []
        replicas, rank = self.backend.world_size, self.backend.rank
        if len(states) != replicas:
            raise CheckpointError(f"--resume: {ckpt.path} has the data position of {len(states)} replicas, this "
                                  f"run has {replicas}; use the same --replication-factor")
        then, now = position_kind(states[rank]), position_kind(world.state_dict())
        if then != now:
            saved = ", ".join(f"{k}={ckpt.opts[k]!r}" for k in FRONT_END_OPTS if k in ckpt.opts)
            raise CheckpointError(f"--resume: {ckpt.path} holds the position of {FRONT_ENDS[then]}, and this run "
                                  f"feeds the model through {FRONT_ENDS[now]}; resume with the options it was "
                                  f"saved with ({saved})")
        reasons = unsupported(states[rank])
        if reasons:
            print(f"accelbatch: --resume: the data position of this world is not restored ({'; '.join(reasons)}): "
                  "examples of the interrupted epoch may repeat", file=sys.stderr)
        else:
            try:
                world.load_state_dict(states[rank])
            except (ValueError, KeyError, TypeError) as exc:
                raise CheckpointError(f"--resume: {ckpt.path}: {first_line(exc)}") from None
        restore_rng(ckpt, rank=rank)
        if self.log is not None:
            self.log.cut_to(ckpt.state.get("metrics_log"))
            if self.log.tensorboard is not None:
                self.log.tensorboard.resume_at(ckpt.state.get("tensorboard"))
        return {k: v for k, v in ckpt.state.items() if k != "data"}


def _check_optimizer_kind(ckpt: Any, optimizer: Any, opts: Any, model: Any) -> None:
    """A checkpoint whose optimizer state is another kind's than this run's optimizer, or of other shapes than
    its parameters, cannot be continued exactly (an older accelbatch's -m bag and conv trained with SGD
    whatever -opt said): one line."""
    saved = ckpt.optimizer_state
    if optimizer is not None and saved and not state_fits(saved, optimizer):
        raise CheckpointError(f"--resume: {ckpt.path}: its optimizer state is not {type(optimizer).__name__}'s "
                              f"(-opt {opts.optimizer}), so the run cannot continue as it was; start afresh "
                              "without --resume")
    misfit = state_misfit(saved, optimizer, model) if optimizer is not None and saved else None
    if misfit:
        raise CheckpointError(f"--resume: {ckpt.path}: its {type(optimizer).__name__} state does not fit this "
                              f"model's parameters ({misfit}); start afresh without --resume")


def untold_limits(opts: Any, then: Mapping[str, Any]) -> str | None:
    """What to say when a resume's limits (-ne, -tstep, -ttim) are all their defaults but the interrupted run's
    were not: Opts built in Python take nothing from the checkpoint (the command line takes them), so the run
    would go on to another end than the one it was stopped on its way to; None otherwise."""
    limits = {"num_epochs": "-ne", "max_train_steps": "-tstep", "max_train_time": "-ttim"}
    fields = type(opts).__dataclass_fields__
    if any(getattr(opts, name) != fields[name].default for name in limits):
        return None
    differ = {name: then[name] for name in limits if name in then and then[name] != getattr(opts, name)}
    if not differ:
        return None
    said = " ".join(f"{limits[name]} {value}" for name, value in differ.items())
    given = ", ".join(f"{name}={value!r}" for name, value in differ.items())
    return (f"the interrupted run was to end at {said}; this one goes on to the defaults (Opts made in Python take "
            f"no option from the checkpoint: give {given} to end where it would have)")


def _model_trained(world: Any, opts: Any) -> str:
    """-m naming the agent that ``world`` trains (``opts.model`` for a world without one)."""
    agent = world.get_model_agent() if hasattr(world, "get_model_agent") else None
    return opts.model if agent is None else recorded_model(agent, opts)


__all__ = ["Checkpointer", "capture_rng", "position_kind", "random_state", "restore_rng", "set_random_state",
           "unsupported"]
