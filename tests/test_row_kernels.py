"""The compiled row kernels (accelbatch/_row_kernels.c) against their Python twins (accelbatch/row_kernels.py),
and the twins against a hand-written walk of the rows. CI builds the compiled twin: there its absence fails."""

from __future__ import annotations

import os
from array import array
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


def _episodes(lengths: list[int]) -> tuple[array, array, list[str], list]:
    """starts, ends, flat (example ``e{episode}t{turn}``, then "pad") and answers (``("a{episode}",)`` per
    example, None for the padding)."""
    starts, ends, flat, answers = array("q"), array("q"), [], []
    for number, length in enumerate(lengths):
        starts.append(len(flat))
        flat.extend(f"e{number}t{turn}" for turn in range(length))
        answers.extend([(f"a{number}",)] * length)
        ends.append(len(flat))
    flat.append("pad")
    answers.append(None)
    return starts, ends, flat, answers


def _columns(size: int) -> tuple[array, array]:
    return array("q", [0] * size), array("q", [0] * size)


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
    starts, ends, flat, answers = _episodes(lengths)
    pos, end = _columns(first + rows + 2)
    cursor = _Cursor(len(lengths))
    expected = _walk(lengths, rows, steps, loop)
    for step in range(steps):
        examples, row_answers, real = twin.advance_rows(pos, end, first, rows, starts, ends, flat, answers,
                                                        cursor.take_many, loop)
        assert examples == expected[step]
        assert row_answers == [None if e == "pad" else (f"a{e[1:e.index('t')]}",) for e in examples]
        assert real == sum(e != "pad" for e in examples)
    untouched = list(range(first)) + [first + rows, first + rows + 1]
    assert [pos[i] for i in untouched] == [end[i] for i in untouched] == [0] * len(untouched)


@settings(max_examples=60, deadline=None)
@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=10), rows=st.integers(1, 7),
       steps=st.integers(1, 25), loop=st.booleans())
def test_twins_leave_the_same_columns(lengths, rows, steps, loop):
    if compiled is None:
        pytest.skip("compiled twin not built")
    starts, ends, flat, answers = _episodes(lengths)
    state = {name: (*_columns(rows), _Cursor(len(lengths))) for name in ("py", "c")}
    for _ in range(steps):
        out = {}
        for name, twin in (("py", row_kernels), ("c", compiled)):
            pos, end, cursor = state[name]
            out[name] = twin.advance_rows(pos, end, 0, rows, starts, ends, flat, answers, cursor.take_many, loop)
        assert out["py"] == out["c"]
        assert state["py"][:2] == state["c"][:2]
        assert state["py"][2].takes == state["c"][2].takes


class _OwnGet(dict):
    def get(self, key, default=None):
        return "own get"


@pytest.mark.parametrize("twin", TWINS)
def test_count_replies_counts_answers_then_text(twin):
    yes = ("yes",)
    answers = [yes, ("no",), ("yes",), None, yes]  # an equal tuple that is another object counts as the same
    replies = [Message(text="yes"), {"text": "no"}, Message(), _OwnGet(text="x"), Message(text="yes")]
    counts: dict = {}
    twin.count_replies(counts, replies, answers, "text")
    twin.count_replies(counts, replies[:1], [yes], "text")
    expected = Counter([(("yes",), "yes"), (("no",), "no"), (("yes",), None), (None, "own get"), (("yes",), "yes"),
                        (("yes",), "yes")])
    assert {(a, t): n for a, inner in counts.items() for t, n in inner.items()} == dict(expected)


@pytest.mark.parametrize("twin", TWINS)
def test_bad_input_is_refused(twin):
    starts, ends, flat, answers = _episodes([2])
    with pytest.raises(ValueError, match="take\\(1\\) returned 0 episodes"):
        twin.advance_rows(*_columns(1), 0, 1, starts, ends, flat, answers, lambda k, loop: [], True)
    with pytest.raises(ValueError, match="one entry per example"):
        twin.advance_rows(*_columns(1), 0, 1, starts, ends, flat, answers[:-1], lambda k, loop: [0], True)
    with pytest.raises(ValueError, match="2 replies for 1 rows of answers"):
        twin.count_replies({}, [Message(), Message()], [None], "text")
    with pytest.raises(IndexError, match="episode 5 out of range"):
        twin.advance_rows(*_columns(1), 0, 1, starts, ends, flat, answers, lambda k, loop: [5], True)
    with pytest.raises(IndexError, match="rows outside the slot columns"):
        twin.advance_rows(*_columns(1), 0, 2, starts, ends, flat, answers, lambda k, loop: [0, 0], True)
    pos, end = _columns(1)
    pos[0], end[0] = 7, 9  # a position past the examples
    with pytest.raises(IndexError, match="out of range"):
        twin.advance_rows(pos, end, 0, 1, starts, ends, flat, answers, lambda k, loop: [], True)


def test_compiled_twin_refuses_columns_that_are_not_int64_arrays():
    if compiled is None:
        pytest.skip("compiled twin not built")
    starts, ends, flat, answers = _episodes([2])
    with pytest.raises(TypeError, match="pos must be a writable array\\('q'\\)"):
        compiled.advance_rows([0], array("q", [0]), 0, 1, starts, ends, flat, answers, lambda k, loop: [0], True)
    with pytest.raises(TypeError, match="starts must be an array\\('q'\\)"):
        compiled.advance_rows(*_columns(1), 0, 1, array("i", [0]), ends, flat, answers, lambda k, loop: [0], True)


def test_compiled_twin_refuses_a_take_that_changes_the_examples():
    if compiled is None:
        pytest.skip("compiled twin not built")
    starts, ends, flat, answers = _episodes([2, 1])

    def shrinking_take(k: int, loop: bool) -> list[int]:
        flat.pop(0)
        return [0] * k

    with pytest.raises(RuntimeError, match="changed size during take"):
        compiled.advance_rows(*_columns(1), 0, 1, starts, ends, flat, answers, shrinking_take, True)
