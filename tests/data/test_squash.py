"""Episode squashing: ParlAI's documented x1..x4 / y1..y4 examples and the edge cases."""

from __future__ import annotations

import pytest

from accelbatch.data.squash import squash_episode, squash_episodes
from accelbatch.messages import Message


def episode():
    return [Message({"text": f"x{i}", "labels": [f"y{i}"], "episode_done": i == 4, "id": "teacher"})
            for i in range(1, 5)]


def texts(msgs):
    return [m["text"].split("\n") for m in msgs]


def test_all_context_without_labels():
    out = squash_episode(episode(), context_length=-1, include_labels=False)
    assert texts(out) == [["x1"], ["x1", "x2"], ["x1", "x2", "x3"], ["x1", "x2", "x3", "x4"]]
    assert [m["labels"] for m in out] == [["y1"], ["y2"], ["y3"], ["y4"]]
    assert all(m["episode_done"] is True for m in out)


def test_context_3_with_labels():
    out = squash_episode(episode(), context_length=3, include_labels=True)
    assert texts(out) == [["x1"], ["x1", "y1", "x2"], ["x2", "y2", "x3"], ["x3", "y3", "x4"]]
    assert [m["labels"] for m in out] == [["y1"], ["y2"], ["y3"], ["y4"]]


def test_all_context_with_labels_is_the_default():
    out = squash_episode(episode())
    assert texts(out)[-1] == ["x1", "y1", "x2", "y2", "x3", "y3", "x4"]


def test_context_1_keeps_only_the_current_text():
    assert texts(squash_episode(episode(), context_length=1)) == [["x1"], ["x2"], ["x3"], ["x4"]]


def test_input_is_not_modified_and_other_fields_are_kept():
    ep = episode()
    ep[0]["label_candidates"] = ["y1", "z"]
    out = squash_episode(ep, 2)
    assert ep[1]["text"] == "x2" and ep[1]["episode_done"] is False
    assert out[0]["label_candidates"] == ["y1", "z"] and out[0]["id"] == "teacher"
    assert isinstance(out[0], Message)


def test_eval_labels_enter_the_history_and_missing_text_adds_nothing():
    ep = [Message({"text": "a", "eval_labels": ["b"]}), Message({"labels": ["c"]}), Message({"text": "d"})]
    out = squash_episode(ep)
    assert texts(out) == [["a"], ["a", "b"], ["a", "b", "c", "d"]]


def test_stream_of_episodes_is_lazy():
    def episodes():
        yield episode()
        raise RuntimeError("read too far")

    it = squash_episodes(episodes())
    assert next(it)["text"] == "x1"


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_context_length_names_the_option(bad):
    with pytest.raises(ValueError, match="--context-length"):
        squash_episode(episode(), context_length=bad)
