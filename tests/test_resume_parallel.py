"""Kill a parallel training run (SIGKILL of the parent, at a random moment) and --resume.

* ``-rf 2`` (two gloo replicas spawned by the CLI, each on its own shard): the resumed run ends with
  weights equal (torch.equal) to an uninterrupted ``-rf 2`` run, and no replica outlives the killed parent
  for long (torch.multiprocessing sets PR_SET_PDEATHSIG=SIGINT in each replica; the run loop's StopSignals
  turns that into one last collective checkpoint and a clean exit, so the resume may start from it).
* ``-nt 2`` (hogwild): weights differ from run to run, so the test checks the data position instead: the
  examples trained on after the resume, together with those trained on before the last checkpoint, are
  every example of the interrupted epoch exactly once.
"""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from accelbatch.checkpoint import load_checkpoint

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _dataset(root, episodes=40):
    rng = random.Random(1)
    os.makedirs(root / "data")
    answers = ["red", "blue", "green", "kitchen", "garden"]
    with open(root / "data" / "train.jsonl", "w") as handle:
        for e in range(episodes):
            n = rng.randint(1, 4)
            for i in range(n):
                a = rng.choice(answers)
                handle.write(json.dumps({"text": f"ep {e} turn {i} where is the {a} thing", "labels": [a],
                                         "label_candidates": answers, "episode_done": i == n - 1}) + "\n")


def _command(root, model_file, *extra):
    return [sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{root}/data", "-m", "memnn", "-bs", "3",
            "-ne", "2", "-veps", "-1", "--eval-splits", "", "--no-progress", "-ltim", "1000",
            "-mf", str(model_file), *extra]


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def _descendants(pid):
    """Every live descendant of ``pid`` (from /proc)."""
    parents = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                stat = handle.read()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()
        parents[int(entry)] = int(fields[1])
    out, frontier = [], [pid]
    while frontier:
        current = frontier.pop()
        children = [p for p, parent in parents.items() if parent == current]
        out.extend(children)
        frontier.extend(children)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as handle:
            stat = handle.read()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2:].split()[0] != "Z"


def _wait_gone(pids, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if _alive(p)]
        if not alive:
            return []
        time.sleep(0.1)
    return [p for p in pids if _alive(p)]


def _kill_after_first_checkpoint(cmd, model, min_children, rng):
    """Start ``cmd``; once its first checkpoint exists wait a random moment and SIGKILL the parent only.

    Returns the descendants it had just before the kill. Fails when the run ends before the kill.
    """
    proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        manifest = model.parent / (model.name + ".ckpt") / "MANIFEST.json"
        deadline = time.monotonic() + 120
        while not manifest.exists():
            assert proc.poll() is None, proc.communicate(timeout=30)
            assert time.monotonic() < deadline, "no checkpoint within 120 s"
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.4))
        children = _descendants(proc.pid)
        assert proc.poll() is None, "the run finished before it could be killed: make it longer"
        assert len(children) >= min_children, children
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return children


@pytest.mark.timeout(400)
def test_replicated_run_killed_and_resumed_gives_the_same_weights(tmp_path):
    _dataset(tmp_path)
    rng = random.Random()
    reference = tmp_path / "ref" / "model.pt"
    subprocess.run(_command(tmp_path, reference, "-rf", "2"), env=ENV, check=True, capture_output=True,
                   timeout=240)

    model = tmp_path / "cut" / "model.pt"
    children = _kill_after_first_checkpoint(_command(tmp_path, model, "-rf", "2", "--save-every-n-secs", "0.01"),
                                            model, 2, rng)
    # the replicas must not outlive their parent (they would go on writing the checkpoint)
    left = _wait_gone(children, 30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the killed parent"

    ckpt = load_checkpoint(str(model))
    steps_at_cut, exs_at_cut = ckpt.state["train"]["steps"], ckpt.state["train"]["exs"]
    assert steps_at_cut > 0 and len(ckpt.data) == 2
    resumed = subprocess.run(_command(tmp_path, model, "-rf", "2", "--resume"), env=ENV, capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "may repeat" not in resumed.stderr
    ref, got = _weights(reference), _weights(model)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), (key, steps_at_cut, exs_at_cut)
