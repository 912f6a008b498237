from __future__ import annotations

import statistics
import time

import pytest

from accelbatch.opts import Opts
from accelbatch.tasks import dialogues
from accelbatch.tasks.dialogues import SyntheticDialogueTeacher, generate, split_sizes
from accelbatch.teachers import resolve_teacher_class


@pytest.fixture(scope="module")
def train():
    return generate(dialogues.TRAIN_EPISODES, seed=0, split="train")


def test_registered_and_sized_as_the_issue_says(train):
    assert resolve_teacher_class("dialogues") is SyntheticDialogueTeacher
    assert len(train) == 10_000
    assert split_sizes("dialogues") == {"train": 10_000, "valid": 3_000, "test": 3_000}
    assert split_sizes("dialogues:200") == {"train": 200, "valid": 60, "test": 60}
    with pytest.raises(ValueError, match="dialogues:N"):
        split_sizes("dialogues:zero")


def test_episode_shape(train):
    turns = [len(ep) for ep in train]
    assert set(turns) == {1, 2, 3}
    for ep in train[:500]:
        assert [m["episode_done"] for m in ep] == [False] * (len(ep) - 1) + [True]
        for m in ep:
            assert 1 <= len(m["labels"]) == 1
            assert 1 <= len(m["labels"][0].split()) <= 4
            assert len(m["label_candidates"]) == dialogues.NUM_CANDIDATES
            assert len(set(m["label_candidates"])) == dialogues.NUM_CANDIDATES
            assert m["labels"][0] in m["label_candidates"]


def test_words_per_turn_log_normal_median_12_clipped_at_300(train):
    lengths = [len(m["text"].split()) for ep in train for m in ep]
    assert min(lengths) >= 1 and max(lengths) <= 300
    assert 11 <= statistics.median(lengths) <= 13
    assert max(lengths) > 100  # a long tail: what makes dynamic batching pay
    assert statistics.mean(lengths) > statistics.median(lengths)


def test_deterministic_by_seed_and_split():
    a, b = generate(50, seed=3), generate(50, seed=3)
    assert a == b
    assert generate(50, seed=4) != a
    assert generate(50, seed=3, split="valid") != a


def test_generated_fast():
    start = time.perf_counter()
    generate(dialogues.TRAIN_EPISODES, seed=1)
    assert time.perf_counter() - start < 5.0  # about 0.3 s on a laptop; generous for loaded CI


def test_teacher_serves_splits_and_eval_labels():
    train_t = SyntheticDialogueTeacher(Opts(task="dialogues:100"))
    valid_t = SyntheticDialogueTeacher(Opts(task="dialogues:100", datatype="valid"))
    assert train_t.num_episodes() == 100 and valid_t.num_episodes() == 30
    msg = valid_t.act()
    assert "eval_labels" in msg and "labels" not in msg and msg["label_candidates"]
    assert "labels" in train_t.act()


def test_every_valid_example_once_through_a_batch_world():
    from accelbatch.build import create_world
    from accelbatch.run import evaluate

    opts = Opts(task="dialogues:100", datatype="valid", model="repeat_label", batchsize=7)
    report = evaluate(create_world(opts))
    n = SyntheticDialogueTeacher(opts).num_examples()
    assert report["exs"] == n and report["accuracy"] == 1.0
