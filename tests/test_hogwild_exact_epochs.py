"""Hogwild (-nt N) without dynamic batching: each process trains its shard exactly once per epoch, ordered or
shuffled, and the report counts the rows trained (not padding). Counted by hand from what each process's
model was given: every example's text starts with ``q<index>``; process ``r`` of ``N`` holds the indices
``r, r + N, ...``.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import numpy as np
import pytest
from recording_agent import RecordingBag
from shared_runs import shared_dir

from accelbatch.data.orders import ShuffledOrder
from accelbatch.data.schedule import EpisodeTable
from accelbatch.hogwild_passes import ShardPasses, pass_share
from accelbatch.models.bag import BagAgent

TESTS = os.path.dirname(os.path.abspath(__file__))


class PidRecordingBag(RecordingBag):
    """RecordingBag whose lines start with the process id: ``pid i j k ...`` per training batch."""

    def step(self, observations, batch):
        if any("labels" in obs for obs in observations):
            with open(os.environ["RECORD_TRAINED"], "a") as out:
                out.write(f"{os.getpid()} " + " ".join(map(str, batch["example_index"].tolist())) + "\n")
        return BagAgent.step(self, observations, batch)


def _train(tmp_path, monkeypatch, examples: int, *args: str) -> tuple[dict[int, list[list[int]]], dict]:
    """Train on ``examples`` one-turn episodes; (per process: its batches' real indices, the train report)."""
    data = tmp_path / "train.txt"
    data.write_text("".join(f"text:q{i} w{i % 7}\tlabels:l{i % 3}\tlabel_candidates:l0|l1|l2\tepisode_done:True\n"
                            for i in range(examples)))
    record, report = tmp_path / "trained.txt", tmp_path / "report.json"
    record.unlink(missing_ok=True)
    monkeypatch.setenv("RECORD_TRAINED", str(record))
    monkeypatch.setenv("PYTHONPATH", TESTS)  # spawned children import the agent by name
    from accelbatch.cli import main

    assert main(["train", "-t", f"parlai:{data}", "-m", "test_hogwild_exact_epochs:PidRecordingBag", "--no-progress",
                 "--eval-splits", "", "--report-json", str(report), *args]) == 0
    batches: dict[int, list[list[int]]] = {}
    for line in record.read_text().split("\n"):
        if line:
            pid, *rows = map(int, line.split())
            batches.setdefault(pid, []).append([i for i in rows if i >= 0])
    return batches, json.loads(report.read_text())["train"]


def _ranked(batches: dict[int, list[list[int]]], processes: int) -> list[list[int]]:
    """Each process's trained indices in order, by rank (the shard its indices lie in)."""
    by_rank: dict[int, list[int]] = {}
    for rows in batches.values():
        flat = [i for batch in rows for i in batch]
        ranks = {i % processes for i in flat}
        assert len(ranks) == 1, f"a process trained examples of several shards: {sorted(ranks)}"
        by_rank[ranks.pop()] = flat
    assert sorted(by_rank) == list(range(processes))
    return [by_rank[r] for r in range(processes)]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("datatype", ["train:ordered", "train"])
def test_one_epoch_trains_each_example_once_and_counts_real_rows(tmp_path, monkeypatch, datatype):
    """The tester's case: 60 examples, -bs 4 -nt 2 -ne 1: each shard of 30 is 8 batches (the last with 2 real
    rows); every example is trained once, exs 60 (one process: 15 full batches, the same 60)."""
    batches, train = _train(tmp_path, monkeypatch, 60, "-nt", "2", "-bs", "4", "-ne", "1", "-dt", datatype)
    shards = _ranked(batches, 2)
    assert Counter(i for shard in shards for i in shard) == Counter(range(60))
    assert [len(rows) for rows in batches.values()] == [8, 8]
    assert train["exs"] == 60 and train["epochs"] == 1.0
    if datatype == "train:ordered":
        assert shards == [list(range(0, 60, 2)), list(range(1, 60, 2))]


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("loading", [(), ("--num-workers", "1"), ("-dt", "train:ordered")])
def test_a_pass_s_partial_step_trains_under_several_device_iterations(tmp_path, monkeypatch, loading):
    """50 examples, -nt 2 -bs 4 -di 3 -ne 1: each shard of 25 is steps of 12, 12 and 1 rows; the last is no
    multiple of D = 3, trained as a tail under --drop-last too (it was refused with PopTorch's batch-dimension
    error, or before training when ordered): every example once, exs 50."""
    batches, train = _train(tmp_path, monkeypatch, 50, "-nt", "2", "-bs", "4", "-di", "3", "-ne", "1", *loading)
    shards = _ranked(batches, 2)
    assert Counter(i for shard in shards for i in shard) == Counter(range(50))
    assert sorted(len(rows) for pid in batches.values() for rows in pid) == [1, 1, 12, 12, 12, 12]
    assert train["exs"] == 50 and train["epochs"] == 1.0


PASSES = ("-nt", "2", "-bs", "4", "-ne", "2", "--seed", "5")  # shuffled, each pass twice
EXAMPLES = 51  # shards of 26 and 25 rows


def _plain_passes(factory) -> tuple[list[list[int]], dict]:
    """Each process's trained indices (by rank) and the train report of a run of :data:`PASSES` that builds
    its batches in the main process: run once per session (each loading option must train the same)."""
    def build(folder):
        with pytest.MonkeyPatch.context() as monkeypatch:
            batches, train = _train(folder, monkeypatch, EXAMPLES, *PASSES)
        (folder / "ranked.json").write_text(json.dumps(_ranked(batches, 2)))
        (folder / "train.json").write_text(json.dumps(train))
    folder = shared_dir(factory, f"test_hogwild_exact_epochs plain passes {EXAMPLES} " + " ".join(PASSES), build)
    return json.loads((folder / "ranked.json").read_text()), json.loads((folder / "train.json").read_text())


def _assert_each_pass_trains_the_shard_once(shards: list[list[int]]) -> None:
    """Each process's indices: its shard (``r, r + 2, ...``) once in each of the two passes."""
    for rank, seen in enumerate(shards):
        shard = list(range(rank, EXAMPLES, 2))
        assert len(seen) == 2 * len(shard)
        assert sorted(seen[:len(shard)]) == sorted(seen[len(shard):]) == shard


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_each_pass_trains_the_shard_once_in_an_order_of_the_seed(tmp_path_factory):
    """51 examples, -nt 2 -bs 4 -ne 2 shuffled (shards of 26 and 25): each process trains its shard once per
    pass, each pass in a fresh order (that another run with the same seed trains the same sequences:
    test_batches_built_by_data_workers_train_the_same_passes, against this run)."""
    shards, train = _plain_passes(tmp_path_factory)
    _assert_each_pass_trains_the_shard_once(shards)
    for rank, seen in enumerate(shards):
        half = len(seen) // 2
        assert seen[:half] != seen[half:]  # shuffled afresh each pass
    assert train["exs"] == 2 * EXAMPLES and train["epochs"] == 2.0


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(240)
@pytest.mark.parametrize("loading", [("--num-workers", "2"), ("--dataloader-mode", "async")])
def test_batches_built_by_data_workers_train_the_same_passes(tmp_path, tmp_path_factory, monkeypatch, loading):
    """Hogwild with its batches built in data workers or by the async accessor: 51 examples, -nt 2 -bs 4 -ne 2
    shuffled: each process trains its shard once per pass, the same sequences as the main process builds."""
    plain, _ = _plain_passes(tmp_path_factory)
    loaded, train = _train(tmp_path, monkeypatch, EXAMPLES, *PASSES, *loading)
    shards = _ranked(loaded, 2)
    _assert_each_pass_trains_the_shard_once(shards)
    assert shards == plain
    assert train["exs"] == 2 * EXAMPLES and train["epochs"] == 2.0


def test_shard_passes_serve_each_pass_in_its_epoch_order_and_restore_the_pass():
    """ShardPasses by hand: 5 one-turn episodes, 2 rows: 3 steps a pass (the last with 1 real row), pass p in
    ShuffledOrder's epoch p; a position taken in pass 1 restores to pass 1."""
    table = EpisodeTable.of_lengths([1] * 5)
    order = ShuffledOrder(5, seed=3)

    def make() -> ShardPasses:
        return ShardPasses(table, 2, order, pad=-1, gather=lambda block: (block,))

    feed = make()
    served = []
    for _ in range(6):
        rows, real = feed.step()
        served.append([int(i) for i in rows if i >= 0])
        assert real == len(served[-1])
    passes = [sum(served[:3], []), sum(served[3:], [])]
    for p, seen in enumerate(passes):  # rows take stream positions 0, 2, 4 and 1, 3
        want = order(p)
        assert sorted(seen) == list(range(5)) and seen == [want[0], want[1], want[2], want[3], want[4]]
    assert [len(s) for s in served] == [2, 2, 1, 2, 2, 1]
    assert feed.position()[:4] == (2, 0, 3, 5)  # a pass served: the next one's step 0
    feed = make()
    for _ in range(4):
        feed.step()
    assert feed.position()[:4] == (1, 1, 3, 5)
    restored = make()
    restored.load_state_dict(json.loads(json.dumps(feed.state_dict())))
    assert restored.position()[:4] == (1, 1, 3, 5)
    assert [int(i) for i in restored.step()[0]] == [int(i) for i in feed.step()[0]]
    restored.rewind()
    assert restored.position()[:4] == (0, 0, 3, 5) and np.array_equal(restored.step()[0], make().step()[0])


def test_shard_passes_of_episodes_of_several_turns_serve_every_turn_once_a_pass():
    """Episodes of 3, 1, 2, 1 and 1 turns in 2 rows: a pass's steps are its longest row's turns (they vary with
    the pass's order); each pass serves every turn once, each episode's turns in order in one row."""
    table = EpisodeTable.of_lengths([3, 1, 2, 1, 1])
    order = ShuffledOrder(5, seed=1)
    feed = ShardPasses(table, 2, order, pad=-1, gather=lambda block: (block,))
    for p in range(6):
        runs = [[int(e) for e in order(p)[row::2]] for row in (0, 1)]
        lengths = [sum(int(table.turns[e]) for e in run) for run in runs]
        assert feed.position()[:4] == (p, 0, max(lengths), 8)
        steps = [[int(i) for i in feed.step()[0]] for _ in range(max(lengths))]
        for row, run in enumerate(runs):
            want = [int(table.first[e]) + t for e in run for t in range(int(table.turns[e]))]
            assert [s[row] for s in steps] == want + [-1] * (max(lengths) - len(want))


def test_a_part_of_a_pass_is_measured_in_the_examples_served():
    """Rows serving episodes of several turns run out at different steps, so the last steps hold fewer
    examples: -ne 0.5 with -nt 2 trained 124 of 205 examples (0.605 epochs) where one process trains 104. The
    share at each step, and with steps released but not served yet, is the examples served over the pass's."""
    table = EpisodeTable.of_lengths([3, 1, 2, 1, 1, 4, 2, 1, 3])
    feed = ShardPasses(table, 3, ShuffledOrder(9, seed=2), pad=-1, gather=lambda block: (block,))
    start = feed.position()
    steps, served = start[2], 0
    assert start[3] == 18 and steps > 18 / 3  # rows of unequal lengths
    for k in range(steps):
        at = feed.position()
        assert pass_share(at) == pytest.approx(served / 18) == pytest.approx(pass_share(start, k))
        served += sum(1 for i in feed.step()[0] if i >= 0)
    assert served == 18 and pass_share(feed.position()) == 1.0 == pass_share(start, steps)
    assert pass_share((0, 2, 4, 8)) == 0.5  # a position without the rows' lengths: measured in steps


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(180)
def test_half_an_epoch_of_episodes_of_several_turns_is_half_the_examples(tmp_path):
    from accelbatch.cli import main

    turns = [1 + e % 3 for e in range(103)]  # 205 examples
    data = tmp_path / "train.txt"
    data.write_text("".join(f"text:e{e} t{t}\tlabels:l{t % 3}\tlabel_candidates:l0|l1|l2\tepisode_done:{t == n - 1}\n"
                            for e, n in enumerate(turns) for t in range(n)))
    report = tmp_path / "report.json"
    assert main(["train", "-t", f"parlai:{data}", "-m", "bag", "-nt", "2", "-bs", "4", "-ne", "0.5", "--no-progress",
                 "--eval-splits", "", "--report-json", str(report)]) == 0
    train = json.loads(report.read_text())["train"]
    assert abs(train["exs"] - 205 / 2) <= 2 * 4  # each process within a step of its half (it was 124)
    assert train["epochs"] == pytest.approx(train["exs"] / 205, abs=1e-3)
