"""ParlAI's world semantics that hand-written loops rely on: reset() starts the metrics again (the model
agent's too), epoch_done() is true right after the parley serving the last example whatever the front end,
random_candidate's rows draw independently, (message, 0/1) pairs from setup_data, no blank display lines."""

from __future__ import annotations

import json

import numpy as np
import pytest

import accelbatch as ab
from accelbatch.cli import main
from accelbatch.run import evaluate
from accelbatch.teachers import FixedTeacher

EXAMPLES = 100


@pytest.fixture
def coin(tmp_path):
    """EXAMPLES one-turn episodes, each with its label and one wrong candidate: chance is 0.5."""
    path = tmp_path / "coin.jsonl"
    path.write_text("".join(json.dumps({"text": f"q{i}", "labels": [f"a{i}"], "label_candidates": [f"a{i}", f"b{i}"],
                                        "episode_done": True}) + "\n" for i in range(EXAMPLES)))
    return path


def _loop(world) -> int:
    parleys = 0
    while not world.epoch_done():
        world.parley()
        parleys += 1
    return parleys


def test_reset_starts_the_model_agents_metrics_again(coin):
    world = ab.create_world(ab.Opts(task=f"jsonl:{coin}", model="bag", datatype="valid", batchsize=10))
    for _ in range(3):
        world.parley()
    world.reset()
    assert world.report() == {"exs": 0}  # a loss over 30 rows was kept
    _loop(world)
    again = ab.create_world(ab.Opts(task=f"jsonl:{coin}", datatype="valid", batchsize=10),
                            agent=world.get_model_agent().fork())
    reference = {k: v for k, v in evaluate(again).items() if k != "time_s"}
    assert world.report() == reference


@pytest.mark.parametrize("batching", ["none", "batchsort"])  # the per-row clones and the batched loader
def test_epoch_done_comes_with_the_parley_serving_the_last_example(coin, batching):
    world = ab.create_world(ab.Opts(task=f"jsonl:{coin}", model="bag", datatype="valid", batchsize=10,
                                    dynamic_batching=batching))
    assert _loop(world) == EXAMPLES // 10 and world.get_total_exs() == EXAMPLES
    world.shutdown()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_candidate_is_at_chance_whatever_the_batch(coin, seed, capsys):
    accuracy = {}
    for bs in (1, 100):
        assert main(["eval", "-t", f"jsonl:{coin}", "-m", "random_candidate", "-bs", str(bs), "--seed", str(seed),
                     "--no-progress"]) == 0
        accuracy[bs] = float(capsys.readouterr().out.splitlines()[2].split()[2])
    assert accuracy[1] == accuracy[100] and 0.3 < accuracy[1] < 0.7, accuracy  # rows drew alike: 0.0 or 1.0


class NumericNewEpisodes(FixedTeacher):
    """ParlAI reads new_episode for its truth: ported teachers yield 0/1 or numpy's bools."""

    def setup_data(self):
        for e in range(2):
            for t, new in enumerate((1, np.bool_(False))):
                yield {"text": f"q{e}.{t}", "labels": [f"a{e}.{t}"]}, new


def test_setup_data_pairs_take_new_episode_for_its_truth():
    teacher = NumericNewEpisodes(ab.Opts(datatype="valid"))
    assert [[m["text"] for m in episode] for episode in teacher.episodes] == [["q0.0", "q0.1"], ["q1.0", "q1.1"]]


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.slow
def test_hogwild_display_prints_no_blank_line_for_rows_of_padding(tmp_path, capfd):  # the processes print
    data = tmp_path / "seven.jsonl"  # episodes of 3, 1, 2 and 1 turns: one process's share ends first
    data.write_text("".join(json.dumps({"text": t, "labels": ["x"], "episode_done": t in "cdfg"}) + "\n"
                            for t in "abcdefg"))
    assert main(["eval", "-t", f"jsonl:{data}", "-m", "repeat_label", "-bs", "2", "-nt", "2", "--display-examples",
                 "--no-progress"]) == 0
    shown = capfd.readouterr().out.splitlines()
    assert sum(line.startswith("[") for line in shown) > 7 and "" not in shown


def _after_a_reset(data, workers: int) -> list[str]:
    """What a training world serves in three parleys after five parleys and a reset()."""
    world = ab.create_world(ab.Opts(task=f"jsonl:{data}", model="bag", batchsize=4, seed=1, num_workers=workers))
    try:
        for _ in range(5):
            world.parley()
        world.reset()
        shown = []
        for _ in range(3):
            world.parley()
            shown.append(world.display())
        return shown
    finally:
        world.shutdown()


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_reset_training_world_serves_the_same_examples_with_data_workers(coin):
    """The batched loader's reset went on to the next pass's order where the teacher rewinds to the first."""
    assert _after_a_reset(coin, 1) == _after_a_reset(coin, 0)


class _Writes:
    """A stdout that records each write call."""

    def __init__(self):
        self.calls: list[str] = []

    def write(self, text: str) -> int:
        self.calls.append(text)
        return len(text)

    def flush(self) -> None:
        pass


@pytest.mark.parametrize("extra", [{"batchsize": 1}, {"batchsize": 2}, {"batchsize": 2, "dynamic_batching": "full"}],
                         ids=["one-row", "batch", "loader"])
def test_each_displayed_block_is_one_write_ending_its_line(tmp_path, monkeypatch, extra):
    """Hogwild processes share the output: a block written apart from its newline let another process's lines in
    between ('[BagAgent]: blue[FileTeacher]: ...')."""
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"text": f"q{i}", "labels": ["x"], "label_candidates": ["x", "y"],
                                        "episode_done": True}) + "\n" for i in range(4)))
    world = ab.create_world(ab.Opts(task=f"jsonl:{data}", model="bag", datatype="valid", display_examples=True,
                                    **extra))
    writes = _Writes()
    monkeypatch.setattr("sys.stdout", writes)
    try:
        world.parley()
    finally:
        monkeypatch.undo()
        world.shutdown()
    assert writes.calls and all(call.endswith("\n") and call.count("[") >= 2 for call in writes.calls), writes.calls
