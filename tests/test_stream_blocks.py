"""A streamed file of large examples (``-dt train:stream``) is read a few megabytes at a time.

The feed lays out many steps at once; for a file read on demand each laid-out example is a parsed line, so
the block is sized by the file's bytes per example: the first step of a file of 1,000 examples of 14 KB
(about 4 epochs' worth of flat indices at 4 rows) must not parse the whole file, and the examples served
must be those of the same file held in memory, step for step across many blocks.
"""

from __future__ import annotations

import json

import pytest

from accelbatch.data.datasets import EpisodeStore, FileStore
from accelbatch.data.orders import make_order
from accelbatch.data.schedule import RowFeed, RowSchedule
from accelbatch.tasks.files import FileIndex, load_episodes

EXAMPLES, CANDIDATES, ROWS = 1000, 400, 4


@pytest.fixture
def big_examples(tmp_path):
    """A JSONL file of one-turn episodes, each about 14 KB (400 candidates); its lines' sizes by episode."""
    path = tmp_path / "big.jsonl"
    lines = []
    for i in range(EXAMPLES):
        cands = [f"candidate {i} number {c} of many" for c in range(CANDIDATES)]
        lines.append(json.dumps({"text": f"question {i}", "labels": [cands[i % CANDIDATES]],
                                 "label_candidates": cands, "episode_done": True}) + "\n")
    path.write_text("".join(lines), encoding="utf-8")
    return str(path), [len(line.encode()) for line in lines]


def _feed(store):
    order = make_order(store.table, True, 7)
    return RowFeed(RowSchedule(store.table, ROWS, order, loop=True, pad=store.pad), store.gather,
                   store.example_bytes)


def test_the_first_step_of_a_streamed_file_parses_a_few_megabytes_not_the_file(big_examples, monkeypatch):
    path, sizes = big_examples
    assert sum(sizes) > 13 << 20  # the file: about 14 MB
    read: list[int] = []
    original = FileIndex.read
    monkeypatch.setattr(FileIndex, "read", lambda self, episode: read.append(episode) or original(self, episode))
    feed = _feed(FileStore(FileIndex.build(path), "t", True))
    feed.step()
    parsed_bytes = sum(sizes[e] for e in read)
    assert parsed_bytes <= 9 << 20, f"one step parsed {len(read)} examples, {parsed_bytes / 2**20:.1f} MB"


def test_a_streamed_file_serves_what_the_loaded_file_serves_across_blocks(big_examples):
    path, _ = big_examples
    streamed = _feed(FileStore(FileIndex.build(path), "t", True))
    loaded = _feed(EpisodeStore(load_episodes(path, "jsonl"), "t", True))
    for step in range(2 * EXAMPLES // ROWS + 3):  # two epochs and into the third: several streamed blocks
        got, want = streamed.step(), loaded.step()
        assert [m["text"] for m in got[0]] == [m["text"] for m in want[0]], step
        assert got[-1] == want[-1] == ROWS


def test_rows_beyond_the_parse_cache_parse_each_episode_once(tmp_path, monkeypatch):
    """More rows than the byte-sized cache of parsed episodes holds: each row's episode stays parsed for its
    next turn, rather than rows evicting each other's episodes and every turn parsing its episode again."""
    import numpy as np

    import accelbatch.data.datasets as datasets

    episodes, turns, rows = 300, 6, 200
    path = tmp_path / "eps.jsonl"
    path.write_text("".join(json.dumps({"text": f"e{e} t{t}", "labels": [f"r{t}"], "episode_done": t == turns - 1})
                            + "\n" for e in range(episodes) for t in range(turns)), encoding="utf-8")
    monkeypatch.setattr(datasets, "CACHE_BYTES", 1)  # the floor: 64 episodes, fewer than the rows
    store = FileStore(FileIndex.build(str(path)), "t", training=False)
    parsed = []
    read_episode = store._read_episode
    monkeypatch.setattr(store, "_read_episode", lambda index: parsed.append(index) or read_episode(index))
    store.__init__(store.index, "t", False)  # the cache wraps the counting reader
    for turn in range(turns):  # each of the rows serves its own episode, a turn a step, as BatchWorld's rows do
        examples, _ = store.gather(np.arange(rows, dtype=np.int64) * turns + turn)
        assert [m["text"] for m in examples] == [f"e{e} t{turn}" for e in range(rows)]
    assert sorted(parsed) == list(range(rows))  # each episode parsed once, not once per turn
