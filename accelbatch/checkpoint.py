"""Checkpoints that never run code when loaded, written atomically, refused when damaged.

Layout. ``save_checkpoint(PATH, ...)`` writes the directory ``PATH.ckpt`` (``PATH``: the ``--model-file`` value; one
already ending in ``.ckpt`` is used as it is)::

    PATH.ckpt/
      MANIFEST.json        {"format": "accelbatch-checkpoint", "version": 1, "generation": 7,
                            "directory": "gen-000007",
                            "files": {"tensors.pt": {"sha256": ..., "bytes": ...}, "state.json": {...}}}
      gen-000007/
        tensors.pt         {"model": state_dict, "optimizer": state_dict | None, "scaler": {...} (fp16 only:
                           the loss scaler's scale and growth tracker)}; read with torch.load(weights_only=True),
                           which refuses anything but tensors and plain containers: loading never runs code
        state.json         {"opts": {...}, "plan": {...}, "state": {...}, "rng": {...} | [...] | null}

``PATH`` itself is left to :meth:`TorchAgent.save` (the best or final model, a plain torch file) so
``-mf PATH`` keeps working for evaluation, and a plain model file written by ``TorchAgent.save`` loads
with :func:`load_checkpoint` too (``Checkpoint.legacy`` is then True and only the weights are known).

Atomicity. A save stages both files in ``PATH.ckpt/.tmp-*``, fsyncs them, renames the staging directory to a
new ``gen-N`` (a fresh name, so nothing is overwritten) and then *commits* by replacing ``MANIFEST.json`` with
``os.replace`` (atomic on POSIX and Windows). Until then the manifest names the previous generation, untouched:
a crash (or exception, or SIGKILL) before it leaves the last good checkpoint readable, after it the new one. A
save the OS refuses (a full disk) is one CheckpointError, its files removed; older generations and other
leftovers go after a successful commit. One writer per checkpoint directory (rank 0).

Integrity. The manifest holds the SHA-256 and size of each file; :func:`load_checkpoint` checks both before
reading anything and refuses a truncated, changed or missing file, naming it (the hashes catch damage, not malice:
safety against a malicious file comes from ``weights_only`` and JSON). ``state`` holds JSON data only (NumPy
scalars converted; another value is named in the error; non-finite floats as Python's json writes them). What
``state`` and ``rng`` hold (each part's state_dict(), the RNG streams) is :mod:`accelbatch.state`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import enum
import errno
import hashlib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import torch

from accelbatch.task_weights import same_weights_key

FORMAT = "accelbatch-checkpoint"
VERSION = 1
SUFFIX = ".ckpt"
MANIFEST = "MANIFEST.json"
TENSORS = "tensors.pt"
STATE = "state.json"
_GEN = re.compile(r"^gen-(\d+)$")

__all__ = ["Checkpoint", "CheckpointError", "checkpoint_dir", "check_resumable", "find_checkpoint", "load_checkpoint",
           "plan_from_dict", "plan_to_dict", "save_checkpoint", "resume_mismatches", "RESUME_OPTS", "SHAPING"]


class CheckpointError(ValueError):
    """A checkpoint cannot be written, read or resumed from; the text names the file and what to do."""


# --- paths -----------------------------------------------------------------------------------------------
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
    return path if os.path.isfile(path) else None


# --- the checkpoint --------------------------------------------------------------------------------------
@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` read. Tensors are on ``map_location`` (CPU by default)."""

    path: str
    model_state: dict[str, torch.Tensor]
    optimizer_state: dict[str, Any] | None = None
    scaler_state: dict[str, Any] | None = None  # the fp16 loss scaler's (scale, growth tracker, ...)
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
        """``{"model": ..., "optimizer": ..., "scaler": ...}`` as ``Engine.load_state_dict`` and
        ``TorchAgent.save`` use (the optional parts only when saved)."""
        out = {"model": self.model_state, "optimizer": self.optimizer_state, "scaler": self.scaler_state or None}
        return {key: value for key, value in out.items() if value is not None}

    def load_into(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Load the weights (and the optimizer state when both exist) in place; clear error on mismatch."""
        try:
            model.load_state_dict(self.model_state)
            if optimizer is not None and self.optimizer_state is not None:
                optimizer.load_state_dict(self.optimizer_state)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise CheckpointError(
                f"{self.path}: the checkpoint does not fit this model ({type(exc).__name__}: "
                f"{first_line(exc)}); use the -m/--model and model options it was trained with "
                f"(saved opts: {model_opts_said(self.opts)}), or start afresh without --resume") from None


def save_checkpoint(path: str | os.PathLike, *, model: torch.nn.Module | Mapping[str, Any],
                    optimizer: torch.optim.Optimizer | Mapping[str, Any] | None = None,
                    opts: Any = None, plan: Any = None, state: Mapping[str, Any] | None = None,
                    rng: Mapping[str, Any] | Sequence[Mapping[str, Any]] | None = None,
                    scaler: Mapping[str, Any] | None = None) -> str:
    """Write a checkpoint atomically to ``checkpoint_dir(path)``; return that directory. ``model``/``optimizer``:
    modules or their state dicts. ``opts``: an :class:`Opts`, a dict or None. ``plan``: an :class:`ExecutionPlan`,
    a dict or None. ``state``: JSON data (see the module docstring). ``rng``: RNG states as JSON data
    (:func:`accelbatch.state.capture_rng`, or one per replica), or None. ``scaler``: the fp16 loss scaler's
    ``state_dict()`` (numbers only), or None. The OS's refusal (a full disk) is a one-line CheckpointError."""
    ckdir = checkpoint_dir(path)
    # everything that can fail on bad input fails here, before anything is written
    document = {"opts": _opts_dict(opts), "plan": plan_to_dict(plan), "state": _plain(dict(state or {}), "state"),
                "rng": None if rng is None else _plain(rng, "rng")}
    state_bytes = json.dumps(document, sort_keys=True, indent=1).encode("utf-8")
    tensors = {"model": _state_dict(model), "optimizer": _state_dict(optimizer)}
    if scaler:
        tensors["scaler"] = _plain(dict(scaler), "scaler")

    if os.path.exists(ckdir) and not os.path.isdir(ckdir):
        raise CheckpointError(f"{ckdir}: exists and is not a folder; move it away or choose another -mf/--model-file")
    staging, gen_path, tmp_manifest = "", "", os.path.join(ckdir, f".tmp-{MANIFEST}-{os.getpid()}")
    try:  # from the folder on: a folder made read-only mid-run is the same one-line error as a full disk
        os.makedirs(ckdir, exist_ok=True)
        generation = _next_generation(ckdir)
        gen_name = f"gen-{generation:06d}"
        gen_path = os.path.join(ckdir, gen_name)  # a fresh name: removing it on failure removes only ours
        os.makedirs(staging := os.path.join(ckdir, f".tmp-{gen_name}-{os.getpid()}"), exist_ok=True)  # umask's mode
        write_torch(os.path.join(staging, TENSORS), tensors)
        _write_bytes(os.path.join(staging, STATE), state_bytes)
        files = {name: {"sha256": sha256_of(os.path.join(staging, name)),
                        "bytes": os.path.getsize(os.path.join(staging, name))} for name in (TENSORS, STATE)}
        _fsync_dir(staging)
        os.rename(staging, gen_path)
        _fsync_dir(ckdir)
        manifest = {"format": FORMAT, "version": VERSION, "generation": generation, "directory": gen_name,
                    "files": files, "created_unix": round(time.time(), 3), "torch": torch.__version__}
        _write_bytes(tmp_manifest, json.dumps(manifest, sort_keys=True, indent=1).encode("utf-8"))
        os.replace(tmp_manifest, os.path.join(ckdir, MANIFEST))  # the commit
    except (OSError, RuntimeError) as exc:  # all uncommitted: the manifest names the last good generation
        raise write_error(ckdir, exc, staging, gen_path, tmp_manifest)
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
    what_to_do = f"delete {found} to start afresh (without --resume), or restore the directory from a backup"
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
        if sha256_of(file) != expected["sha256"]:
            raise CheckpointError(f"{file}: SHA-256 differs from {manifest_path} (the file changed after "
                                  f"it was saved: tampered with or damaged); {what_to_do}")
    try:
        tensors = torch.load(os.path.join(gen_dir, TENSORS), map_location=map_location, weights_only=True)
        document = json.loads(_read(os.path.join(gen_dir, STATE)).decode("utf-8"))
    except Exception as exc:  # noqa: BLE001 - verified bytes that still do not load: not ours
        raise CheckpointError(f"{gen_dir}: cannot be read ({type(exc).__name__}: {first_line(exc)}); "
                              f"{what_to_do}") from None
    if not isinstance(tensors, dict) or not isinstance(tensors.get("model"), dict) \
            or not isinstance(document, dict):
        raise CheckpointError(f"{gen_dir}: not an accelbatch checkpoint (unexpected contents); {what_to_do}")
    return Checkpoint(path=found, model_state=tensors["model"], optimizer_state=tensors.get("optimizer"),
                      scaler_state=tensors.get("scaler"), opts=document.get("opts") or {},
                      plan=document.get("plan") or {}, state=document.get("state") or {}, rng=document.get("rng"),
                      version=manifest["version"], generation=manifest["generation"])


def _load_plain(path: str, map_location: Any) -> Checkpoint:
    """A model file written by TorchAgent.save: ``{"model": ..., "optimizer": ...}`` (weights only)."""
    try:
        obj = torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure here means the file is not ours
        raise CheckpointError(f"{path}: cannot load as a model file ({type(exc).__name__}: "
                              f"{first_line(exc)}); delete it or point --model-file elsewhere") from None
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
        raise CheckpointError(f"{manifest_path}: not valid JSON ({first_line(exc)}): the manifest is "
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
def write_json_file(path: str, data: Any) -> None:
    """Write ``data`` as JSON to ``path`` whole or not at all (a temporary file, synced, then renamed): the
    small files kept beside a model file (PATH.opt, PATH.trainstats)."""
    path = os.path.realpath(path)  # a link's target is written, not the link replaced by a file (target stale)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        _write_bytes(tmp, json.dumps(data).encode("utf-8"))
        os.replace(tmp, path)
    except OSError as exc:
        raise write_error(path, exc, tmp)


def read_json_file(path: str) -> Any:
    """The JSON in ``path``, a file kept beside a model file; None when there is none. One that cannot be read
    (edited by hand, cut short) is an error naming it: going on without it would drop what it keeps."""
    try:
        with open(path, encoding="utf-8") as handle:
            return json.load(handle)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as err:
        raise unreadable_sidecar(path, str(err)) from None


def write_error(path: str, exc: BaseException, *uncommitted: str) -> BaseException:
    """For the OS's refusal to write ``path`` (an OSError with an errno, or torch's zip writer's RuntimeError
    raised while handling one): a one-line CheckpointError naming it, once this write's files ``uncommitted``
    are removed. Else ``exc`` itself, its files left as a crash leaves them (the next save removes them)."""
    err = exc if isinstance(exc, OSError) else exc.__context__
    if not isinstance(err, OSError) or err.errno is None:
        return exc
    for left in uncommitted:
        _remove(left)
    error = CheckpointError(f"{path}: no space left on the device to write it; free space, or choose another "
                            "-mf/--model-file" if err.errno in (errno.ENOSPC, errno.EDQUOT) else
                            f"{path}: cannot be written ({err.strerror}): it passes the largest file this process "
                            "may write (`ulimit -f`); raise that limit" if err.errno == errno.EFBIG else
                            f"{path}: cannot be written ({err.strerror}); choose another -mf/--model-file")
    error.__suppress_context__ = True  # one line: the message names the condition
    return error


def unreadable_sidecar(path: str, why: str) -> CheckpointError:
    return CheckpointError(f"{path}: cannot be read ({why}); accelbatch writes this file beside the model file: "
                           "restore it, or delete it to go on without what it keeps")


def has_saved_position(model_file: str) -> bool:
    """Whether ``-mf model_file`` has a checkpoint with a run's position to resume (a ``PATH.ckpt`` directory),
    not only the weights in PATH."""
    found = find_checkpoint(model_file)
    return found is not None and os.path.isdir(found)


def _write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def write_torch(path: str, obj: Any) -> None:
    """torch.save through Python's file, synced: a full disk is an OSError that :func:`write_error` names."""
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
    with contextlib.suppress(OSError):
        os.fsync(fd)
    os.close(fd)


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


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
        if name != keep and (_GEN.match(name) or name.startswith(".tmp-")):
            _remove(full)


def _remove(path: str) -> None:
    """Remove a file or a directory tree, if there (what cannot be removed stays)."""
    if os.path.isdir(path):
        shutil.rmtree(path, ignore_errors=True)
    elif path:
        with contextlib.suppress(OSError):
            os.remove(path)


def _state_dict(obj: Any) -> Any:
    if obj is None:
        return None
    if hasattr(obj, "state_dict"):
        return obj.state_dict()
    if isinstance(obj, Mapping):
        return dict(obj)
    raise CheckpointError(f"cannot checkpoint a {type(obj).__name__}: give a module, an optimizer or a "
                          "state dict")


# --- opts, plan and JSON data ----------------------------------------------------------------------------
def _fields(obj: Any, where: str, expected: str) -> dict[str, Any]:
    """A dataclass instance's fields, or a mapping, as a dict; None: {}."""
    if obj is None:
        return {}
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    if not isinstance(obj, Mapping):
        raise CheckpointError(f"{where}: expected {expected} or a dict, got {type(obj).__name__}")
    return dict(obj)


def _opts_dict(opts: Any) -> dict[str, Any]:
    return _plain(_fields(opts, "opts", "Opts"), "opts")


def plan_to_dict(plan: Any) -> dict[str, Any]:
    """The fields of an :class:`ExecutionPlan` as JSON data (enums by value); a dict is checked; None: {}."""
    fields_ = _fields(plan, "plan", "an ExecutionPlan")
    return _plain({k: (v.value if isinstance(v, enum.Enum) else v) for k, v in fields_.items()}, "plan")


def plan_from_dict(data: Mapping[str, Any]) -> Any:
    """The :class:`ExecutionPlan` of :func:`plan_to_dict`'s output (validated as any plan is)."""
    from accelbatch.plan import ExecutionPlan

    return ExecutionPlan(**dict(data))


def _plain(value: Any, where: str) -> Any:
    """``value`` as JSON data, or a CheckpointError naming the first part that is not."""
    if value is None or isinstance(value, (str, bool, int, float)):
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
SHAPING = ("model", "embedding_size", "text_truncate", "label_truncate")  # what a model's weights depend on
# the model's options, and those that change the data order, the rows per step or the weights' trajectory: a
# resume must keep them, or the weights (and examples seen) would not continue the interrupted run. Not the
# performance options (--num-workers, --dataloader-mode, streaming): the resume checks their front end instead
# (state.position_kind)
RESUME_OPTS = SHAPING + ("task", "multitask_weights", "datatype", "seed", "batchsize", "device_iterations",
                         "replication_factor", "gradient_accumulation", "numthreads", "reduction", "loss_normalization",
                         "drop_last", "dynamic_batching", "context_length", "include_labels", "optimizer",
                         "ipu_input_replica_grouping", "ipu_input_replica_grouping_type")


def _position_value(key: str, value: Any) -> Any:
    """An option's value as the data position sees it: a streamed split is the split; -mtw, its weights."""
    return same_weights_key(value) if key == "multitask_weights" else \
        value.replace(":stream", "") if key == "datatype" and isinstance(value, str) else value


def resume_mismatches(checkpoint: Checkpoint, opts: Any, keys: Sequence[str] = RESUME_OPTS) -> list[str]:
    """``--flag now (checkpoint: then)`` for each option in ``keys`` that differs from the checkpoint's."""
    now, then = _opts_dict(opts), checkpoint.opts
    return [f"{_flag(key)} {now[key]!r} (checkpoint: {then[key]!r})" for key in keys
            if key in then and key in now and _position_value(key, then[key]) != _position_value(key, now[key])]


def check_resumable(checkpoint: Checkpoint, opts: Any, keys: Sequence[str] = RESUME_OPTS) -> None:
    """Refuse (CheckpointError) to resume with options that would not continue the checkpointed run."""
    diffs = resume_mismatches(checkpoint, opts, keys)
    if diffs:
        raise CheckpointError(f"--resume: {checkpoint.path} was saved with other options: {'; '.join(diffs)}. "
                              "Resume with the checkpoint's values, or start afresh without --resume")


def _flag(name: str) -> str:
    from accelbatch.opts import Opts

    flags = next((f.metadata["flags"] for f in dataclasses.fields(Opts) if f.name == name), None)
    return "/".join(flags) if flags else "--" + name.replace("_", "-")


def model_opts_said(opts: Mapping[str, Any]) -> str:
    """The checkpoint's model options ``opts`` as text for a message."""
    return ", ".join(f"{k}={opts[k]!r}" for k in SHAPING if k in opts) or "none recorded"


def first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
