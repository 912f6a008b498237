"""Multitask training draws each new episode's task uniformly (ParlAI's rule), so a pass of draws is not each
example once: hogwild processes (-nt) count -ne in examples trained, as one process does, whatever the tasks'
episode lengths; a process whose share holds no episode of a small task draws from the others; dynamic
batching draws the tasks by the same rule."""

from __future__ import annotations

import json

import numpy as np
import pytest

from accelbatch.cli import main
from accelbatch.data.episodes import EpisodeTable
from accelbatch.data.orders import MixedOrder, mixed_examples, permutation


def _files(tmp_path, short: int):
    """A task of 5-turn episodes (40 examples) and one of ``short`` 1-turn episodes."""
    long, one = tmp_path / "long.txt", tmp_path / "short.txt"
    long.write_text("".join(f"text:q{e} t{t}\tlabels:a{t % 2}\tlabel_candidates:a0|a1"
                            f"{chr(9) + 'episode_done:True' if t == 4 else ''}\n" for e in range(8) for t in range(5)))
    one.write_text("".join(f"text:only {i}\tlabels:x\tlabel_candidates:x|y\tepisode_done:True\n" for i in range(short)))
    return f"parlai:{long},parlai:{one}", 8 * 5 + short


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("short", [1, 4])  # 1: the second process's share holds none of that task
@pytest.mark.slow
def test_hogwild_counts_a_multitask_epoch_in_examples_as_one_process(tmp_path, short):
    task, examples = _files(tmp_path, short)
    reports = {}
    for name, extra in (("one", []), ("hogwild", ["-nt", "2"])):
        out = tmp_path / f"{name}.json"
        assert main(["train", "-t", task, "-m", "bag", "-esz", "8", "-bs", "2", "-ne", "3", "--eval-splits", "",
                     "--no-progress", "--report-json", str(out), *extra]) == 0
        reports[name] = json.loads(out.read_text())["train"]
    for name, train in reports.items():  # a pass of draws: as many draws as episodes
        assert 3 * examples <= train["exs"] <= 3 * examples + 2 * 2, (name, train)
        assert train["epochs"] == pytest.approx(train["exs"] / examples, abs=1e-3), (name, train)


def test_mixed_order_draws_only_the_tasks_a_share_holds():
    order = MixedOrder([4, 0, 3], seed=5)
    for epoch in range(3):
        drawn = order(epoch)
        assert len(drawn) == 7 and set(drawn.tolist()) <= set(range(7))
    # with every task present the draws are numpy's uniform integers of the seed, as before
    full = MixedOrder([4, 2], seed=5)(0)
    choices = np.random.default_rng([5, 7919, 0]).integers(0, 2, size=6)
    expect, served = [], [0, 0]
    for task in choices.tolist():
        size, start = (4, 0) if task == 0 else (2, 4)
        expect.append(start + int(permutation(size, 5, task, served[task] // size)[served[task] % size]))
        served[task] += 1
    assert full.tolist() == expect


def _task_shares(report: dict) -> float:
    """The short task's share of the examples trained."""
    counts = {key.rsplit("/", 1)[0]: value for key, value in report.items() if key.endswith("/exs")}
    (short,) = [n for task, n in counts.items() if "short" in task]
    return short / sum(counts.values())


def test_dynamic_batching_draws_the_tasks_as_the_other_feeds_do(tmp_path):
    """Each new episode's task is drawn uniformly: 1-turn episodes against 5-turn ones make 1/6 of the examples
    (in proportion to the tasks' sizes they would be 4/44), with or without dynamic batching."""
    task, _ = _files(tmp_path, 4)
    for extra in ([], ["--dynamic-batching", "full"]):
        out = tmp_path / "r.json"
        assert main(["train", "-t", task, "-m", "bag", "-esz", "8", "-bs", "4", "-ne", "40", "--eval-splits", "",
                     "--no-progress", "--report-json", str(out), *extra]) == 0
        assert _task_shares(json.loads(out.read_text())["train"]) == pytest.approx(1 / 6, abs=0.03), extra


def test_a_dynamic_batching_epoch_of_multitask_draws_holds_the_datas_number_of_examples():
    table = EpisodeTable.of_lengths([5] * 8 + [1] * 4 + [2] * 3, tasks=(8, 4, 3))
    assert mixed_examples(table, 3, 0, 0).tolist() == mixed_examples(table, 3, 0, 0).tolist()  # the seed's, the epoch's
    for epoch in range(5):
        drawn = mixed_examples(table, 3, epoch, 0)
        assert len(drawn) == table.num_examples and 0 <= drawn.min() and drawn.max() < table.num_examples
    assert mixed_examples(table, 3, 0, 0).tolist() != mixed_examples(table, 3, 1, 0).tolist()
    empty = EpisodeTable.of_lengths([5] * 8 + [2] * 3, tasks=(8, 0, 3))  # a share without the middle task
    assert len(mixed_examples(empty, 3, 0, 0)) == empty.num_examples


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("batching", [[], ["--dynamic-batching", "full"]])
def test_hogwild_processes_draw_a_task_of_fewer_episodes_than_processes_as_one_process(tmp_path, batching):
    """A 1-episode task under -nt 2: each process draws it (the share one process gives it: 1/6 of the
    examples), not only the process whose share of the episodes holds it (1/12)."""
    task, _ = _files(tmp_path, 1)
    out = tmp_path / "r.json"
    assert main(["train", "-t", task, "-m", "bag", "-esz", "8", "-bs", "4", "-ne", "30", "-nt", "2", "--eval-splits",
                 "", "--no-progress", "--report-json", str(out), *batching]) == 0
    assert _task_shares(json.loads(out.read_text())["train"]) == pytest.approx(1 / 6, abs=0.04)


def test_weights_near_the_float_maximum_draw_in_their_proportions():
    """-mtw 1e308,1e308,1: each weight finite, their sum inf, and numpy refused the probabilities (a traceback);
    drawn as the same proportions scaled down are."""
    from accelbatch.data.orders import draw_tasks

    huge = draw_tasks([3, 3, 3], [1e308, 1e308, 1.0], 2000, np.random.default_rng(0))
    small = draw_tasks([3, 3, 3], [1.0, 1.0, 1e-308], 2000, np.random.default_rng(0))
    assert huge.tolist() == small.tolist() and set(huge.tolist()) == {0, 1}


@pytest.mark.parametrize("extra", [[], ["-dynb", "batchsort"]])
def test_ordered_multitask_training_serves_one_episode_of_each_task_in_turn(tmp_path, extra):
    """ParlAI's MultiTaskTeacher in order: A0 B0 A1 B1 A2 B2 B3 (a task done is passed over); it trained all of A
    before B. One record a step at -bs 1 names the task it served."""
    for name, n in (("a", 3), ("b", 4)):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(
            {"text": f"{name} {i}", "labels": ["x"], "label_candidates": ["x", "y"], "episode_done": True}) + "\n"
            for i in range(n)))
    log = tmp_path / "log.jsonl"
    tasks = [f"jsonl:{tmp_path / n}.jsonl" for n in ("a", "b")]
    assert main(["train", "-t", ",".join(tasks), "-dt", "train:ordered", "-m", "bag", "-esz", "8", "-bs", "1",
                 "-ne", "1", "-ltim", "0", "--metrics-log", str(log), "-veps", "-1", "--eval-splits", "",
                 "--no-progress", *extra]) == 0
    records = [json.loads(line) for line in log.read_text().splitlines()]
    served = ["ab"[[r.get(f"{t}/exs", 0) for t in tasks].index(1)] for r in records if r["split"] == "train"]
    assert "".join(served) == "abababb"
