"""The compiled row kernels (accelbatch/_row_kernels.c) against their Python twins (accelbatch/row_kernels.py),
and the twins against a hand-written walk of the rows. CI builds the compiled twin: there its absence fails."""

from __future__ import annotations

import os
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch import row_kernels
from accelbatch.messages import Message

try:
    from accelbatch import _row_kernels as compiled
except ImportError:  # built with no C compiler: only the Python twin runs
    compiled = None

TWINS = [pytest.param(row_kernels, id="python"),
         pytest.param(compiled, id="compiled", marks=pytest.mark.skipif(compiled is None, reason="not built"))]


def test_ci_builds_the_compiled_twin():
    if os.environ.get("CI", "").lower() != "true":
        pytest.skip("only CI requires the compiled twin (a machine without a C compiler runs the Python one)")
    assert compiled is not None, "accelbatch._row_kernels was not built: see .venv/setup.log for the compiler error"
    assert row_kernels.KERNELS == "compiled"


class _Cursor:
    """Episodes 0, 1, 2, ... of ``count`` episodes, looping or not; records every take."""

    def __init__(self, count: int):
        self.count, self.next, self.takes = count, 0, []

    def take_many(self, k: int, loop: bool) -> list[int | None]:
        self.takes.append(k)
        out = []
        for _ in range(k):
            if self.next >= self.count and loop:
                self.next = 0
            out.append(self.next if self.next < self.count else None)
            self.next += self.next < self.count
        return out


def _episodes(lengths: list[int]) -> tuple[list[int], list[int], list[int], list[str]]:
    starts, ends, flat = [], [], []
    for number, length in enumerate(lengths):
        starts.append(len(flat))
        flat.extend(f"e{number}t{turn}" for turn in range(length))
        ends.append(len(flat))
    flat.append("pad")
    return starts, ends, list(range(len(flat) + 1)), flat


def _walk(lengths: list[int], rows: int, steps: int, loop: bool) -> list[list[str]]:
    """Each row plays its episode turn by turn; rows that finished take the next episode in row order."""
    queue, playing, out = 0, [[] for _ in range(rows)], []
    for _ in range(steps):
        served = []
        for row in range(rows):
            if not playing[row]:
                if queue >= len(lengths) and loop:
                    queue = 0
                if queue < len(lengths):
                    playing[row] = [f"e{queue}t{turn}" for turn in range(lengths[queue])]
                    queue += 1
            served.append(playing[row].pop(0) if playing[row] else "pad")
        out.append(served)
    return out


@pytest.mark.parametrize("twin", TWINS)
@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=10), rows=st.integers(1, 7),
       steps=st.integers(1, 25), loop=st.booleans(), first=st.integers(0, 3))
def test_advance_rows_serves_the_walk(twin, lengths, rows, steps, loop, first):
    starts, ends, numbers, flat = _episodes(lengths)
    pos, end = [0] * (first + rows + 2), [0] * (first + rows + 2)
    cursor = _Cursor(len(lengths))
    expected = _walk(lengths, rows, steps, loop)
    for step in range(steps):
        examples, served, real = twin.advance_rows(pos, end, first, rows, starts, ends, numbers, flat,
                                                   cursor.take_many, loop)
        assert examples == expected[step] == [flat[i] for i in served]
        assert real == sum(e != "pad" for e in examples)
    assert pos[:first] == [0] * first and pos[first + rows:] == [0, 0]  # other slots untouched


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=10), rows=st.integers(1, 7),
       steps=st.integers(1, 25), loop=st.booleans())
def test_twins_leave_the_same_columns(lengths, rows, steps, loop):
    if compiled is None:
        pytest.skip("compiled twin not built")
    starts, ends, numbers, flat = _episodes(lengths)
    state = {name: ([0] * rows, [0] * rows, _Cursor(len(lengths))) for name in ("py", "c")}
    for _ in range(steps):
        out = {}
        for name, twin in (("py", row_kernels), ("c", compiled)):
            pos, end, cursor = state[name]
            out[name] = twin.advance_rows(pos, end, 0, rows, starts, ends, numbers, flat, cursor.take_many, loop)
        assert out["py"] == out["c"]
        assert state["py"][:2] == state["c"][:2]
        assert state["py"][2].takes == state["c"][2].takes


class _OwnGet(dict):
    def get(self, key, default=None):
        return "own get"


@pytest.mark.parametrize("twin", TWINS)
def test_count_replies_counts_answers_then_text(twin):
    answers = [("yes",), ("no",), ("yes",), None]
    replies = [Message(text="yes"), {"text": "no"}, Message(), _OwnGet(text="x"), Message(text="yes")]
    counts: dict = {}
    twin.count_replies(counts, replies, [0, 1, 2, 3, 2], answers, "text")
    twin.count_replies(counts, replies[:1], [0], answers, "text")
    expected = Counter([(("yes",), "yes"), (("no",), "no"), (("yes",), None), (None, "own get"), (("yes",), "yes"),
                        (("yes",), "yes")])
    assert {(a, t): n for a, inner in counts.items() for t, n in inner.items()} == dict(expected)


@pytest.mark.parametrize("twin", TWINS)
def test_bad_input_is_refused(twin):
    starts, ends, numbers, flat = _episodes([2])
    with pytest.raises(ValueError, match="take\\(1\\) returned 0 episodes"):
        twin.advance_rows([0], [0], 0, 1, starts, ends, numbers, flat, lambda k, loop: [], True)
    with pytest.raises(ValueError, match="numbers must be"):
        twin.advance_rows([0], [0], 0, 1, starts, ends, numbers[:-1], flat, lambda k, loop: [0], True)
    with pytest.raises(ValueError, match="2 replies for 1 served"):
        twin.count_replies({}, [Message(), Message()], [0], [None], "text")
    with pytest.raises(IndexError):
        twin.advance_rows([0], [0], 0, 1, starts, ends, numbers, flat, lambda k, loop: [5], True)
