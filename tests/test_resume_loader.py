"""Resume through the data loader (LoaderWorld): SIGKILL a run at a random moment, --resume, same weights.

The loader's position is the steps the world has *consumed* (not those prefetched by the data workers or
the async accessor); a resume lays the schedule out again from that step (the plan is a function of the seed
and the pass). Checked for the sync, async and async-rebatched modes with dynamic batching, and that no process
of a killed or finished run (accessor, data workers, forkserver) is left behind.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import uuid

import pytest
import torch
from helpers import wait_for_first_checkpoint, write_qa_episodes
from shared_runs import shared_dir

from accelbatch.checkpoint import load_checkpoint
from accelbatch.data import make_loader
from accelbatch.messages import Message
from accelbatch.state import unsupported

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
MODES = {"sync": ("sync", "0"), "async": ("async", "0"), "async-rebatched": ("async-rebatched", "1"),
         "async-R2": ("async", "0", "-rf", "2", "-bs", "6")}
REFERENCES = {"async": "sync", "async-rebatched": "sync", "async-R2": "sync-R2"}  # a loading mode changes nothing
SETTINGS = {**MODES, "sync-R2": ("sync", "0", "-rf", "2", "-bs", "6")}


def _dataset(root):
    write_qa_episodes(root, filler=True)


def _command(root, model_file, setting, *extra):
    mode, workers, *more = SETTINGS[setting]
    return [sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{root}/data", "-m", "memnn", "-bs", "3",
            "-ne", "3", "-veps", "-1", "--eval-splits", "", "--no-progress", "-ltim", "-1",
            "--dynamic-batching", "batchsort", "--dataloader-mode", mode, "--num-workers", workers, *more,
            "-mf", str(model_file), *extra]


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def _tagged_pids(tag):
    """Processes (other than zombies) whose environment holds ``tag``: the run and all its descendants."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if tag.encode() not in f.read():
                    continue
            with open(f"/proc/{pid}/stat") as f:
                if f.read().split(") ", 1)[1].startswith("Z"):
                    continue
        except OSError:
            continue
        out.append(int(pid))
    return out


def _assert_no_process_left(tag, within=15.0):
    deadline = time.monotonic() + within
    while _tagged_pids(tag) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _tagged_pids(tag)
    for pid in left:  # do not leave them to other tests, but fail
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    assert not left, f"processes left behind by the run: {left}"


def _run(cmd, tag, timeout=240):
    done = subprocess.run(cmd, env={**ENV, "ACCELBATCH_TEST_TAG": tag}, capture_output=True, text=True,
                          timeout=timeout)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _reference(factory, setting):
    """(the data's root, the model file of an uninterrupted run of ``setting`` on it), once per session (the
    killed async run and the deterministic cuts resume to the same run). The async modes' reference is the
    sync run's: a loading mode never changes results, so each resumes to the weights of the plain run."""
    setting = REFERENCES.get(setting, setting)
    root = shared_dir(factory, "test_resume_loader qa-episodes filler", _dataset)

    def build(folder):
        tag = uuid.uuid4().hex
        _run(_command(root, folder / "model.pt", setting), tag)
        _assert_no_process_left(tag)
    return root, shared_dir(factory, f"test_resume_loader reference {root} {setting}", build) / "model.pt"


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("setting", list(MODES))
def test_killed_loader_run_resumes_to_the_same_weights(tmp_path, tmp_path_factory, setting):
    root, reference = _reference(tmp_path_factory, setting)
    tag = uuid.uuid4().hex

    model = tmp_path / "cut" / "model.pt"
    proc = subprocess.Popen(_command(root, model, setting, "--save-every-n-secs", "0.01"),
                            env={**ENV, "ACCELBATCH_TEST_TAG": tag}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    wait_for_first_checkpoint(proc, model, max_delay_s=0.5)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL, err[-2000:]  # cut while training, not after it
    _assert_no_process_left(tag)  # the accessor and data workers go when their consumer dies

    ckpt = load_checkpoint(str(model))
    assert ckpt.state["train"]["steps"] > 0
    assert len(ckpt.data) == (2 if "-rf" in MODES[setting] else 1)  # one position per replica
    for position in ckpt.data:
        assert unsupported(position) == [] and set(position["loader"]) == {"pass", "steps", "digest"}

    resumed = _run(_command(root, model, setting, "--resume"), tag)
    assert "not restored" not in resumed.stderr
    _assert_no_process_left(tag)
    ref, got = _weights(reference), _weights(model)
    assert ref.keys() == got.keys()
    for key in ref:  # on failure: where the run was cut, and what the resumed run said
        assert torch.equal(ref[key], got[key]), (key, ckpt.state["train"], ckpt.data, resumed.stderr[-2000:])


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_mismatched_loader_position_is_refused(tmp_path):
    """A position from another plan (here: another --batchsize) is refused with a clear message."""
    _dataset(tmp_path)
    model = tmp_path / "m" / "model.pt"
    base = ["-bs", "3", "-tstep", "4", "--save-every-n-secs", "0.001", "--eval-splits", "", "-veps", "-1",
            "--no-progress", "--dynamic-batching", "batchsort", "-mf", str(model)]
    tag = uuid.uuid4().hex
    _run([sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{tmp_path}/data", *base], tag)
    state = next((tmp_path / "m" / "model.pt.ckpt").glob("gen-*")) / "state.json"
    ckpt = load_checkpoint(str(model))
    assert ckpt.data[0]["loader"]["steps"] == 4 and ckpt.data[0]["total_exs"] == 12
    # the loader itself refuses a position of another plan
    msgs = [Message({"text": f"q {i}", "labels": ["a"], "episode_done": True}) for i in range(20)]
    with make_loader(msgs, batch_size=3, dynamic_batching="batchsort") as loader:
        with pytest.raises(ValueError, match="differ from this run"):
            loader.load_state_dict(ckpt.data[0]["loader"])
        with pytest.raises(ValueError, match="differ from this run"):
            loader.load_state_dict({"pass": 0, "steps": 99, "digest": "x"})
    assert state.exists()


@pytest.mark.multiprocess
def test_loader_position_counts_consumed_batches_not_prefetched_ones():
    msgs = [Message({"text": "w " * (i % 7 + 1), "labels": ["a"], "episode_done": True}) for i in range(50)]
    kw = dict(batch_size=4, dynamic_batching="batchsort", seed=5, mode="async", buffer_size=4)
    with make_loader(msgs, **kw) as loader:
        epochs = [[tuple(b.ids) for b in loader] for _ in range(2)]
        assert loader.state_dict()["pass"] == 2
    flat = epochs[0] + epochs[1]
    for cut in (0, 1, len(epochs[0]) - 1, len(epochs[0]), len(epochs[0]) + 2):
        with make_loader(msgs, **kw) as loader:
            got = []
            while len(got) < cut:
                it = iter(loader)
                for batch in it:
                    got.append(tuple(batch.ids))
                    if len(got) == cut:
                        break
            if cut == len(epochs[0]):  # a whole epoch consumed: position is the next epoch's start
                time.sleep(0.2)
            position = loader.state_dict()
            # 4 batches are buffered ahead by the accessor: the position ignores them
            assert position["pass"] * len(epochs[0]) + position["steps"] == cut
        with make_loader(msgs, **kw) as loader:
            loader.load_state_dict(position)
            while len(got) < len(flat):
                got += [tuple(b.ids) for b in loader]
        assert got == flat


@pytest.mark.multiprocess
@pytest.mark.slow
def test_a_stream_checkpoint_holds_its_position_and_resumes_without_warning(tmp_path):
    """Streams resume exactly too (tests/test_resume_stream.py); here: -tstep cut, no warning at --resume."""
    _dataset(tmp_path)
    model, tag = tmp_path / "m" / "model.pt", uuid.uuid4().hex
    base = [sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{tmp_path}/data/train.jsonl", "-dt",
            "train:stream", "-bs", "3", "--eval-splits", "", "-veps", "-1", "--no-progress", "-mf", str(model)]
    _run([*base, "-tstep", "3", "--save-every-n-secs", "1000"], tag)
    (position,) = load_checkpoint(str(model)).data
    assert unsupported(position) == [] and position["world"]["teacher"]["row_steps"] == [3, 3, 3]
    resumed = _run([*base, "-tstep", "6", "--save-every-n-secs", "1000", "--resume"], tag)
    assert "not restored" not in resumed.stderr
    assert load_checkpoint(str(model)).state["train"]["steps"] == 6


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_stopping_at_an_epoch_boundary_and_mid_epoch_resumes_exactly(tmp_path, tmp_path_factory):
    """Deterministic cuts (-tstep, final checkpoint) with the async loader: mid-epoch, and right after the
    last batch of an epoch (the position is then the next epoch's start, while the accessor has already
    loaded ahead into it); each resumed to the end of the uninterrupted run (-ne 3)."""
    root, reference = _reference(tmp_path_factory, "async")
    tag = uuid.uuid4().hex
    end = ["-tstep", "-1"]  # no step limit (the cut runs' -tstep is kept by --resume unless given): -ne 3
    mid = tmp_path / "mid" / "model.pt"
    _run(_command(root, mid, "async", "-tstep", "40", "--save-every-n-secs", "1000"), tag)
    position = load_checkpoint(str(mid)).data[0]["loader"]
    assert position["pass"] == 1 and 0 < position["steps"] < 40
    per_epoch = 40 - position["steps"]
    edge = tmp_path / "edge" / "model.pt"
    _run(_command(root, edge, "async", "-tstep", str(per_epoch), "--save-every-n-secs", "1000"), tag)
    assert load_checkpoint(str(edge)).data[0]["loader"]["pass"] == 1
    assert load_checkpoint(str(edge)).data[0]["loader"]["steps"] == 0
    ref = _weights(reference)
    for model in (mid, edge):
        _run(_command(root, model, "async", "--resume", *end), tag)
        got = _weights(model)
        for key in ref:
            assert torch.equal(ref[key], got[key]), (model, key)
    _assert_no_process_left(tag)
