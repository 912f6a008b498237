"""Checkpoints that never run code when loaded, written atomically, refused when damaged.

Layout. ``save_checkpoint(PATH, ...)`` writes the directory ``PATH.ckpt`` (``PATH`` is the
``--model-file`` value; a path already ending in ``.ckpt`` is used as it is)::

    PATH.ckpt/
      MANIFEST.json        {"format": "accelbatch-checkpoint", "version": 1, "generation": 7,
                            "directory": "gen-000007",
                            "files": {"tensors.pt": {"sha256": ..., "bytes": ...}, "state.json": {...}}}
      gen-000007/
        tensors.pt         {"model": state_dict, "optimizer": state_dict | None}; read with
                           torch.load(weights_only=True), which refuses anything but tensors and plain
                           containers, so loading never runs code from the file
        state.json         {"opts": {...}, "plan": {...}, "state": {...}, "rng": {...} | [...] | null}

``PATH`` itself is left to :meth:`TorchAgent.save` (the best or final model, a plain torch file) so
``-mf PATH`` keeps working for evaluation, and a plain model file written by ``TorchAgent.save`` loads
with :func:`load_checkpoint` too (``Checkpoint.legacy`` is then True and only the weights are known).

Atomicity. A save stages both files in ``PATH.ckpt/.tmp-*``, fsyncs them, renames the staging directory
to a new ``gen-N`` (a fresh name, so nothing is overwritten) and then *commits* by replacing
``MANIFEST.json`` with ``os.replace`` (atomic on POSIX and Windows). Until that replace the manifest names
the previous generation, which is untouched; a crash (or exception, or SIGKILL) at any point before it
leaves the last good checkpoint readable, and after it the new one. Older generations and leftover staging
directories are removed after a successful commit. One writer per checkpoint directory (rank 0).

Integrity. The manifest holds the SHA-256 and size of each file; :func:`load_checkpoint` checks both
before reading anything and refuses a truncated, changed or missing file with a
:class:`CheckpointError` that names the file and says what to do. (The hashes catch damage and careless
edits; they are not a signature: safety against a malicious file comes from ``weights_only`` and JSON.)

JSON. ``state`` must hold JSON data only (dict with str keys, list, tuple, str, int, float, bool, None;
NumPy scalars are converted); a value that is not is named in the error. Non-finite floats are written
as Python's json writes them (``Infinity``, ``NaN``) and read back by it.

Conventions for ``state`` (what :mod:`accelbatch.run` stores): ``state["train"]`` the counters
(steps, exs, validations, best, stale, elapsed_s), ``state["data"]`` the data position from
:func:`world_position` (or a list of them, one per replica), ``state["metrics"]`` anything else.

Also here: :func:`capture_rng` / :func:`restore_rng` (Python ``random``, NumPy's global generator, torch
CPU and, when CUDA is in use, every CUDA device), the data position of worlds of :class:`FixedTeacher`
(:func:`world_position` / :func:`restore_world_position`), :class:`PeriodicSaver` for
``--save-every-n-secs``, and :class:`StopSignals`, which turns SIGINT/SIGTERM into a flag the run loop
checks between world steps (save, then exit cleanly).
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, Sequence

import torch

FORMAT = "accelbatch-checkpoint"
VERSION = 1
SUFFIX = ".ckpt"
MANIFEST = "MANIFEST.json"
TENSORS = "tensors.pt"
STATE = "state.json"
POSITION_VERSION = 1
_GEN = re.compile(r"^gen-(\d+)$")

__all__ = [
    "Checkpoint", "CheckpointError", "PeriodicSaver", "StopSignals", "capture_rng", "checkpoint_dir",
    "check_resumable", "find_checkpoint", "load_checkpoint", "plan_from_dict", "plan_to_dict",
    "restore_rng", "restore_world_position", "save_checkpoint", "world_position", "cursor_state",
    "restore_cursor", "teacher_position", "restore_teacher", "random_state", "set_random_state",
    "agent_conversation", "restore_agent_conversation", "resume_mismatches", "RESUME_OPTS",
]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, read or resumed from; the text names the file and what to do."""


# ------------------------------------------------------------------------------------------------------
# paths
# ------------------------------------------------------------------------------------------------------
def checkpoint_dir(path: str | os.PathLike) -> str:
    """The checkpoint directory of a ``--model-file`` value: ``PATH.ckpt`` (``PATH`` if it ends so)."""
    path = os.fspath(path)
    return path if path.rstrip("/\\").endswith(SUFFIX) else path + SUFFIX


def find_checkpoint(path: str | os.PathLike) -> str | None:
    """What :func:`load_checkpoint` would read for ``path``, or None when there is nothing to resume.

    In order: ``path`` as a checkpoint directory (with a manifest), ``path.ckpt`` (with a manifest), and
    ``path`` as a plain model file. A directory without a manifest (a first save that never finished) is
    treated as absent.
    """
    path = os.fspath(path)
    for candidate in (path, checkpoint_dir(path)):
        if os.path.isfile(os.path.join(candidate, MANIFEST)):
            return candidate
    if os.path.isfile(path):
        return path
    return None


# ------------------------------------------------------------------------------------------------------
# the checkpoint
# ------------------------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read. Tensors are on ``map_location`` (CPU by default)."""

    path: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None = None
    opts: dict[str, Any] = field(default_factory=dict)
    plan: dict[str, Any] = field(default_factory=dict)
    state: dict[str, Any] = field(default_factory=dict)
    rng: Any = None  # capture_rng() dict, a list of them (one per replica), or None
    version: int = VERSION
    generation: int = 0
    legacy: bool = False  # a plain model file from TorchAgent.save: weights only

    @property
    def data(self) -> Any:
        """The data position saved in ``state["data"]`` (None when there is none)."""
        return self.state.get("data")

    def engine_state(self) -> dict[str, Any]:
        """``{"model": ..., "optimizer": ...}`` as ``Engine.load_state_dict`` and ``TorchAgent.save`` use."""
        out: dict[str, Any] = {"model": self.model_state}
        if self.optimizer_state is not None:
            out["optimizer"] = self.optimizer_state
        return out

    def load_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the weights (and the optimizer state when both exist) in place; clear error on mismatch."""
        try:
            model.load_state_dict(self.model_state)
            if optimizer is not None and self.optimizer_state is not None:
                optimizer.load_state_dict(self.optimizer_state)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{self.path}: the checkpoint does not fit this model ({type(exc).__name__}: "
                f"{_first_line(exc)}); use the -m/--model and model options it was trained with "
                f"(saved opts: {_model_opts(self.opts)}), or start afresh without --resume") from None


def save_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module | Mapping[str, Any],
                    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
                    opts: Any = None, plan: Any = None, state: Mapping[str, Any] | None = None,
                    rng: bool | Mapping[str, Any] | Sequence[Mapping[str, Any]] = True) -> str:
    """Write a checkpoint atomically to ``checkpoint_dir(path)``; return that directory.

    ``model``/``optimizer``: modules or their state dicts. ``opts``: an :class:`Opts`, a dict or None.
    ``plan``: an :class:`ExecutionPlan`, a dict or None. ``state``: JSON data (see the module docstring).
    ``rng``: True captures this process's RNG states (:func:`capture_rng`), False stores none, a dict or
    a list of dicts (one per replica, gathered by the caller) is stored as given.
    """
    ckdir = checkpoint_dir(path)
    # everything that can fail on bad input fails here, before anything is written
    document = {
        "opts": _opts_dict(opts),
        "plan": plan_to_dict(plan),
        "state": _plain(dict(state or {}), "state"),
        "rng": capture_rng() if rng is True else (None if rng is False else _plain(rng, "rng")),
    }
    state_bytes = json.dumps(document, sort_keys=True, indent=1).encode("utf-8")
    tensors = {"model": _state_dict(model), "optimizer": _state_dict(optimizer)}

    if os.path.exists(ckdir) and not os.path.isdir(ckdir):
        raise CheckpointError(f"{ckdir}: exists and is not a directory; move it away or choose another "
                              "--model-file")
    os.makedirs(ckdir, exist_ok=True)
    generation = _next_generation(ckdir)
    staging = tempfile.mkdtemp(prefix=".tmp-", dir=ckdir)
    _write_torch(os.path.join(staging, TENSORS), tensors)
    _write_bytes(os.path.join(staging, STATE), state_bytes)
    files = {name: {"sha256": _sha256(os.path.join(staging, name)),
                    "bytes": os.path.getsize(os.path.join(staging, name))} for name in (TENSORS, STATE)}
    _fsync_dir(staging)
    gen_name = f"gen-{generation:06d}"
    os.rename(staging, os.path.join(ckdir, gen_name))
    _fsync_dir(ckdir)
    manifest = {"format": FORMAT, "version": VERSION, "generation": generation, "directory": gen_name,
                "files": files, "created_unix": round(time.time(), 3), "torch": torch.__version__}
    tmp_manifest = os.path.join(ckdir, f".tmp-{MANIFEST}-{os.getpid()}")
    _write_bytes(tmp_manifest, json.dumps(manifest, sort_keys=True, indent=1).encode("utf-8"))
    os.replace(tmp_manifest, os.path.join(ckdir, MANIFEST))  # the commit
    _fsync_dir(ckdir)
    _remove_stale(ckdir, keep=gen_name)
    return ckdir


def load_checkpoint(path: str | os.PathLike, map_location: Any = "cpu") -> Checkpoint:
    """Read a checkpoint (directory, ``PATH.ckpt``, or a plain ``TorchAgent.save`` file); verify first.

    Raises :class:`CheckpointError` when there is none, or when a file is missing, truncated, changed
    since it was saved, or not what it should be.
    """
    path = os.fspath(path)
    found = find_checkpoint(path)
    if found is None:
        if os.path.isdir(checkpoint_dir(path)) or os.path.isdir(path):
            where = path if os.path.isdir(path) else checkpoint_dir(path)
            raise CheckpointError(f"{where}: has no {MANIFEST}, so no save into it ever finished; delete "
                                  "the directory, or start afresh without --resume")
        raise CheckpointError(f"{path}: no checkpoint here (looked for {checkpoint_dir(path)}/{MANIFEST} "
                              "and a model file); check --model-file, or start without --resume")
    if os.path.isfile(found):
        return _load_plain(found, map_location)
    manifest_path = os.path.join(found, MANIFEST)
    manifest = _read_manifest(manifest_path)
    what_to_do = (f"delete {found} to start afresh (without --resume), or restore the directory from a "
                  "backup")
    gen_dir = os.path.join(found, manifest["directory"])
    for name in (TENSORS, STATE):
        expected = manifest["files"][name]
        file = os.path.join(gen_dir, name)
        if not os.path.isfile(file):
            raise CheckpointError(f"{file}: missing, though {manifest_path} lists it; {what_to_do}")
        size = os.path.getsize(file)
        if size != expected["bytes"]:
            kind = "truncated" if size < expected["bytes"] else "longer than when it was saved"
            raise CheckpointError(f"{file}: {kind} ({size} bytes, {expected['bytes']} expected); the "
                                  f"checkpoint is damaged; {what_to_do}")
        if _sha256(file) != expected["sha256"]:
            raise CheckpointError(f"{file}: SHA-256 differs from {manifest_path} (the file changed after "
                                  f"it was saved: tampered with or damaged); {what_to_do}")
    try:
        tensors = torch.load(os.path.join(gen_dir, TENSORS), map_location=map_location, weights_only=True)
        document = json.loads(_read(os.path.join(gen_dir, STATE)).decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - verified bytes that still do not load: not ours
        raise CheckpointError(f"{gen_dir}: cannot be read ({type(exc).__name__}: {_first_line(exc)}); "
                              f"{what_to_do}") from None
    if not isinstance(tensors, dict) or not isinstance(tensors.get("model"), dict) \
            or not isinstance(document, dict):
        raise CheckpointError(f"{gen_dir}: not an accelbatch checkpoint (unexpected contents); {what_to_do}")
    return Checkpoint(path=found, model_state=tensors["model"], optimizer_state=tensors.get("optimizer"),
                      opts=document.get("opts") or {}, plan=document.get("plan") or {},
                      state=document.get("state") or {}, rng=document.get("rng"),
                      version=manifest["version"], generation=manifest["generation"])


def _load_plain(path: str, map_location: Any) -> Checkpoint:
    """A model file written by TorchAgent.save: ``{"model": ..., "optimizer": ...}`` (weights only)."""
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here means the file is not ours
        raise CheckpointError(f"{path}: cannot load as a model file ({type(exc).__name__}: "
                              f"{_first_line(exc)}); delete it or point --model-file elsewhere") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise CheckpointError(f"{path}: a torch file, but not a model file written by accelbatch (no "
                              "'model' state dict); point --model-file elsewhere")
    return Checkpoint(path=path, model_state=obj["model"], optimizer_state=obj.get("optimizer"), legacy=True)


def _read_manifest(manifest_path: str) -> dict[str, Any]:
    ckdir = os.path.dirname(manifest_path)
    what_to_do = f"delete {ckdir} to start afresh (without --resume), or restore it from a backup"
    try:
        manifest = json.loads(_read(manifest_path).decode("utf-8"))
    except (ValueError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{manifest_path}: not valid JSON ({_first_line(exc)}): the manifest is "
                              f"damaged or truncated; {what_to_do}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{manifest_path}: not an accelbatch checkpoint manifest; {what_to_do}")
    version = manifest.get("version")
    if not isinstance(version, int) or version < 1:
        raise CheckpointError(f"{manifest_path}: bad format version {version!r}; {what_to_do}")
    if version > VERSION:
        raise CheckpointError(f"{manifest_path}: written by a newer accelbatch (checkpoint format version "
                              f"{version}; this one reads up to {VERSION}); upgrade accelbatch")
    files = manifest.get("files")
    directory = manifest.get("directory")
    ok = (isinstance(files, dict) and isinstance(directory, str) and _GEN.match(directory)
          and isinstance(manifest.get("generation"), int)
          and all(isinstance(files.get(n), dict) and isinstance(files[n].get("sha256"), str)
                  and isinstance(files[n].get("bytes"), int) for n in (TENSORS, STATE)))
    if not ok:
        raise CheckpointError(f"{manifest_path}: incomplete manifest (needs directory, generation and the "
                              f"sha256 and bytes of {TENSORS} and {STATE}); {what_to_do}")
    return manifest


# --- writing helpers (module functions so tests can simulate a crash in any of them) ------------------
def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _write_torch(path: str, obj: Any) -> None:
    with open(path, "wb") as handle:
        torch.save(obj, handle)
        handle.flush()
        os.fsync(handle.fileno())


def _read(path: str) -> bytes:
    with open(path, "rb") as handle:
        return handle.read()


def _fsync_dir(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. Windows cannot open a directory; its renames are durable enough
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()


def _next_generation(ckdir: str) -> int:
    """One more than any generation in the manifest or on disk (so a new name never overwrites one)."""
    latest = 0
    try:
        manifest = json.loads(_read(os.path.join(ckdir, MANIFEST)).decode("utf-8"))
        if isinstance(manifest, dict) and isinstance(manifest.get("generation"), int):
            latest = manifest["generation"]
    except (OSError, ValueError, UnicodeDecodeError):
        pass
    for name in os.listdir(ckdir):
        match = _GEN.match(name)
        if match:
            latest = max(latest, int(match.group(1)))
    return latest + 1


def _remove_stale(ckdir: str, keep: str) -> None:
    """Remove older generations and staging leftovers of crashed saves (only names this module makes)."""
    for name in os.listdir(ckdir):
        full = os.path.join(ckdir, name)
        if name == keep or not (_GEN.match(name) or name.startswith(".tmp-")):
            continue
        if os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        else:
            try:
                os.remove(full)
            except OSError:
                pass


def _state_dict(obj: Any) -> Any:
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return dict(obj)
    raise CheckpointError(f"cannot checkpoint a {type(obj).__name__}: give a module, an optimizer or a "
                          "state dict")


# ------------------------------------------------------------------------------------------------------
# opts, plan and JSON data
# ------------------------------------------------------------------------------------------------------
def _opts_dict(opts: Any) -> dict[str, Any]:
    if opts is None:
        return {}
    if dataclasses.is_dataclass(opts) and not isinstance(opts, type):
        opts = {f.name: getattr(opts, f.name) for f in dataclasses.fields(opts)}
    if not isinstance(opts, Mapping):
        raise CheckpointError(f"opts: expected Opts or a dict, got {type(opts).__name__}")
    return _plain(dict(opts), "opts")


def plan_to_dict(plan: Any) -> dict[str, Any]:
    """The fields of an :class:`ExecutionPlan` as JSON data (enums by value); a dict is checked; None: {}."""
    if plan is None:
        return {}
    if dataclasses.is_dataclass(plan) and not isinstance(plan, type):
        plan = {f.name: getattr(plan, f.name) for f in dataclasses.fields(plan)}
    if not isinstance(plan, Mapping):
        raise CheckpointError(f"plan: expected an ExecutionPlan or a dict, got {type(plan).__name__}")
    return _plain({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in plan.items()}, "plan")


def plan_from_dict(data: Mapping[str, Any]) -> Any:
    """The :class:`ExecutionPlan` of :func:`plan_to_dict`'s output (validated as any plan is)."""
    from accelbatch.plan import ExecutionPlan

    return ExecutionPlan(**dict(data))


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data, or a CheckpointError naming the first part that is not."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value
    if isinstance(value, Mapping):
        out = {}
        for key, item in value.items():
            if not isinstance(key, str):
                raise CheckpointError(f"{where}: key {key!r} is a {type(key).__name__}; checkpoint state "
                                      "is JSON, whose keys are strings")
            out[key] = _plain(item, f"{where}[{key!r}]")
        return out
    if isinstance(value, (list, tuple)):
        return [_plain(item, f"{where}[{i}]") for i, item in enumerate(value)]
    if type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "ndim", 1) == 0:
        return _plain(value.item(), where)
    raise CheckpointError(f"{where}: a {type(value).__name__} cannot go in a checkpoint's JSON state; give "
                          "str, int, float, bool, None, list or dict (tensors go in the model or optimizer "
                          "state)")


# --- resuming ---------------------------------------------------------------------------------------
# options that change the data order, the rows per step or the weights' trajectory: a resume must
# keep them, or the examples seen (and the weights) would not continue the interrupted run
RESUME_OPTS = ("task", "datatype", "seed", "batchsize", "device_iterations", "replication_factor",
               "gradient_accumulation", "numthreads", "reduction", "drop_last", "dynamic_batching",
               "dataloader_mode", "num_workers", "context_length", "include_labels")


def resume_mismatches(checkpoint: Checkpoint, opts: Any, keys: Sequence[str] = RESUME_OPTS) -> list[str]:
    """``--flag now (checkpoint: then)`` for each option in ``keys`` that differs from the checkpoint's."""
    now = _opts_dict(opts)
    out = []
    for key in keys:
        if key in checkpoint.opts and key in now and checkpoint.opts[key] != now[key]:
            out.append(f"{_flag(key)} {now[key]!r} (checkpoint: {checkpoint.opts[key]!r})")
    return out


def check_resumable(checkpoint: Checkpoint, opts: Any, keys: Sequence[str] = RESUME_OPTS) -> None:
    """Refuse (CheckpointError) to resume with options that would not continue the checkpointed run."""
    diffs = resume_mismatches(checkpoint, opts, keys)
    if diffs:
        raise CheckpointError(f"--resume: {checkpoint.path} was saved with other options: "
                              f"{'; '.join(diffs)}. "
                              "Resume with the checkpoint's values, or start afresh without --resume")


def _flag(name: str) -> str:
    try:
        from accelbatch.opts import Opts

        for f in dataclasses.fields(Opts):
            if f.name == name:
                return "/".join(f.metadata["flags"])
    except Exception:  # noqa: BLE001 - only for the message
        pass
    return "--" + name.replace("_", "-")


def _model_opts(opts: Mapping[str, Any]) -> str:
    keys = ("model", "embedding_size")
    found = [f"{k}={opts[k]!r}" for k in keys if k in opts]
    return ", ".join(found) or "none recorded"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


# ------------------------------------------------------------------------------------------------------
# RNG states
# ------------------------------------------------------------------------------------------------------
def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _unb64(text: str, where: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (ValueError, AttributeError):
        raise CheckpointError(f"rng: {where} is not base64 text; the checkpoint's state.json is "
                              "damaged") from None


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
        raise CheckpointError(f"rng: bad Python random state ({_first_line(exc)})") from None


def capture_rng() -> dict[str, Any]:
    """This process's RNG states as JSON data: Python ``random``, NumPy's global generator, torch CPU,
    and each CUDA device when CUDA has been initialised in this process (the run uses it)."""
    out: dict[str, Any] = {"python": random_state()}
    try:
        import numpy as np
    except ImportError:  # pragma: no cover - numpy is a dependency, but the checkpoint does not need it
        np = None
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        out["numpy"] = {"kind": str(kind), "keys": _b64(np.asarray(keys, dtype="<u4").tobytes()),
                        "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    out["torch"] = _b64(torch.get_rng_state().numpy().tobytes())
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = [_b64(s.cpu().numpy().tobytes()) for s in torch.cuda.get_rng_state_all()]
    return out


def restore_rng(source: Any, rank: int = 0) -> bool:
    """Set the RNG states from a :class:`Checkpoint`, a :func:`capture_rng` dict, or a list of them (one
    per replica: ``rank`` picks). Returns False when there is nothing to restore (legacy checkpoint)."""
    states = source.rng if isinstance(source, Checkpoint) else source
    if states is None:
        return False
    if isinstance(states, list):
        if not 0 <= rank < len(states):
            raise CheckpointError(f"rng: the checkpoint has RNG states for {len(states)} replicas, not for "
                                  f"rank {rank}; resume with the same --replication-factor")
        states = states[rank]
    if not isinstance(states, Mapping):
        raise CheckpointError(f"rng: expected a dict of RNG states, got {type(states).__name__}")
    if "python" in states:
        set_random_state(None, states["python"])
    if "numpy" in states:
        import numpy as np

        data = states["numpy"]
        try:
            keys = np.frombuffer(_unb64(data["keys"], "numpy keys"), dtype="<u4").astype(np.uint32)
            np.random.set_state((data["kind"], keys, int(data["pos"]), int(data["has_gauss"]),
                                 float(data["cached_gaussian"])))
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"rng: bad NumPy state ({_first_line(exc)})") from None
    if "torch" in states:
        torch.set_rng_state(_bytes_tensor(_unb64(states["torch"], "torch")))
    if states.get("cuda") and torch.cuda.is_available():
        for device, text in enumerate(states["cuda"][:torch.cuda.device_count()]):
            torch.cuda.set_rng_state(_bytes_tensor(_unb64(text, "cuda")), device)
    return True


def _bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).clone()


# ------------------------------------------------------------------------------------------------------
# data position of worlds of FixedTeacher clones
# ------------------------------------------------------------------------------------------------------
def _order_digest(order: Sequence[int]) -> str:
    return hashlib.sha256(",".join(map(str, order)).encode("ascii")).hexdigest()[:16]


def cursor_state(cursor: Any) -> dict[str, Any]:
    """An EpisodeCursor's (or SharedEpisodeCursor's) position as JSON data.

    The order of an epoch is not stored (it is a function of seed and epoch); its digest is, so a
    restore into data of another order (other file, shard or seed) is refused instead of silently
    serving other examples.
    """
    return {"num_episodes": int(cursor.num_episodes), "shuffle": bool(cursor.shuffle),
            "seed": int(cursor.seed), "epoch": int(cursor.epoch), "next_index": int(cursor.next_index),
            "order_sha256": _order_digest(cursor.order)}


def restore_cursor(cursor: Any, state: Mapping[str, Any]) -> None:
    """Put a cursor at a position from :func:`cursor_state` (after checking it is the same data)."""
    for key in ("num_episodes", "shuffle", "seed"):
        if getattr(cursor, key) != state[key]:
            raise CheckpointError(
                f"data position: the checkpoint's episode cursor has {key}={state[key]!r}, this run's has "
                f"{getattr(cursor, key)!r}; resume with the same task data, --seed and "
                "--replication-factor, or start afresh without --resume")
    epoch, next_index = int(state["epoch"]), int(state["next_index"])
    if not 0 <= next_index <= cursor.num_episodes or epoch < 0:
        raise CheckpointError(f"data position: bad cursor position (epoch {epoch}, index {next_index} of "
                              f"{cursor.num_episodes})")
    if hasattr(cursor, "seek"):  # the method proposed in /tmp/ckpt_patches/teachers.diff
        cursor.seek(epoch, next_index)
    elif hasattr(cursor, "_new_order"):  # EpisodeCursor
        with cursor.lock:
            cursor.epoch = epoch
            cursor._new_order()
            cursor.next_index = next_index
    else:  # hogwild's SharedEpisodeCursor (values in shared memory)
        with cursor.lock:
            cursor._epoch.value = epoch
            cursor._next.value = next_index
    if _order_digest(cursor.order) != state["order_sha256"]:
        raise CheckpointError("data position: this run shuffles the episodes in another order than the "
                              "checkpointed run (other data or code version); start afresh without --resume")


def teacher_position(teacher: Any) -> list[int] | None:
    """``[episode index, next entry]`` of the episode a FixedTeacher clone is in the middle of, or None."""
    if hasattr(teacher, "position"):
        pos = teacher.position()
        return None if pos is None else [int(pos[0]), int(pos[1])]
    episode, entry = getattr(teacher, "_episode", None), int(getattr(teacher, "_entry", 0))
    if episode is None or entry >= len(episode):
        return None
    index = getattr(teacher, "_episode_index", None)
    if index is None:  # before the teachers.diff patch: find the episode by identity
        index = next((i for i, ep in enumerate(teacher.episodes) if ep is episode), None)
        if index is None:
            raise CheckpointError(f"data position: {type(teacher).__name__}'s current episode is not in its "
                                  "episode list")
    return [int(index), entry]


def restore_teacher(teacher: Any, position: Sequence[int] | None) -> None:
    """Put a FixedTeacher clone back in the middle of an episode (or between episodes when None)."""
    if position is not None:
        index, entry = int(position[0]), int(position[1])
        if not (0 <= index < len(teacher.episodes) and 0 <= entry < len(teacher.episodes[index])):
            raise CheckpointError(f"data position: episode {index}, entry {entry} does not exist in "
                                  f"{type(teacher).__name__}'s data ({len(teacher.episodes)} episodes); "
                                  "resume with the same data, or start afresh without --resume")
        position = (index, entry)
    if hasattr(teacher, "restore"):
        teacher.restore(position)
        return
    if position is None:
        teacher._episode, teacher._entry = None, 0
    else:
        teacher._episode, teacher._entry = teacher.episodes[position[0]], position[1]
        if hasattr(teacher, "_episode_index"):
            teacher._episode_index = position[0]
    teacher._last, teacher._done = None, False


def agent_conversation(agent: Any) -> dict[str, Any] | None:
    """A model agent clone's conversation state (TorchAgent's history of the episode in progress)."""
    if hasattr(agent, "conversation_state"):
        return agent.conversation_state()
    history = getattr(agent, "history", None)
    if history is None or not hasattr(history, "turns"):
        return None
    return {"turns": list(history.turns), "last_label": getattr(agent, "_last_label", None),
            "previous_done": bool(getattr(agent, "_previous_done", True))}


def restore_agent_conversation(agent: Any, state: Mapping[str, Any] | None) -> None:
    if state is None:
        return
    if hasattr(agent, "restore_conversation"):
        agent.restore_conversation(state)
        return
    agent.history.turns = list(state["turns"])
    agent._last_label = state["last_label"]
    agent._previous_done = bool(state["previous_done"])


def _walk(world: Any) -> Iterator[tuple[str, Any]]:
    """The parts of a world that hold a data position, in a deterministic order.

    Yields ("teacher", FixedTeacher), ("agent", model agent clone), ("multi", MultiWorld),
    ("loader", a world with its own ``data_position`` / ``restore_data_position``, e.g. a LoaderWorld task
    of a MultiWorld), ("unsupported", reason).
    """
    from accelbatch.teachers import FixedTeacher
    from accelbatch.worlds import BatchWorld, DialogPartnerWorld, MultiWorld

    if isinstance(world, BatchWorld):
        yield from _walk(world.world)  # the original (its teacher does not act, but shares the cursor)
        for row in world.worlds:
            yield from _walk(row)
    elif isinstance(world, MultiWorld):
        yield ("multi", world)
        for sub in world.worlds:
            yield from _walk(sub)
    elif isinstance(world, DialogPartnerWorld):
        teacher = world.get_task_agent()
        if isinstance(teacher, FixedTeacher):
            yield ("teacher", teacher)
        else:
            yield ("unsupported", f"{type(teacher).__name__} is not a FixedTeacher")
        yield ("agent", world.get_model_agent())
    elif hasattr(world, "data_position") and hasattr(world, "restore_data_position"):
        yield ("loader", world)
    else:
        yield ("unsupported", f"{type(world).__name__} has no data position yet")


def world_position(world: Any) -> dict[str, Any]:
    """The data position of a training world as JSON data, taken between world steps.

    Holds each shared episode cursor (epoch and next index), each teacher clone's episode in progress
    (``[episode index, next entry]`` or None), each model agent clone's conversation history, each
    MultiWorld's task choice and RNG, and ``total_exs``. A LoaderWorld gives its own
    (``LoaderWorld.data_position``), and so does a HogwildWorld (``HogwildWorld.data_position``: it drains
    the queued parleys, then holds the shared cursors and each process's world position). A MultiWorld
    whose tasks are LoaderWorlds (``-t A,B`` through the data loader) holds their positions under
    ``"loaders"``, in task order, next to its own task choice and RNG under ``"multi"``. Worlds with no
    position are listed under ``"unsupported"``: :func:`restore_world_position` refuses them.
    """
    if hasattr(world, "data_position"):  # a LoaderWorld: its loader's position (accelbatch.loader_world)
        return {"version": POSITION_VERSION, "world": type(world).__name__, **world.data_position()}
    cursors: list[Any] = []
    teachers, agents, multi, loaders, unsupported = [], [], [], [], []
    seen_agents: set[int] = set()
    for kind, part in _walk(world):
        if kind == "teacher":
            index = next((i for i, c in enumerate(cursors) if c is part.cursor), None)
            if index is None:
                cursors.append(part.cursor)
                index = len(cursors) - 1
            teachers.append({"cursor": index, "episode": teacher_position(part)})
        elif kind == "agent":
            if id(part) not in seen_agents:
                seen_agents.add(id(part))
                agents.append(agent_conversation(part))
        elif kind == "multi":
            last = part.worlds[part.current].get_acts()[0]
            multi.append({"current": part.current, "rng": random_state(part.rng),
                          "in_episode": bool(last and not last.get("episode_done", True))})
        elif kind == "loader":
            loaders.append({"world": type(part).__name__, **part.data_position()})
            unsupported.extend(loaders[-1].get("unsupported") or [])
        else:
            unsupported.append(part)
    return {"version": POSITION_VERSION, "world": type(world).__name__,
            "total_exs": int(world.get_total_exs()), "cursors": [cursor_state(c) for c in cursors],
            "teachers": teachers, "agents": agents, "multi": multi, "loaders": loaders,
            "unsupported": unsupported}


def restore_world_position(world: Any, position: Mapping[str, Any]) -> None:
    """Put a freshly built world (same options) at a position from :func:`world_position`."""
    if position.get("version") != POSITION_VERSION:
        raise CheckpointError(f"data position: version {position.get('version')!r} is not "
                              f"{POSITION_VERSION}; start afresh without --resume")
    if position.get("unsupported"):
        raise CheckpointError("data position: the checkpointed world cannot be resumed exactly ("
                              + "; ".join(position["unsupported"]) + "); start afresh without --resume")
    if hasattr(world, "restore_data_position"):  # a LoaderWorld or a HogwildWorld
        return world.restore_data_position(dict(position))
    if position.get("hogwild") is not None:
        raise CheckpointError(f"data position: the checkpoint was taken with --numthreads "
                              f"{position['hogwild'].get('numthreads')} (hogwild), this run builds a "
                              f"{type(world).__name__}; resume with the same --numthreads, or start afresh "
                              "without --resume")
    parts = list(_walk(world))
    reasons = [p for k, p in parts if k == "unsupported"]
    if reasons:
        raise CheckpointError("data position: this world cannot be resumed exactly (" + "; ".join(reasons)
                              + ")")
    teachers = [p for k, p in parts if k == "teacher"]
    agents: list[Any] = []
    for kind, part in parts:
        if kind == "agent" and all(part is not a for a in agents):
            agents.append(part)
    multis = [p for k, p in parts if k == "multi"]
    loaders = [p for k, p in parts if k == "loader"]
    saved_loaders = position.get("loaders") or []
    counts = {"teacher clones": (len(teachers), len(position["teachers"])),
              "model agent clones": (len(agents), len(position["agents"])),
              "multi-task worlds": (len(multis), len(position["multi"])),
              "data-loader task worlds": (len(loaders), len(saved_loaders))}
    for what, (now, saved) in counts.items():
        if now != saved:
            raise CheckpointError(f"data position: the checkpoint has {saved} {what}, this world {now}; "
                                  "resume with the same --batchsize, -di, -ga, -rf and -t, or start afresh "
                                  "without --resume")
    cursors: list[Any] = []
    for teacher, saved in zip(teachers, position["teachers"]):
        index = saved["cursor"]
        if index == len(cursors):
            cursors.append(teacher.cursor)
            restore_cursor(teacher.cursor, position["cursors"][index])
        elif index > len(cursors) or cursors[index] is not teacher.cursor:
            raise CheckpointError("data position: the teachers share their cursors differently than in the "
                                  "checkpointed run; resume with the same options")
        restore_teacher(teacher, saved["episode"])
    for agent, saved in zip(agents, position["agents"]):
        restore_agent_conversation(agent, saved)
    for loader, saved in zip(loaders, saved_loaders):
        loader.restore_data_position(dict(saved))
    for multi, saved in zip(multis, position["multi"]):
        multi.current = int(saved["current"])
        set_random_state(multi.rng, saved["rng"])
        if saved["in_episode"]:
            # MultiWorld.parley_init keeps the task while the last teacher act has episode_done False
            from accelbatch.messages import Message

            multi.worlds[multi.current].get_acts()[0] = Message(episode_done=False)
    if hasattr(world, "total_exs"):
        world.total_exs = int(position["total_exs"])


# ------------------------------------------------------------------------------------------------------
# when to save
# ------------------------------------------------------------------------------------------------------
class PeriodicSaver:
    """``--save-every-n-secs``: :meth:`due` is True once per period (and then the period restarts).

    ``every_n_secs <= 0`` turns it off (never due). ``clock`` is injectable for tests. Call :meth:`mark`
    after a save made for another reason (end of training, a signal) to restart the period.
    """

    def __init__(self, every_n_secs: float, clock: Callable[[], float] = time.monotonic):
        self.every_n_secs = float(every_n_secs)
        self.clock = clock
        self.last = clock()

    @property
    def enabled(self) -> bool:
        return self.every_n_secs > 0 and not math.isinf(self.every_n_secs)

    def due(self) -> bool:
        if not self.enabled:
            return False
        now = self.clock()
        if now - self.last >= self.every_n_secs:
            self.last = now
            return True
        return False

    def mark(self) -> None:
        self.last = self.clock()


class StopSignals:
    """Turn SIGINT/SIGTERM into a flag checked between world steps (then save and exit cleanly).

    ``with StopSignals() as stop: ... if stop.requested: save; break``. A second signal of the same
    run raises KeyboardInterrupt at once (so a hung save can still be interrupted). The previous
    handlers come back on exit. Outside the main thread (where handlers cannot be set) it does nothing.
    """

    def __init__(self, signals: Sequence[int] = (signal.SIGINT, signal.SIGTERM)):
        self.signals = tuple(signals)
        self.requested: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signum
        print(f"accelbatch: {signal.Signals(signum).name} received: saving a checkpoint after this step, "
              "then stopping (send it again to stop at once)", file=sys.stderr, flush=True)

    @property
    def name(self) -> str | None:
        return None if self.requested is None else signal.Signals(self.requested).name

    def __enter__(self) -> "StopSignals":
        for sig in self.signals:
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread
                pass
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()
