"""ParlAI's world API in a hand-written loop: ``get_acts()`` after a batched parley (the teacher's batch of
examples, the model's batch of replies), ``episode_done()``, ``getID()`` and ``with world:``. Before, a
BatchWorld's get_acts() was [None, None] and episode_done() an AttributeError."""

from __future__ import annotations

import accelbatch as ab
from accelbatch.agents import Agent
from accelbatch.messages import Message, is_padding

# 3 episodes of 3, 1 and 2 turns; the labels of 4 of the 6 turns are "yes"
ROWS = [{"text": "a", "labels": ["yes"], "episode_done": False}, {"text": "b", "labels": ["no"], "episode_done": False},
        {"text": "c", "labels": ["yes"], "episode_done": True}, {"text": "d", "labels": ["yes"], "episode_done": True},
        {"text": "e", "labels": ["no"], "episode_done": False}, {"text": "f", "labels": ["yes"], "episode_done": True}]


class SaysYes(Agent):
    """Replies "yes" to everything, with its own act (no batch_act)."""

    def act(self) -> Message:
        return Message(id="yes", text="yes")


def _world(write_jsonl, rows: int):
    path = write_jsonl(ROWS, name="valid.jsonl")
    return ab.create_world(ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=rows, progress=False),
                           agent=SaysYes)


def test_a_batched_parley_s_acts_are_the_rows_examples_and_replies(write_jsonl):
    """A hand loop scoring get_acts() of a 3-row BatchWorld (one row per episode) counts what the report
    counts, and the data's own count: 4 of 6 labels are "yes"."""
    with _world(write_jsonl, 3) as world:
        scored = right = 0
        while not world.epoch_done():
            world.parley()
            examples, replies = world.get_acts()
            assert len(examples) == len(replies) == 3
            for example, reply in zip(examples, replies):
                if example is not None and not is_padding(example):
                    scored += 1
                    right += reply["text"] in example["eval_labels"]
        report = world.report()
        assert world.getID() == type(world).__name__
    assert (scored, right) == (6, 4) == (report["exs"], round(report["accuracy"] * 6))


def test_episode_done_is_true_at_each_episode_s_last_turn(write_jsonl):
    world = _world(write_jsonl, 1)
    ends = []
    while not world.epoch_done():
        world.parley()
        ends.append(world.episode_done())
    assert ends == [row["episode_done"] for row in ROWS]  # the turns of 3, 1 and 2
    assert ab.create_world(ab.Opts(task="babi:1", batchsize=4), agent=SaysYes).episode_done() is False


def test_with_world_shuts_it_down(write_jsonl, monkeypatch):
    world = _world(write_jsonl, 4)
    calls = []
    monkeypatch.setattr(world, "shutdown", lambda: calls.append(1))
    with world as entered:
        assert entered is world
    assert calls == [1]
