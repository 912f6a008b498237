"""Kill a parallel training run (SIGKILL of the parent, at a random moment) and --resume.

* ``-rf 2`` (two gloo replicas spawned by the CLI, each on its own shard): the resumed run ends with
  weights equal (torch.equal) to an uninterrupted ``-rf 2`` run, and no replica outlives the killed parent
  for long (torch.multiprocessing sets PR_SET_PDEATHSIG=SIGINT in each replica; the run loop's StopSignals
  turns that into one last collective checkpoint and a clean exit, so the resume may start from it).
* ``-nt 2`` (hogwild): weights differ from run to run, so the test checks the data position instead: each
  process serves its share of the episodes in an order fixed by the seed, so the examples it trained on
  before the last checkpoint followed by those it trained on after the resume are exactly the start of
  that order, nothing skipped or repeated.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import descendants, wait_for_first_checkpoint, write_qa_episodes
from shared_runs import shared_dir

from accelbatch.agents import Agent
from accelbatch.build import create_world
from accelbatch.checkpoint import load_checkpoint
from accelbatch.hogwild_passes import shard_passes
from accelbatch.messages import Message
from accelbatch.opts import Opts
from accelbatch.state import unsupported
from accelbatch.teachers import create_teacher

ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


class SlowSecondProcessAgent(Agent):
    """Replies with the label; in hogwild process 1 each observation takes 100 ms (children import this
    module by name)."""

    def observe(self, observation):
        if multiprocessing.current_process().name == "hogwild-1" and observation and "text" in observation:
            time.sleep(0.1)
        return super().observe(observation)

    def act(self):
        labels = (self.observation or {}).get("labels")
        return Message(id=self.id, text=labels[0]) if labels else Message(id=self.id)


def _dataset(root, episodes=40):
    write_qa_episodes(root, episodes)


def _command(root, model_file, *extra):
    return [sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{root}/data", "-m", "memnn", "-bs", "3",
            "-ne", "2", "-veps", "-1", "--eval-splits", "", "--no-progress", "-ltim", "-1",
            "-mf", str(model_file), *extra]


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


def _replicated_reference(factory):
    """(the data's root, an uninterrupted ``-rf 2`` run's model file), once per session: the weights the
    killed run must resume to, and a checkpoint saved at the end of training (the default: only there)."""
    root = shared_dir(factory, "test_resume_parallel qa-episodes 40", _dataset)

    def build(folder):
        subprocess.run(_command(root, folder / "model.pt", "-rf", "2"), env=ENV, check=True, capture_output=True,
                       timeout=240)
    return root, shared_dir(factory, f"test_resume_parallel -rf 2 reference {root}", build) / "model.pt"


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


def _kill_after_first_checkpoint(cmd, model, min_children, rng, env=ENV):
    """Start ``cmd``; once its first checkpoint exists wait a random moment and SIGKILL the parent only.

    Returns the descendants it had just before the kill. Fails when the run ends before the kill.
    """
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_first_checkpoint(proc, model, max_delay_s=0.4, rng=rng)
        children = descendants(proc.pid)
        assert proc.poll() is None, "the run finished before it could be killed: make it longer"
        assert len(children) >= min_children, children
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate(timeout=30)
    return children


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_replicated_run_killed_and_resumed_gives_the_same_weights(tmp_path, tmp_path_factory):
    root, reference = _replicated_reference(tmp_path_factory)
    rng = random.Random()

    model = tmp_path / "cut" / "model.pt"
    children = _kill_after_first_checkpoint(_command(root, model, "-rf", "2", "--save-every-n-secs", "0.01"),
                                            model, 2, rng)
    # the replicas must not outlive their parent (they would go on writing the checkpoint)
    left = _wait_gone(children, 30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the killed parent"

    ckpt = load_checkpoint(str(model))
    steps_at_cut, exs_at_cut = ckpt.state["train"]["steps"], ckpt.state["train"]["exs"]
    assert steps_at_cut > 0 and len(ckpt.data) == 2
    resumed = subprocess.run(_command(root, model, "-rf", "2", "--resume"), env=ENV, capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    # it went on from the checkpoint (a run started afresh would end with the same weights too)
    for afresh in ("may repeat", "starting afresh", "weights only"):
        assert afresh not in resumed.stderr, resumed.stderr
    ref, got = _weights(reference), _weights(model)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), (key, steps_at_cut, exs_at_cut)


_RECORDING_AGENT = '''
import multiprocessing
import os

from accelbatch.messages import is_padding
from accelbatch.models.memnn import MemNNAgent


class RecordingMemNN(MemNNAgent):
    """MemNN that appends the text of every training example it observes to $REC_DIR/<process name>.txt
    (one line per example the world counts: hogwild process i is named hogwild-i)."""

    def observe(self, observation):
        if not is_padding(observation) and observation.get("labels"):
            name = multiprocessing.current_process().name
            with open(os.path.join(os.environ["REC_DIR"], name + ".txt"), "a") as handle:
                handle.write(observation["text"] + "\\n")
        return super().observe(observation)
'''


def _records(directory):
    out = {}
    for name in os.listdir(directory):
        with open(os.path.join(directory, name)) as handle:
            out[name[:-len(".txt")]] = handle.read().splitlines()
    return out


def _process_stream(root, process, processes=2, rows=3, steps=2000):
    """What hogwild process ``process`` trains on, in order: its share of the episodes through its feed."""
    teacher = create_teacher(Opts(task=f"jsonl:{root}/data", datatype="train", batchsize=rows, seed=0))
    teacher.keep_shard(process, processes)
    teacher.serve_rows(rows)
    shard_passes(teacher)  # a hogwild process's feed: its shard pass by pass
    out = []
    for _ in range(steps):
        examples, *_ = teacher.feed.step()
        out += [m["text"] for m in examples if "text" in m]  # not the padding rows that end a pass
    return out


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(400)
def test_hogwild_run_killed_and_resumed_continues_each_process_where_it_was(tmp_path):
    """-nt 2: for each process, the examples it trained on before the last checkpoint (its first
    ``total_exs`` records, the count the checkpoint holds for it) followed by those it trained on after
    --resume are exactly the start of that process's order: nothing skipped, nothing repeated."""
    _dataset(tmp_path, 500)  # training lasts over a second past the first checkpoint: the cut lands in it
    (tmp_path / "rec_agent.py").write_text(_RECORDING_AGENT)
    cut_rec, resume_rec = tmp_path / "rec-cut", tmp_path / "rec-resume"
    cut_rec.mkdir()
    resume_rec.mkdir()
    env = {**ENV, "PYTHONPATH": os.pathsep.join([str(tmp_path), ENV.get("PYTHONPATH", "")])}
    model = tmp_path / "cut" / "model.pt"

    def command(*extra):
        cmd = _command(tmp_path, model, "-nt", "2", *extra)
        cmd[cmd.index("-m", 3) + 1] = "rec_agent:RecordingMemNN"
        cmd[cmd.index("-ne") + 1] = "1"
        return cmd

    children = _kill_after_first_checkpoint(command("--save-every-n-secs", "0.05"), model, 2, random.Random(),
                                            env={**env, "REC_DIR": str(cut_rec)})
    left = _wait_gone(children, 30)
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    assert not left, f"processes {left} outlived the killed parent"

    ckpt = load_checkpoint(str(model))
    position = ckpt.data[0]
    assert unsupported(position) == [] and position["numthreads"] == 2
    per_process = [state["total_exs"] for state in position["processes"]]
    # the run loop counted before the drain finished the parleys in flight: its count may lag
    assert sum(per_process) == position["total_exs"] >= ckpt.state["train"]["exs"] > 0
    cut = _records(cut_rec)

    resumed = subprocess.run(command("--resume"), env={**env, "REC_DIR": str(resume_rec)},
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    assert "may repeat" not in resumed.stderr and "starting afresh" not in resumed.stderr
    after = _records(resume_rec)
    for process, count in enumerate(per_process):
        before = cut.get(f"hogwild-{process}", [])
        assert len(before) >= count, (process, len(before), count)
        seen = before[:count] + after.get(f"hogwild-{process}", [])
        assert seen and seen == _process_stream(tmp_path, process)[:len(seen)], process


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(200)
def test_hogwild_position_is_taken_with_no_parley_in_flight_and_restores(write_jsonl):
    """Process 1 is slow and has parleys queued when the position is asked for: the position must wait
    for them (the counts add up to every parley released), and a new world restored from it reports the same
    position."""
    path = write_jsonl([{"text": f"x{i}", "labels": [f"y{i}"], "episode_done": True} for i in range(300)])
    opts = Opts(task=f"jsonl:{path}", datatype="train", numthreads=2, batchsize=3, progress=False)
    world = create_world(opts, agent=SlowSecondProcessAgent)
    try:
        for _ in range(6):
            world.parley()
        position = json.loads(json.dumps(world.state_dict()))
    finally:
        world.shutdown()
    assert position["total_exs"] == sum(p["total_exs"] for p in position["processes"]) == 6 * 3

    again = create_world(opts, agent=SlowSecondProcessAgent)
    try:
        again.load_state_dict(position)
        assert again.get_total_exs() == 6 * 3
        assert again.state_dict() == position
    finally:
        again.shutdown()


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.timeout(300)
def test_resuming_the_checkpoint_saved_at_the_end_of_training_trains_nothing_more(tmp_path, tmp_path_factory):
    """A kill after the end-of-training save (a window of the -rf 2 and one-process kill tests) leaves a
    checkpoint with every step done: --resume from it must end with the same weights."""
    import shutil

    root, reference = _replicated_reference(tmp_path_factory)
    model = tmp_path / "m" / "model.pt"  # a copy of the finished run (model file, checkpoint, sidecars)
    shutil.copytree(reference.parent, model.parent)
    finished = _weights(model)
    resumed = subprocess.run(_command(root, model, "-rf", "2", "--resume"), env=ENV, capture_output=True,
                             text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    got = _weights(model)
    for key in finished:
        assert torch.equal(finished[key], got[key]), key
