"""``--display-examples`` (and display-model) show the examples, not the padding rows that fill a batch
past the end of the data: one teacher line and one reply line per labelled turn, counted by hand."""

from __future__ import annotations

import json

import pytest

import accelbatch as ab

EPISODES = [  # 6 episodes, 9 turns: -bs 4 leaves rows of the last steps with no example
    [("hello 0", "a0")], [("hello 1", "a1"), ("hello 2", "a2")], [("hello 3", "a0")],
    [("hello 4", "a1"), ("hello 5", "a2"), ("hello 6", "a0")], [("hello 7", "a1")], [("hello 8", "a2")]]


@pytest.mark.parametrize("feed", [dict(), dict(num_workers=1)], ids=["batch-world", "loader"])
def test_display_shows_each_turn_once_and_no_padding_row(tmp_path, capsys, feed):
    lines = []
    for episode in EPISODES:
        for i, (text, label) in enumerate(episode):
            lines.append(json.dumps({"text": text, "labels": [label], "label_candidates": ["a0", "a1", "a2"],
                                     "episode_done": i == len(episode) - 1}))
    data = tmp_path / "d.jsonl"
    data.write_text("\n".join(lines) + "\n", encoding="utf-8")
    opts = ab.Opts(task=f"jsonl:{data}", model="random_candidate", datatype="valid", batchsize=4,
                   display_examples=True, progress=False, **feed)
    report = ab.run(ab.create_world(opts), opts)
    shown = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[")]
    turns = sum(len(episode) for episode in EPISODES)
    assert report["valid"]["exs"] == turns
    teacher_lines = [line for line in shown if "hello" in line]
    assert sorted(teacher_lines) == sorted(set(teacher_lines)) and len(teacher_lines) == turns, shown
    assert len(shown) == 2 * turns, shown  # each turn's reply, nothing for a padding row
