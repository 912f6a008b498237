"""The two loops a BatchWorld runs once per row on its block path: moving the teacher rows on, and counting
the replies to score. Written here in Python (the reference); ``accelbatch/_row_kernels.c`` is a compiled
twin with the same behaviour, built when the package is installed with a C compiler and used when present.

Both twins are tested side by side (tests/test_row_kernels.py). ``KERNELS`` says which one this process runs;
``ACCELBATCH_ROW_KERNELS=python`` in the environment picks the Python twin even when the compiled one is built.
"""

from __future__ import annotations

import os
from itertools import compress
from operator import ge, itemgetter
from typing import Any, Callable, Sequence

Take = Callable[[int, bool], Sequence["int | None"]]


def advance_rows(pos: list[int], end: list[int], first: int, rows: int, starts: list[int], ends: list[int],
                 numbers: list[int], flat: list[Any], take: Take, loop: bool) -> tuple[list[Any], list[int], int]:
    """Serve each of rows ``first .. first + rows - 1`` its next example.

    A row serves ``pos[slot]`` while ``pos[slot] < end[slot]``; the others start the episodes
    ``take(k, loop)`` hands them, in row order (None: nothing left, the row serves the padding index
    ``len(numbers) - 2``, the last of ``flat``, and stays between episodes). ``pos`` becomes served + 1.
    ``numbers[i]`` is ``i`` (the compiled twin reuses those ints instead of creating one per row).
    Returns each row's example ``flat[served]``, the served flat indices, and how many rows served an example.
    """
    pad = len(numbers) - 2
    if pad < 0 or len(flat) != pad + 1:
        raise ValueError("advance_rows: numbers must be 0 .. len(flat), flat end with the padding")
    last = first + rows
    served = pos[first:last]
    stops = end[first:last]
    starting = list(compress(range(rows), map(ge, served, stops)))
    if starting:
        taken = take(len(starting), loop)
        if len(taken) != len(starting):
            raise ValueError(f"advance_rows: take({len(starting)}) returned {len(taken)} episodes")
        for row, episode in zip(starting, taken):
            if episode is None:
                served[row] = stops[row] = pad
            else:
                served[row], stops[row] = starts[episode], ends[episode]
        end[first:last] = stops
    pos[first:last] = [at + 1 for at in served]
    examples = list(itemgetter(*served)(flat)) if rows > 1 else [flat[at] for at in served]
    return examples, served, rows - served.count(pad)


def count_replies(counts: dict[Any, dict[Any, int]], replies: Sequence[Any], served: Sequence[int],
                  answers: Sequence[Any], key: str) -> None:
    """``counts[answers[index]][reply.get(key)] += 1`` for each reply and the flat index it answers
    (``counts``: answers -> reply text -> rows)."""
    if len(replies) != len(served):
        raise ValueError(f"count_replies: {len(replies)} replies for {len(served)} served examples")
    for reply, index in zip(replies, served):
        target = answers[index]
        by_reply = counts.get(target)
        if by_reply is None:
            counts[target] = by_reply = {}
        text = reply.get(key)
        by_reply[text] = by_reply.get(text, 0) + 1


def _select() -> tuple[str, Callable[..., list[int]], Callable[..., None]]:
    if os.environ.get("ACCELBATCH_ROW_KERNELS", "").strip().lower() == "python":
        return "python", advance_rows, count_replies
    try:
        from accelbatch import _row_kernels  # type: ignore[attr-defined]
    except ImportError:
        return "python", advance_rows, count_replies
    return "compiled", _row_kernels.advance_rows, _row_kernels.count_replies


KERNELS, ADVANCE_ROWS, COUNT_REPLIES = _select()

__all__ = ["ADVANCE_ROWS", "COUNT_REPLIES", "KERNELS", "advance_rows", "count_replies"]
