"""Episode squashing: ParlAI's documented x1..x4 / y1..y4 examples and the edge cases."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from accelbatch.data.squash import each_history, histories, history_of, squash_episode, squash_episodes
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


@given(st.lists(st.tuples(st.sampled_from(["", "a", "b c", None]), st.sampled_from([None, [], [""], ["y"]]),
                          st.booleans()), min_size=1, max_size=8),
       st.sampled_from([-1, 1, 2, 3]), st.booleans())
def test_one_turns_history_is_that_of_the_whole_episode(turns, context_length, include_labels):
    """history_of (a batch's rows of long episodes) and each_history (their lengths, one at a time) give what
    histories gives, empty texts and labels and eval_labels included."""
    episode = [Message({k: v for k, v in (("text", text), ("labels" if train else "eval_labels", labels))
                        if v is not None}) for text, labels, train in turns]
    whole = histories(episode, context_length, include_labels)
    assert list(each_history(episode, context_length, include_labels)) == whole
    assert [history_of(episode, t, context_length, include_labels) for t in range(len(episode))] == whole


def test_the_lengths_of_a_long_episode_hold_one_history_at_a_time():
    """Store.lengths built every turn's history of an episode at once: 893 MB for one of 4000 turns."""
    import tracemalloc

    from accelbatch.data.datasets import EpisodeStore

    turns = 1500
    store = EpisodeStore([[{"text": f"turn {t} " + "word " * 8, "labels": ["yes"], "episode_done": t == turns - 1}
                           for t in range(turns)]], "teacher", training=False)
    tracemalloc.start()
    lengths = store.lengths(lambda obs: len(obs["full_text"]), -1, True)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert lengths[turns - 1] == len(history_of(store.episode(0), turns - 1))
    assert peak < 4 * lengths[turns - 1] + (1 << 20), f"{peak / 2**20:.1f} MB"  # all turns': 60 MB


@pytest.mark.parametrize("context_length, expected", [
    (-1, ["hi", "hi\na\n", "hi\na\n\nb\nbye"]), (2, ["hi", "a\n", "b\nbye"]), (1, ["hi", "", "bye"])])
def test_an_empty_text_is_an_utterance_as_in_parlai(context_length, expected):
    """ParlAI's History appends a text that is "" (not one that is None): -histsz 1 at an empty turn keeps it
    alone, an empty line (the history skipped it and gave the previous label). The agent's own History (the
    clones' feed) and squashing (the loader's) agree."""
    from accelbatch.agents import History

    episode = [Message(text="hi", labels=["a"]), Message(text="", labels=["b"]), Message(text="bye", labels=["c"])]
    assert histories(episode, context_length) == expected
    history = History(context_length)
    assert [history.add(turn["text"], last) for turn, last in zip(episode, [None, "a", "b"])] == expected
