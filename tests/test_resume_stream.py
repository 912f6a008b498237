"""Exact resume of streamed data (``-dt train:stream``) and of two tasks through the loader.

A streamed file is served through its index by the same schedule as data in memory, so its position is
the same: the steps the world has consumed (not those read ahead by the workers or the accessor).
In-process: every cut of the loader continues the uninterrupted batch sequence, and a position carries over
to other performance options but not to other data. Through the CLI: a run SIGKILLed at a random moment after
its first checkpoint, then resumed, trains exactly the batches of an uninterrupted run (each epoch a
permutation of the data, nothing repeated or lost) and ends with the same weights; no process of either run
is left behind.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import uuid

import pytest
import torch
from helpers import live_children, wait_for_first_checkpoint, write_qa_episodes
from test_resume_loader import ENV, _assert_no_process_left, _weights

from accelbatch.checkpoint import load_checkpoint
from accelbatch.data import make_loader
from accelbatch.models.memnn import MemNNAgent
from accelbatch.state import unsupported

TESTS = os.path.dirname(os.path.abspath(__file__))
LOG_VAR = "ACCELBATCH_TEST_TRAINED"


class RecordingMemNN(MemNNAgent):
    """``-m test_resume_stream:RecordingMemNN``: memnn that appends each trained batch's texts (one JSON
    line per step) to the file named by $ACCELBATCH_TEST_TRAINED."""

    def step(self, observations, batch):
        out = super().step(observations, batch)
        path = os.environ.get(LOG_VAR)
        if path and any("labels" in obs for obs in observations):
            with open(path, "a") as handle:
                handle.write(json.dumps([obs["text"] for obs in observations]) + "\n")
        return out


# --------------------------------------------------------------------------------------------------
# the loader, in process
# --------------------------------------------------------------------------------------------------

def _stream_file(path, n=45):
    rng = random.Random(3)
    with open(path, "w") as handle:
        for i in range(n):
            handle.write(json.dumps({"text": "w " * rng.randint(1, 9) + f"q{i}", "labels": ["a"],
                                     "episode_done": True}) + "\n")
    return str(path)


def _ids(batch):
    return tuple(batch.ids)


def _take(loader, count):
    """The first ``count`` batches' ids, across epochs (leaves the loader mid-pass, as a kill would)."""
    got = []
    while len(got) < count:
        for batch in loader:
            got.append(_ids(batch))
            if len(got) == count:
                break
    return got


# (mode, workers, strategy)
LOADER_CASES = {"sync-W0": ("sync", 0, "batchsort"), "async-W2": ("async", 2, "batchsort"),
                "rebatched-W2": ("async-rebatched", 2, "batchsort"), "sync-W3-none": ("sync", 3, "none")}


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
@pytest.mark.filterwarnings("ignore:This DataLoader will create")  # 3 workers on a 2-core machine
@pytest.mark.parametrize("case", list(LOADER_CASES))
def test_every_cut_of_a_stream_continues_the_same_batches(tmp_path, case):
    mode, workers, strategy = LOADER_CASES[case]
    path = _stream_file(tmp_path / "s.jsonl")
    kw = dict(batch_size=4, dynamic_batching=strategy, batch_sort_cache_size=12, seed=5, mode=mode,
              num_workers=workers, buffer_size=3)
    with make_loader(path, **kw) as loader:
        epochs = [[_ids(b) for b in loader] for _ in range(2)]
    if strategy != "none":  # a pass of a batch plan is an epoch: every example once, the partial batch dropped
        for epoch in epochs:
            ids = [i for b in epoch for i in b]
            assert len(set(ids)) == len(ids) == 44 and set(ids) <= set(range(45))
    flat = epochs[0] + epochs[1]
    cuts = [1, len(epochs[0]), len(epochs[0]) - 1, random.Random().randrange(2, len(flat) - 1)]
    for cut in cuts:
        with make_loader(path, **kw) as loader:
            got = _take(loader, cut)
            position = json.loads(json.dumps(loader.state_dict()))  # what a checkpoint keeps
        with make_loader(path, **kw) as loader:
            loader.load_state_dict(position)
            assert loader.state_dict() == position
            while len(got) < len(flat):
                got += [_ids(b) for b in loader]
        assert got == flat, (cut, position)
    assert not live_children()


@pytest.mark.multiprocess
def test_a_position_carries_over_to_other_performance_options_but_not_to_other_data(tmp_path):
    path = _stream_file(tmp_path / "s.jsonl")
    with make_loader(path, batch_size=4) as loader:
        reference = _take(loader, 6)
    with make_loader(path, batch_size=4) as loader:
        _take(loader, 2)
        position = loader.state_dict()
    assert position["pass"] == 0 and position["steps"] == 2
    msgs = [json.loads(line) for line in open(path)]
    for data, changes in ((path, dict(num_workers=2)), (path, dict(mode="async")), (msgs, {})):
        with make_loader(data, batch_size=4, **changes) as loader:
            loader.load_state_dict(position)
            assert _take(loader, 4) == reference[2:], changes
    with open(path, "a") as handle:
        handle.write(json.dumps({"text": "new", "labels": ["a"]}) + "\n")
    with make_loader(path, batch_size=4) as loader:
        with pytest.raises(ValueError, match="other data"):
            loader.load_state_dict(position)


# --------------------------------------------------------------------------------------------------
# kill and resume through the CLI
# --------------------------------------------------------------------------------------------------

# (--dataloader-mode, --num-workers, tasks): two streamed tasks are one LoaderWorld of both tasks' episodes
CLI_CASES = {"sync-W2": ("sync", "2", 1), "async": ("async", "0", 1),
             "rebatched-multi-task": ("async-rebatched", "1", 2)}


def _data(root, tasks):
    """One QA file per task; the second task's texts are made distinct ("b: ...")."""
    write_qa_episodes(root / "a", episodes=24, filler=True)
    if tasks == 2:
        write_qa_episodes(root / "b", episodes=15, filler=True)
        path = root / "b" / "data" / "train.jsonl"
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "text": "b: " + r["text"]}) + "\n" for r in rows))
    return [root / t / "data" / "train.jsonl" for t in "ab"[:tasks]]


def _command(files, model_file, case, *extra):
    mode, workers, _ = CLI_CASES[case]
    task = ",".join(f"jsonl:{f.parent}" for f in files)
    return [sys.executable, "-m", "accelbatch", "train", "-t", task, "-dt", "train:stream", "-m",
            "test_resume_stream:RecordingMemNN", "-bs", "3", "-ne", "2", "-veps", "-1", "--eval-splits", "",
            "--no-progress", "-ltim", "-1", "--dynamic-batching", "batchsort", "--dataloader-mode", mode,
            "--num-workers", workers, "-mf", str(model_file), *extra]


def _env(tag, log):
    path = os.pathsep.join([TESTS, ENV.get("PYTHONPATH", "")])
    return {**ENV, "ACCELBATCH_TEST_TAG": tag, LOG_VAR: str(log), "PYTHONPATH": path}


def _run(cmd, env):
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _trained(log, steps=None):
    """The batches a run logged (the first ``steps``); a line cut by SIGKILL is past them."""
    lines = log.read_text().splitlines() if log.exists() else []
    return [json.loads(line) for line in lines[:steps]]


def _texts(path):
    return [json.loads(line)["text"] for line in path.read_text().splitlines()]


def _kill_after_first_checkpoint(proc, model):
    wait_for_first_checkpoint(proc, model, max_delay_s=0.3)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]  # cut while training, not after it


def _assert_clean_first_epochs(batches, files, batch_size=3):
    """Each task's first epoch in ``batches`` holds each of its examples at most once, and all of them but
    the few of a partial batch (dropped in training, --drop-last)."""
    turns = [text.split("\n")[-1] for batch in batches for text in batch]  # squashed: the turn is last
    for path in files:
        mine = _texts(path)
        assert len(set(mine)) == len(mine)
        full = len(mine) - len(mine) % batch_size
        first = [t for t in turns if t in set(mine)][:full]
        assert len(set(first)) == len(first) == full, path


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CLI_CASES))
def test_a_killed_stream_run_resumes_to_the_same_batches_and_weights(tmp_path, case):
    files = _data(tmp_path, CLI_CASES[case][2])
    tag = uuid.uuid4().hex
    ref_model, ref_log = tmp_path / "ref" / "model.pt", tmp_path / "ref.log"
    cut_model, cut_log = tmp_path / "cut" / "model.pt", tmp_path / "cut.log"
    # the reference and the run to cut go side by side (they share nothing but the data files)
    reference = subprocess.Popen(_command(files, ref_model, case), env=_env(tag, ref_log),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    cut = subprocess.Popen(_command(files, cut_model, case, "--save-every-n-secs", "0.01"),
                           env=_env(tag, cut_log), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _kill_after_first_checkpoint(cut, tmp_path / "cut" / "model.pt")
        _, ref_err = reference.communicate(timeout=240)
        assert reference.returncode == 0, ref_err[-3000:]
    finally:
        for proc in (reference, cut):
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    _assert_no_process_left(tag)  # the accessor and data workers go when their consumer dies

    ckpt = load_checkpoint(str(cut_model))
    steps = ckpt.state["train"]["steps"]
    (position,) = ckpt.data
    assert steps > 0 and unsupported(position) == [] and set(position["loader"]) == {"pass", "steps", "digest"}
    before = _trained(cut_log, steps)  # batches trained after the checkpoint are trained again
    assert len(before) == steps

    resumed_log = tmp_path / "resumed.log"
    resumed = _run(_command(files, cut_model, case, "--resume"), _env(tag, resumed_log))
    assert "not restored" not in resumed.stderr
    _assert_no_process_left(tag)
    assert not live_children()

    expected = _trained(ref_log)
    assert before + _trained(resumed_log) == expected, (steps, position)
    if len(files) == 1:  # several tasks' epochs are ParlAI's draws by task (tests/test_multitask_passes.py)
        _assert_clean_first_epochs(expected, files)
    ref, now = _weights(ref_model), _weights(cut_model)
    assert ref.keys() == now.keys()
    for key in ref:
        assert torch.equal(ref[key], now[key]), (key, steps, position)
