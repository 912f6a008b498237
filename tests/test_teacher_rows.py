"""The columnar teacher path (RowBlock, Metrics.add_rows, read-only examples) against the per-row path:
the same messages in the same order, the same positions, the same metrics."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.agents import Agent
from accelbatch.messages import FrozenMessage, Message
from accelbatch.metrics import Metrics, exact_match, f1_score
from accelbatch.opts import Opts
from accelbatch.teachers import EpisodeCursor
from accelbatch.worlds import BatchWorld, DialogPartnerWorld
from tests.helpers import RecordingAgent, list_teacher


def _opts(datatype: str, rows: int) -> Opts:
    return Opts(task="unused", model="unused", batchsize=rows, datatype=datatype, progress=False, seed=3)


def _teachers(lengths, datatype, rows):
    teacher = list_teacher(lengths)(_opts(datatype, rows))
    return teacher, [teacher.clone() for _ in range(rows)]


def _text(msg) -> str:
    return msg.get("text", "<pad>")


@settings(max_examples=40, deadline=None)
@given(lengths=st.lists(st.integers(1, 4), min_size=1, max_size=12), rows=st.integers(1, 6),
       steps=st.integers(1, 30), training=st.booleans())
def test_block_serves_what_each_clone_would(lengths, rows, steps, training):
    """Two identical teacher families: one stepped with RowBlock.act, one clone by clone. Every step gives
    the same texts; the cursors and every clone's position agree after each step."""
    datatype = "train" if training else "valid"
    teacher_a, rows_a = _teachers(lengths, datatype, rows)
    teacher_b, rows_b = _teachers(lengths, datatype, rows)
    block = teacher_a.row_block(rows_a)
    assert block is not None
    for _ in range(steps):
        examples, answers, real_rows = block.act()
        reference = [clone.act() for clone in rows_b]
        for clone in rows_b:  # observing clears what the clone served, as a parley does
            clone.observe(Message(text="x"))
        assert [_text(m) for m in examples] == [_text(m) for m in reference]
        assert answers == [None if "text" not in m else tuple(m.get("labels", m.get("eval_labels", ())))
                           for m in reference]
        assert answers.count(None) == sum("text" not in m for m in reference) == rows - real_rows
        assert (teacher_a.cursor.epoch, teacher_a.cursor.next_index) == (teacher_b.cursor.epoch,
                                                                         teacher_b.cursor.next_index)
        assert [c.position() for c in rows_a] == [c.position() for c in rows_b]
        assert [c.epoch_done() for c in rows_a] == [c.epoch_done() for c in rows_b]
    if not training:
        assert block.epoch_done() == all(c.epoch_done() for c in rows_b)


@settings(max_examples=50, deadline=None)
@given(num=st.integers(1, 9), counts=st.lists(st.integers(0, 12), min_size=1, max_size=8),
       loop=st.booleans())
def test_take_many_equals_repeated_take(num, counts, loop):
    a = EpisodeCursor(num, shuffle=True, seed=5)
    b = EpisodeCursor(num, shuffle=True, seed=5)
    for count in counts:
        assert a.take_many(count, loop) == [b.take(loop) for _ in range(count)]
        assert (a.epoch, a.next_index) == (b.epoch, b.next_index)


def _world(lengths, datatype, rows, agent_cls, per_row=False):
    """A BatchWorld; ``per_row``: its teacher overrides act (same behaviour), so the rows step one by one."""
    teacher_cls = list_teacher(lengths)
    if per_row:
        teacher_cls = type("PerRow", (teacher_cls,), {"act": lambda self: super(type(self), self).act()})
    opts = _opts(datatype, rows)
    return BatchWorld(opts, DialogPartnerWorld(opts, [teacher_cls(opts), agent_cls(opts)]), rows)


class _LabelOrNothing(Agent):
    """batch_act: the label for even texts, a wrong answer for odd ones (so accuracy and F1 vary)."""

    def batch_act(self, observations):
        out = []
        for obs in observations:
            labels = obs.get("labels") or obs.get("eval_labels")
            if not labels:
                out.append(Message(id="m"))
            elif int(obs["text"].split("-")[1]) % 2 == 0:
                out.append(Message(id="m", text=labels[0]))
            else:
                out.append(Message(id="m", text=f"{labels[0]} extra words"))
        return out


@pytest.mark.parametrize("agent_cls", [_LabelOrNothing, RecordingAgent])
@pytest.mark.parametrize("datatype", ["train", "valid"])
def test_batchworld_block_path_equals_row_path(agent_cls, datatype):
    lengths, rows = [3, 1, 2, 4, 1, 1, 2, 3, 2], 4
    fast = _world(lengths, datatype, rows, agent_cls)
    slow = _world(lengths, datatype, rows, agent_cls, per_row=True)
    assert fast._block is not None and slow._block is None
    steps = 0
    while steps < 40 and not (datatype == "valid" and fast.epoch_done()):
        fast.parley()
        slow.parley()
        steps += 1
        assert fast.get_total_exs() == slow.get_total_exs()
        assert fast.epoch_done() == slow.epoch_done()
    assert fast.report() == slow.report()
    if datatype == "valid":
        assert fast.report()["exs"] == sum(lengths)
    if agent_cls is RecordingAgent:
        assert fast.get_model_agent().seen == slow.get_model_agent().seen


def test_served_examples_are_read_only_and_copies_are_not():
    teacher, (clone,) = _teachers([2], "train", 1)
    msg = clone.act()
    assert isinstance(msg, FrozenMessage)
    with pytest.raises(TypeError, match=r"copy it first with Message\(observation\)"):
        msg["text_vec"] = [1, 2]
    with pytest.raises(TypeError):
        msg.pop("text")
    copy = Message(msg)
    copy["text_vec"] = [1, 2]
    assert "text_vec" not in msg and msg.copy() == msg and type(msg.copy()) is Message


@settings(max_examples=60, deadline=None)
@given(rows=st.lists(st.tuples(st.sampled_from([None, "", "a", "the cat", "cat sat", "A cat!", "dog"]),
                               st.sampled_from([None, (), ("cat",), ("the cat", "dog"), ("cat sat down",)])),
                     max_size=40), flush_every=st.integers(1, 7))
def test_add_rows_equals_a_per_reply_reference(rows, flush_every):
    """Counted, deferred scoring == scoring each reply with exact_match / f1_score; padding rows (answers
    None) are neither examples nor scored."""
    import accelbatch.metrics as metrics_module

    metrics = Metrics()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(metrics_module, "PENDING_ROWS", flush_every)
        for start in range(0, len(rows), 3):
            chunk = rows[start:start + 3]
            metrics.add_rows([p for p, _ in chunk], [a for _, a in chunk], sum(a is not None for _, a in chunk))
    scored = [(p, a) for p, a in rows if p is not None and a]
    report = metrics.report()
    assert report["exs"] == sum(a is not None for _, a in rows)
    if scored:
        assert report["accuracy"] == pytest.approx(sum(exact_match(p, a) for p, a in scored) / len(scored),
                                                   abs=1e-12)
        assert report["f1"] == pytest.approx(sum(f1_score(p, a) for p, a in scored) / len(scored), abs=1e-12)
    else:
        assert "accuracy" not in report
