"""Stores: episodes in memory and files read on demand through their index serve the same examples."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest

from accelbatch.data.datasets import PADDING, ConcatStore, EpisodeStore, FileStore
from accelbatch.data.squash import squash_episode
from accelbatch.tasks.files import DataFileError, FileIndex, iter_episodes, iter_examples, load_episodes


def write_dialogues(path, episodes=60, seed=0, fmt="jsonl", noise=True, crlf=False):
    rng = random.Random(seed)
    k = 0
    end = "\r\n" if crlf else "\n"
    with open(path, "w", encoding="utf-8", newline="") as f:
        for _ in range(episodes):
            turns = rng.randint(1, 5)
            for t in range(turns):
                if noise and rng.random() < 0.1:
                    f.write(end)
                k += 1
                text = f"x{k} " + "w " * rng.randint(0, 25) + "é"
                if fmt == "jsonl":
                    f.write(json.dumps({"text": text, "labels": [f"y{k}"], "episode_done": t == turns - 1}) + end)
                else:
                    done = "\tepisode_done:True" if t == turns - 1 else ""
                    f.write(f"text:{text}\tlabels:y{k}{done}{end}")
    return k


@pytest.mark.parametrize("fmt", ["jsonl", "parlai"])
@pytest.mark.parametrize("crlf", [False, True])
def test_the_index_reads_every_episode_as_a_full_read_does(tmp_path, fmt, crlf):
    path = str(tmp_path / f"d.{'jsonl' if fmt == 'jsonl' else 'txt'}")
    total = write_dialogues(path, fmt=fmt, crlf=crlf)
    index = FileIndex.build(path)
    episodes = load_episodes(path)
    assert len(index.turns) == len(episodes) and int(index.turns.sum()) == total
    assert [index.read(e) for e in range(len(episodes))] == episodes
    line_of = {msg["text"]: n for _, n, msg in iter_examples(path)}
    assert [line_of[ep[0]["text"]] for ep in episodes] == index.lines.tolist()  # exact first lines


def test_errors_name_file_and_line_before_anything_is_served(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a", "labels": ["b"]}\n\n{"text": "c", "labels": \n')
    with pytest.raises(DataFileError, match=r"bad.jsonl:3: not valid JSON"):
        FileIndex.build(str(path))
    raw = tmp_path / "latin.jsonl"
    raw.write_bytes(b'{"text": "a", "labels": ["b"]}\n{"text": "caf\xe9", "labels": ["x"]}\n')
    with pytest.raises(DataFileError, match=r"latin.jsonl:2: not valid UTF-8"):
        FileIndex.build(str(raw))
    (tmp_path / "empty.jsonl").write_text("\n\n")
    with pytest.raises(DataFileError, match="holds no examples"):
        FileIndex.build(str(tmp_path / "empty.jsonl"))
    with pytest.raises(DataFileError, match="no such file"):
        FileIndex.build(str(tmp_path / "missing.jsonl"))


def test_unfinished_last_episode_is_closed_not_dropped(tmp_path):
    path = tmp_path / "open.txt"
    path.write_text("text:a\tlabels:b\ntext:c\tlabels:d\n")
    index = FileIndex.build(str(path))
    (episode,) = list(iter_episodes(str(path)))
    assert index.turns.tolist() == [2] and index.read(0) == episode and episode[-1]["episode_done"]


@pytest.mark.parametrize("training", [True, False])
def test_memory_and_file_stores_serve_the_same_examples_and_observations(tmp_path, training):
    path = str(tmp_path / "d.jsonl")
    write_dialogues(path, episodes=40)
    memory = EpisodeStore(load_episodes(path), "T", training)
    files = FileStore(FileIndex.build(path), "T", training)
    assert memory.pad == files.pad and np.array_equal(memory.table.turns, files.table.turns)
    block = np.arange(memory.pad + 1).reshape(1, -1)
    (examples, ids), (file_examples, file_ids) = memory.gather(block), files.gather(block)
    assert examples.tolist() == file_examples.tolist()
    answers = [memory.answers.answers[i] if i >= 0 else None for i in ids[0].tolist()]
    assert answers == [files.answers.answers[i] if i >= 0 else None for i in file_ids[0].tolist()]
    assert answers[:-1] == [tuple(m.targets()) for m in examples[0, :-1]]
    assert examples[0, -1] is PADDING and answers[-1] is None
    key = "labels" if training else "eval_labels"
    assert all(key in m and m["id"] == "T" for m in examples[0, :-1])
    for context, labels in ((-1, True), (2, False)):
        ids = list(range(memory.pad))
        assert memory.observations(ids, context, labels) == files.observations(ids, context, labels)
    squashed = [m for ep in load_episodes(path) for m in squash_episode(ep, 2, False)]
    assert [o["full_text"] for o in memory.observations(list(range(memory.pad)), 2, False)] == \
        [m["text"] for m in squashed]


def test_served_examples_are_read_only_and_copies_are_not():
    store = EpisodeStore([[{"text": "a", "labels": ["b"]}]], "T", True)
    served = store.gather(np.array([0]))[0][0]
    with pytest.raises(TypeError, match="read-only"):
        served["text"] = "changed"
    copy = served.copy()
    copy["text"] = "changed"
    assert served["text"] == "a" and store.observations([0], -1, True)[0]["full_text"] == "a"


def test_a_concatenation_of_stores_keeps_each_examples_task():
    first = EpisodeStore([[{"text": "a", "labels": ["1"]}, {"text": "b", "labels": ["2"]}]], "A", False)
    second = EpisodeStore([[{"text": "c", "labels": ["3"]}], [{"text": "d", "labels": ["4"]}]], "B", False)
    both = ConcatStore([first, second])
    assert both.pad == 4 and both.table.tasks == (1, 2) and both.table.turns.tolist() == [2, 1, 1]
    examples, ids, tasks = both.gather(np.array([0, 2, 3, 1, 4]))
    assert [m.get("text") for m in examples] == ["a", "c", "d", "b", None]
    assert [both.answers.answers[i] for i in ids[:4]] == [("1",), ("3",), ("4",), ("2",)] and ids[4] == -1
    assert tasks[:4].tolist() == [0, 1, 1, 0]
    assert [m["id"] for m in both.episode(2)] == ["B"]
