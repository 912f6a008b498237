"""The two loops a BatchWorld runs once per row on its block path: moving the teacher rows on, and counting
the replies to score. Written here in Python (the reference); ``accelbatch/_row_kernels.c`` is a compiled
twin with the same behaviour, built when the package is installed with a C compiler and used when present.

Both twins are tested side by side (tests/test_row_kernels.py). ``KERNELS`` says which one this process runs;
``ACCELBATCH_ROW_KERNELS=python`` in the environment picks the Python twin even when the compiled one is built.
"""

from __future__ import annotations

import os
from array import array
from itertools import compress
from operator import ge, itemgetter
from typing import Any, Callable, Sequence

Take = Callable[[int, bool], Sequence["int | None"]]
Int64s = array  # array('q'): a column of C int64s


def advance_rows(pos: Int64s, end: Int64s, first: int, rows: int, starts: Int64s, ends: Int64s, flat: list[Any],
                 answers: list[Any], take: Take, loop: bool) -> tuple[list[Any], list[Any], int]:
    """Serve each of rows ``first .. first + rows - 1`` its next example.

    A row serves flat index ``pos[slot]`` while ``pos[slot] < end[slot]``; the others start the episodes
    ``take(k, loop)`` hands them, in row order (episode ``e`` spans ``starts[e] .. ends[e] - 1``; None: nothing
    left, the row serves the padding, the last of ``flat``, and stays between episodes). ``pos`` becomes the
    served index + 1. The four columns are ``array('q')``: the compiled twin reads and writes them in place,
    with no int object per row. Returns each row's example ``flat[at]``, its answers ``answers[at]``, and how
    many rows served an example (not the padding).
    """
    pad = len(flat) - 1
    if pad < 0 or len(answers) != len(flat):
        raise ValueError("advance_rows: flat and answers need one entry per example and the padding last")
    last = first + rows
    if first < 0 or rows < 0 or last > len(pos) or last > len(end):
        raise IndexError("advance_rows: rows outside the slot columns")
    served = pos[first:last].tolist()
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
                if not 0 <= episode < len(starts):
                    raise IndexError(f"advance_rows: episode {episode} out of range")
                served[row], stops[row] = starts[episode], ends[episode]
        end[first:last] = stops
    if served and (min(served) < 0 or max(served) > pad):
        raise IndexError("advance_rows: flat index out of range")
    pos[first:last] = array("q", [at + 1 for at in served])
    if rows > 1:
        pick = itemgetter(*served)
        return list(pick(flat)), list(pick(answers)), rows - served.count(pad)
    return [flat[at] for at in served], [answers[at] for at in served], rows - served.count(pad)


def count_replies(counts: dict[Any, dict[Any, int]], replies: Sequence[Any], answers: Sequence[Any],
                  key: str) -> None:
    """``counts[answers[i]][replies[i].get(key)] += 1`` for each row ``i`` (``counts``: answers -> reply text ->
    rows)."""
    if len(replies) != len(answers):
        raise ValueError(f"count_replies: {len(replies)} replies for {len(answers)} rows of answers")
    for reply, target in zip(replies, answers):
        by_reply = counts.get(target)
        if by_reply is None:
            counts[target] = by_reply = {}
        text = reply.get(key)
        by_reply[text] = by_reply.get(text, 0) + 1


def _select() -> tuple[str, Callable[..., tuple[list[Any], list[Any], int]], Callable[..., None]]:
    if os.environ.get("ACCELBATCH_ROW_KERNELS", "").strip().lower() == "python":
        return "python", advance_rows, count_replies
    try:
        from accelbatch import _row_kernels  # type: ignore[attr-defined]
    except ImportError:
        return "python", advance_rows, count_replies
    return "compiled", _row_kernels.advance_rows, _row_kernels.count_replies


KERNELS, ADVANCE_ROWS, COUNT_REPLIES = _select()

__all__ = ["ADVANCE_ROWS", "COUNT_REPLIES", "KERNELS", "advance_rows", "count_replies"]
