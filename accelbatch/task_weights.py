"""ParlAI's ``--multitask-weights``: how often multitask training draws each task for its next episode."""

from __future__ import annotations

import math
from typing import Any, Sequence

from accelbatch.option_error import OptionError

STOCHASTIC = "stochastic"  # each task in proportion to its episodes (ParlAI's "simple concatenation")
FLAG = "-mtw/--multitask-weights"


def parse_task_weights(spec: str) -> list[float] | None:
    """The weights ``spec`` gives, in task order; None for ``stochastic``. A value that is no weight is an
    OptionError naming the option."""
    if spec.strip() == STOCHASTIC:
        return None
    try:
        weights = [float(part) for part in spec.split(",")]
    except ValueError:
        raise OptionError(f"{FLAG} {spec}: give comma-separated numbers, one per task of -t (e.g. 1,3: the second "
                          f"task drawn three times as often), or '{STOCHASTIC}' (each task in proportion to its "
                          "episodes)") from None
    if not all(math.isfinite(w) and w >= 0 for w in weights) or not any(w > 0 for w in weights):
        raise OptionError(f"{FLAG} {spec}: weights are finite numbers of 0 or more, at least one above 0")
    return weights


def task_weights(spec: str, episodes: Sequence[int]) -> tuple[float, ...]:
    """Each task's draw weight, for tasks of ``episodes`` episodes each: as ``spec`` gives them, 1 for tasks past
    the given ones (as ParlAI); () when all are equal (the uniform draw). More weights than tasks are refused."""
    given = parse_task_weights(spec)
    if given is None:
        weights = [float(n) for n in episodes]
    elif len(given) > len(episodes):
        raise OptionError(f"{FLAG} {spec}: {len(given)} weights for the {len(episodes)} tasks of -t; give one per "
                          "task, in -t's order")
    else:
        weights = given + [1.0] * (len(episodes) - len(given))
    return () if len(set(weights)) <= 1 else tuple(weights)


def same_weights_key(spec: Any) -> Any:
    """What two ``-mtw`` values that draw alike share (a resume compares them): the weights as numbers, without
    the trailing 1s that missing weights default to (``1,3.0,1`` is ``1,3``); a value that is no weights, as is."""
    try:
        weights = parse_task_weights(spec)
    except (OptionError, AttributeError):
        return spec
    if weights is None:
        return STOCHASTIC
    while weights and weights[-1] == 1.0:
        weights.pop()
    return tuple(weights)


__all__ = ["STOCHASTIC", "parse_task_weights", "same_weights_key", "task_weights"]
