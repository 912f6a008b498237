"""ParlAI's world API in a hand-written loop: ``get_acts()`` after a batched parley (the teacher's batch of
examples, the model's batch of replies), ``episode_done()``, ``getID()`` and ``with world:``. Before, a
BatchWorld's get_acts() was [None, None] and episode_done() an AttributeError."""

from __future__ import annotations

import pytest
from helpers import LabelEchoTorchAgent

import accelbatch as ab
from accelbatch.agents import Agent
from accelbatch.loader_world import LoaderWorld
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


# 7 episodes of 2, 1, 3, 1, 2, 1 and 2 turns (12 turns); a turn's text ends in a word, the label of 8 of them
EPISODES = [[("one red", "red"), ("two blue", "green")], [("three red", "red")],
            [("four green", "green"), ("five red", "blue"), ("six blue", "blue")], [("seven red", "blue")],
            [("eight green", "green"), ("nine blue", "blue")], [("ten red", "red")],
            [("eleven green", "red"), ("twelve blue", "blue")]]
TURNS, EPISODE_COUNT, LAST_WORD_RIGHT = 12, 7, 8  # counted by hand from EPISODES


def _turns() -> list[dict]:
    return [{"text": text, "labels": [label], "episode_done": turn == len(episode) - 1}
            for episode in EPISODES for turn, (text, label) in enumerate(episode)]


def _last_word(observation: Message | None) -> Message:
    words = (observation or {}).get("text", "").split()
    return Message(id="LastWord", text=words[-1] if words else "")


class LastWord(Agent):
    """Replies the last word of the text, by its own act and by batch_act."""

    def act(self) -> Message:
        return _last_word(self.observation)

    def batch_act(self, observations: list[Message]) -> list[Message]:
        return [_last_word(observation) for observation in observations]


def _last_word_world(write_jsonl, rows: int, display_examples: bool = False):
    path = write_jsonl(_turns(), name="valid.jsonl")
    return ab.create_world(ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=rows, progress=False,
                                   display_examples=display_examples), agent=LastWord)


def _hand_loop(world, check) -> tuple[int, int, int]:
    """ParlAI's hand loop to the epoch's end: (examples scored, replies right, parleys); ``check`` sees each
    parley's get_acts()."""
    scored = right = steps = 0
    while not world.epoch_done():
        world.parley()
        steps += 1
        examples, replies = world.get_acts()
        check(examples, replies)
        for example, reply in zip(examples, replies):
            if not is_padding(example):
                scored += 1
                right += reply["text"] in example["eval_labels"]
    return scored, right, steps


@pytest.mark.parametrize("row_by_row", [False, True], ids=["whole-batch", "clones"])
def test_a_4_row_hand_loop_over_get_acts_scores_what_the_report_scores(write_jsonl, row_by_row):
    """w.parley(); for ex, reply in zip(*w.get_acts()) over 4 rows: every row each step (padding rows are the
    teacher's padding acts), each row world's get_acts() the same pair; 8 of the 12 turns right, as counted by
    hand and as the report says. The clone path is the one -de (display_examples) takes."""
    world = _last_word_world(write_jsonl, 4, display_examples=row_by_row)
    assert (world._teacher is None) == row_by_row  # the path this case means to take

    def check(examples, replies):
        assert len(examples) == len(replies) == 4
        assert [w.get_acts() for w in world.worlds] == [[e, r] for e, r in zip(examples, replies)]

    scored, right, steps = _hand_loop(world, check)
    report = world.report()
    assert (scored, right) == (TURNS, LAST_WORD_RIGHT) == (report["exs"], round(report["accuracy"] * TURNS))
    assert world.get_total_parleys() == steps


def test_episode_done_counts_the_episodes_in_a_1_row_loop(write_jsonl):
    """episode_done() after each parley is True at the 7 episodes' last turns (turns 2, 3, 6, 7, 9, 10, 12)."""
    world = _last_word_world(write_jsonl, 1)
    ends = []
    while not world.epoch_done():
        world.parley()
        ends.append(world.episode_done())
    assert [turn for turn, end in enumerate(ends, 1) if end] == [2, 3, 6, 7, 9, 10, 12]
    assert sum(ends) == EPISODE_COUNT and len(ends) == TURNS


@pytest.mark.parametrize("rows", [1, 4])
def test_get_total_parleys_counts_parley_calls_and_reset_restarts_it(write_jsonl, rows):
    world = _last_word_world(write_jsonl, rows)
    assert world.get_total_parleys() == 0
    for _ in range(3):
        world.parley()
    assert world.get_total_parleys() == 3
    world.reset()
    assert world.get_total_parleys() == 0 and world.get_acts() == [None, None]


class RecordsShutdown(LastWord):
    calls: list[str] = []  # shared by the clones

    def shutdown(self) -> None:
        RecordsShutdown.calls.append("shutdown")


@pytest.mark.parametrize("rows", [1, 4])
def test_leaving_a_with_block_shuts_the_world_s_agents_down_even_on_an_error(write_jsonl, rows):
    path = write_jsonl(_turns(), name="valid.jsonl")
    RecordsShutdown.calls = []
    with pytest.raises(KeyError):
        with ab.create_world(ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=rows, progress=False),
                             agent=RecordsShutdown) as world:
            assert world.getID() == ("DialogPartnerWorld" if rows == 1 else "BatchWorld")
            world.parley()
            raise KeyError("the block failed")
    assert RecordsShutdown.calls == ["shutdown"]  # the model agent's, once


class LastWordTorch(LabelEchoTorchAgent):
    """A TorchAgent (batched by the loader front end) replying the last word of each row's text."""

    def replies(self, outputs, observations):
        return [_last_word(observation) for observation in observations]


@pytest.mark.parametrize("batching", ["full", "buckets"])
def test_the_batched_front_end_keeps_acts_and_parleys_as_a_batch_world(write_jsonl, batching):
    """The loader front end (dynamic batching here) answers the same hand loop: each parley's examples and
    replies, one per row; 8 of the 12 turns right; get_total_parleys() the loop's count, 0 after reset()."""
    path = write_jsonl(_turns(), name="valid.jsonl")
    world = ab.create_world(ab.Opts(task=f"jsonl:{path}", datatype="valid", batchsize=4, progress=False,
                                    dynamic_batching=batching), agent=LastWordTorch)
    assert isinstance(world, LoaderWorld)

    def check(examples, replies):
        assert len(examples) == len(replies) > 0

    scored, right, steps = _hand_loop(world, check)
    report = world.report()
    assert (scored, right) == (TURNS, LAST_WORD_RIGHT) == (report["exs"], round(report["accuracy"] * TURNS))
    assert world.get_total_parleys() == steps >= 1
    world.reset()
    assert world.get_total_parleys() == 0 and world.get_acts() == [None, None]
