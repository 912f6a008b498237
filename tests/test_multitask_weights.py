"""ParlAI's -mtw/--multitask-weights: multitask training draws each new episode's task in proportion to the
weights (missing ones 1; 'stochastic': by each task's episodes); bad weights are one line naming the option."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import RecordingAgent, list_teacher, sigint_at_batch

from accelbatch.cli import main
from accelbatch.data.orders import draw_tasks
from accelbatch.multi_world import MultiWorld
from accelbatch.opts import OptionError, Opts
from accelbatch.task_weights import task_weights
from accelbatch.worlds import DialogPartnerWorld


def test_equal_weights_draw_as_the_uniform_rule_and_others_in_their_proportions():
    gen = np.random.default_rng([0, 7919, 0])
    uniform = np.flatnonzero(np.array([4, 0, 6]) > 0)[gen.integers(0, 2, size=1000)]  # the rule without -mtw
    assert np.array_equal(draw_tasks([4, 0, 6], (), 1000, np.random.default_rng([0, 7919, 0])), uniform)
    drawn = draw_tasks([5, 5, 5], (1.0, 3.0, 0.0), 40_000, np.random.default_rng(1))
    counts = np.bincount(drawn, minlength=3)
    assert counts[2] == 0 and abs(counts[1] / 40_000 - 0.75) < 0.01, counts  # 3 of every 4 draws


@pytest.mark.parametrize("spec, episodes, weights", [
    ("1", [3, 9], ()), ("2,2", [3, 9], ()), ("1,3", [3, 9], (1.0, 3.0)), ("0.5", [3, 9, 4], (0.5, 1.0, 1.0)),
    ("stochastic", [3, 9], (3.0, 9.0)), ("stochastic", [5, 5], ())])
def test_weights_given_missing_and_stochastic(spec, episodes, weights):
    assert task_weights(spec, episodes) == weights  # missing: 1 (ParlAI's); all equal: the uniform draw


@pytest.mark.parametrize("spec, said", [
    ("1,x", "give comma-separated numbers"), ("-1,2", "0 or more"), ("0,0", "at least one above 0"),
    ("1,nan", "finite"), ("1,2,3", "3 weights for the 2 tasks of -t")])
def test_bad_weights_are_one_line_naming_the_option(tmp_path, capsys, spec, said):
    data = _tasks(tmp_path)
    assert main(["train", "-t", data, "-m", "repeat_label", "-tstep", "1", f"-mtw={spec}", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"accelbatch: error: -mtw/--multitask-weights {spec}: ") \
        and said in err[0], err
    if "tasks of -t" not in said:  # a value that is no weight is refused with the other options
        with pytest.raises(OptionError, match=said):
            Opts(multitask_weights=spec)


def _tasks(tmp_path, sizes=(10, 30)) -> str:
    """Two JSONL tasks of one-turn episodes: A's reply x, B's y."""
    names = []
    for name, size in zip("AB", sizes):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{name}{i}", "labels": ["x" if name == "A" else "y"],
                                            "label_candidates": ["x", "y"]}) + "\n" for i in range(size)))
        names.append(f"jsonl:{path}")
    return ",".join(names)


def _train(tmp_path, data, *extra) -> dict:
    report = tmp_path / "report.json"
    assert main(["train", "-t", data, "-m", "bag", "-bs", "2", "-ne", "2", "--eval-splits", "", "-veps", "-1",
                 "--no-progress", "--report-json", str(report), *extra]) == 0
    return json.loads(report.read_text())["train"]


@pytest.mark.slow
def test_a_task_of_weight_0_is_never_trained_and_stochastic_is_by_episodes(tmp_path):
    data = _tasks(tmp_path)
    a, b = (f"{t}/exs" for t in data.split(","))
    only_b = _train(tmp_path, data, "-mtw", "0,1")
    assert (only_b[a], only_b[b]) == (0, only_b["exs"]) and only_b["exs"] == 2 * 40
    uniform = _train(tmp_path, data)
    by_episodes, one_to_three = _train(tmp_path, data, "-mtw", "stochastic"), _train(tmp_path, data, "-mtw", "1,3")
    assert by_episodes == {**one_to_three, "exs_per_s": by_episodes["exs_per_s"], "time_s": by_episodes["time_s"]}
    assert by_episodes[a] < uniform[a]  # 10 episodes against 30: A drawn a quarter of the time, not half


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_weighted_draws_are_the_same_with_data_workers(tmp_path):
    """A performance option never changes results: the batched front end's workers draw the same tasks."""
    data = _tasks(tmp_path)
    plain = _train(tmp_path, data, "-mtw", "1,3", "--dynamic-batching", "full")
    workers = _train(tmp_path, data, "-mtw", "1,3", "--dynamic-batching", "full", "--num-workers", "1")
    assert workers == {**plain, "exs_per_s": workers["exs_per_s"], "time_s": workers["time_s"]}


def test_a_resume_with_other_weights_is_refused_naming_them(tmp_path, capsys):
    data, model_file = _tasks(tmp_path), str(tmp_path / "m.pt")
    assert main(["train", "-t", data, "-m", "bag", "-tstep", "2", "-mtw", "1,3", "-mf", model_file, "--no-progress",
                 "--eval-splits", "", "-veps", "-1"]) == 0
    capsys.readouterr()
    assert main(["train", "-mf", model_file, "--resume", "-mtw", "1,2", "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "-mtw/--multitask-weights '1,2' (checkpoint: '1,3')" in err[0], err


def test_a_multiworld_draws_by_the_weights(tmp_path):
    """Tasks whose teachers are combined by a MultiWorld (not all FixedTeachers) are drawn by -mtw too."""
    opts = Opts(datatype="train", seed=0, multitask_weights="0,1")
    agent = RecordingAgent(opts)
    worlds = [DialogPartnerWorld(opts, [list_teacher([1] * 4)(opts), agent]) for _ in range(2)]
    world = MultiWorld(opts, worlds, ["t0", "t1"])
    for _ in range(20):
        world.parley()
    report = world.report()
    assert report.get("t0/exs", 0) == 0 and report["t1/exs"] == 20, report


@pytest.mark.parametrize("verb", ["eval", "display-data"])
def test_verbs_that_draw_no_task_refuse_the_weights(capsys, verb):
    """eval serves each task's examples once and display-data each task's in turn: -mtw is a training option."""
    model = ["-m", "repeat_label"] if verb == "eval" else []  # display-data builds no model
    assert main([verb, "-t", "babi:1,babi:2", "-mtw", "1,3", *model]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("accelbatch: error: -mtw/--multitask-weights: a training option"), err


@pytest.mark.timeout(120)
def test_a_resume_given_no_task_keeps_one_train_row_per_task(tmp_path, monkeypatch):
    """Tasks given as relative paths and resumed with -mf alone (the checkpoint's -t, made absolute): the rows of
    the part before the stop were kept under the names typed, beside the resumed part's, four rows for two tasks
    and a train accuracy averaged over the four."""
    import accelbatch as ab
    from accelbatch.models.bag import BagAgent

    monkeypatch.chdir(tmp_path)
    _tasks(tmp_path)
    opts = ab.Opts(task="jsonl:A.jsonl,jsonl:B.jsonl", model="bag", batchsize=2, max_train_steps=30, seed=1,
                   model_file=str(tmp_path / "m.pt"), validation_every_n_epochs=-1, eval_splits="", progress=False,
                   multitask_weights="1,3")
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        ab.run(ab.create_world(opts, agent=sigint_at_batch(BagAgent, 12)), opts)
    assert main(["train", "-mf", str(tmp_path / "m.pt"), "--resume", "--no-progress", "--report-json", "r.json"]) == 0
    train = json.loads((tmp_path / "r.json").read_text())["train"]
    rows = sorted(key[:-len("/exs")] for key in train if key.endswith("/exs"))
    assert rows == [f"jsonl:{tmp_path / 'A.jsonl'}", f"jsonl:{tmp_path / 'B.jsonl'}"], rows
    assert sum(train[f"{row}/exs"] for row in rows) == train["exs"] == 60
    assert train["accuracy"] == pytest.approx(sum(train[f"{row}/accuracy"] for row in rows) / 2)


def test_a_resume_takes_weights_written_otherwise_as_the_same():
    """1,3.0 and 1,3,1 draw as 1,3 (missing weights are 1): a resume compares the weights, not their text."""
    from accelbatch import checkpoint as ck

    saved = Opts(task="babi:1,babi:2", multitask_weights="1,3")
    checkpoint = ck.Checkpoint(path="x.ckpt", model_state={}, opts=saved.to_dict())
    for same in ("1,3.0", "1,3,1", " 1, 3"):
        ck.check_resumable(checkpoint, saved.replace(multitask_weights=same))
    for other in ("3,1", "1,2", "stochastic"):
        with pytest.raises(ck.CheckpointError, match="-mtw/--multitask-weights"):
            ck.check_resumable(checkpoint, saved.replace(multitask_weights=other))
