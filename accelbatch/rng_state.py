"""RNG states as JSON data, for checkpoints: Python ``random``, NumPy's global generator, torch CPU and CUDA.

:func:`capture_rng` / :func:`restore_rng` for a whole process; :func:`random_state` /
:func:`set_random_state` for one ``random.Random`` (e.g. a MultiWorld's task choice).
"""

from __future__ import annotations

import base64
import random
from typing import Any, Mapping

import torch

from accelbatch.checkpoint import CheckpointError, first_line as _first_line


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
    states = source if source is None or isinstance(source, (Mapping, list)) else source.rng
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
