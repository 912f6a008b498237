from __future__ import annotations

import json
import math
import os
import pickle
import random
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from helpers import LabelEchoTorchAgent, RecordingAgent, list_teacher

from accelbatch import checkpoint as ck
from accelbatch import run_control
from accelbatch import state as rng_state
from accelbatch.agents import TorchAgent
from accelbatch.checkpoint import CheckpointError
from accelbatch.messages import Message
from accelbatch.multi_world import MultiWorld
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan
from accelbatch.worlds import BatchWorld, DialogPartnerWorld

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _model_and_optimizer(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 3)).pow(2).mean().backward()
    opt.step()
    return model, opt


def _save(path, model, opt=None, **state):
    return ck.save_checkpoint(path, model=model, optimizer=opt, opts=Opts(batchsize=4),
                              plan=ExecutionPlan(micro_batch=4, gradient_accumulation=2), state=state)


def _same_weights(a, b):
    return all(torch.equal(a[k], b[k]) for k in a) and set(a) == set(b)


# --- format -------------------------------------------------------------------------------------------
def test_round_trip(tmp_path):
    model, opt = _model_and_optimizer()
    path = str(tmp_path / "run" / "model")
    ckdir = _save(path, model, opt, train={"steps": 7, "best": -math.inf}, note=np.int64(3))
    assert ckdir == path + ".ckpt" and ck.find_checkpoint(path) == ckdir
    loaded = ck.load_checkpoint(path)
    assert not loaded.legacy and loaded.generation == 1
    assert _same_weights(loaded.model_state, model.state_dict())
    assert loaded.opts["batchsize"] == 4 and loaded.state == {"train": {"steps": 7, "best": -math.inf},
                                                               "note": 3}
    plan = ck.plan_from_dict(loaded.plan)
    assert plan == ExecutionPlan(micro_batch=4, gradient_accumulation=2)
    other, other_opt = _model_and_optimizer(seed=1)
    loaded.load_into(other, other_opt)
    assert _same_weights(other.state_dict(), model.state_dict())
    assert other_opt.state_dict()["state"][0]["exp_avg"].equal(opt.state_dict()["state"][0]["exp_avg"])
    # a second save replaces the first; only the new generation stays on disk
    _save(path, model, opt, train={"steps": 8})
    assert ck.load_checkpoint(ckdir).state["train"]["steps"] == 8
    assert sorted(os.listdir(ckdir)) == ["MANIFEST.json", "gen-000002"]


def test_plain_model_file_from_torchagent_save_loads(tmp_path):
    class Tiny(TorchAgent):
        def build_model(self):
            return torch.nn.Linear(2, 2)

    agent = Tiny(Opts(optimizer="sgd"))
    path = str(tmp_path / "model")
    agent.save(path)
    assert ck.find_checkpoint(path) == path
    loaded = ck.load_checkpoint(path)
    assert loaded.legacy and loaded.state == {} and loaded.rng is None and not rng_state.restore_rng(loaded)
    assert _same_weights(loaded.model_state, agent.model.state_dict())
    assert set(loaded.engine_state()) == {"model", "optimizer"}


def test_not_a_model_file_is_refused(tmp_path):
    path = tmp_path / "model"
    torch.save({"weights": torch.zeros(2)}, path)
    with pytest.raises(CheckpointError, match="not a model file written by accelbatch"):
        ck.load_checkpoint(str(path))
    path.write_text("hello")
    with pytest.raises(CheckpointError, match="cannot load as a model file"):
        ck.load_checkpoint(str(path))
    with pytest.raises(CheckpointError, match="no checkpoint here"):
        ck.load_checkpoint(str(tmp_path / "absent"))


def test_model_mismatch_is_a_clear_error(tmp_path):
    model, _ = _model_and_optimizer()
    _save(str(tmp_path / "m"), model)
    with pytest.raises(CheckpointError, match="does not fit this model"):
        ck.load_checkpoint(str(tmp_path / "m")).load_into(torch.nn.Linear(5, 2))


def test_state_must_be_json_and_nothing_is_written_otherwise(tmp_path):
    model, _ = _model_and_optimizer()
    with pytest.raises(CheckpointError, match=r"state\['train'\]\['loss'\]: a Tensor"):
        _save(str(tmp_path / "m"), model, train={"loss": torch.tensor(1.0)})
    with pytest.raises(CheckpointError, match="key 3 is a int"):
        _save(str(tmp_path / "m"), model, train={3: 1})
    assert not os.path.exists(tmp_path / "m.ckpt")


# --- damaged checkpoints are refused ----------------------------------------------------------------
def _gen_file(ckdir, name):
    manifest = json.loads(open(os.path.join(ckdir, "MANIFEST.json")).read())
    return os.path.join(ckdir, manifest["directory"], name)


def _flip_byte(path):
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0xFF
    open(path, "wb").write(bytes(data))


def _truncate(path):
    size = os.path.getsize(path)
    with open(path, "r+b") as handle:
        handle.truncate(size // 2)


@pytest.mark.parametrize("name, damage, message", [
    ("tensors.pt", _flip_byte, r"tensors\.pt: SHA-256 differs .*tampered with or damaged"),
    ("state.json", _flip_byte, r"state\.json: SHA-256 differs"),
    ("tensors.pt", _truncate, r"tensors\.pt: truncated \(\d+ bytes, \d+ expected\)"),
    ("state.json", _truncate, r"state\.json: truncated"),
    ("tensors.pt", os.remove, r"tensors\.pt: missing"),
    ("MANIFEST.json", _truncate, r"MANIFEST\.json: not valid JSON"),
])
def test_damaged_checkpoint_is_refused_naming_the_file(tmp_path, name, damage, message):
    model, opt = _model_and_optimizer()
    ckdir = _save(str(tmp_path / "m"), model, opt, train={"steps": 1})
    target = os.path.join(ckdir, name) if name == "MANIFEST.json" else _gen_file(ckdir, name)
    damage(target)
    with pytest.raises(CheckpointError, match=message) as info:
        ck.load_checkpoint(str(tmp_path / "m"))
    assert "delete" in str(info.value) and ckdir in str(info.value)


def test_newer_format_version_is_refused(tmp_path):
    model, _ = _model_and_optimizer()
    ckdir = _save(str(tmp_path / "m"), model)
    manifest_path = os.path.join(ckdir, "MANIFEST.json")
    manifest = json.load(open(manifest_path))
    manifest["version"] = ck.VERSION + 1
    json.dump(manifest, open(manifest_path, "w"))
    with pytest.raises(CheckpointError, match="newer accelbatch .* upgrade accelbatch"):
        ck.load_checkpoint(ckdir)


class _Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned > pwned.txt",))


def test_a_pickle_with_code_is_never_run_even_with_matching_hashes(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    model, _ = _model_and_optimizer()
    ckdir = _save(str(tmp_path / "m"), model)
    tensors = _gen_file(ckdir, "tensors.pt")
    torch.save({"model": {"w": torch.zeros(1)}, "optimizer": _Boom()}, tensors, pickle_module=pickle)
    manifest_path = os.path.join(ckdir, "MANIFEST.json")
    manifest = json.load(open(manifest_path))
    manifest["files"]["tensors.pt"] = {"sha256": ck.sha256_of(tensors), "bytes": os.path.getsize(tensors)}
    json.dump(manifest, open(manifest_path, "w"))  # an attacker can fix the hashes: weights_only still holds
    with pytest.raises(CheckpointError, match="cannot be read"):
        ck.load_checkpoint(ckdir)
    assert not (tmp_path / "pwned.txt").exists()


# --- atomicity ----------------------------------------------------------------------------------------
def _crash_on_call(monkeypatch, n):
    """Make the n-th _write_bytes call write half its data, then fail (a crash mid-write)."""
    real = ck._write_bytes
    calls = {"n": 0}

    def writer(path, data):
        calls["n"] += 1
        if calls["n"] == n:
            with open(path, "wb") as handle:
                handle.write(data[: len(data) // 2])
            raise OSError("simulated crash")
        real(path, data)

    monkeypatch.setattr(ck, "_write_bytes", writer)


@pytest.mark.parametrize("crash_at", [1, 2], ids=["state.json", "manifest"])
def test_crash_mid_save_keeps_the_last_good_checkpoint(tmp_path, monkeypatch, crash_at):
    path = str(tmp_path / "m")
    model, opt = _model_and_optimizer()
    good = {k: v.clone() for k, v in model.state_dict().items()}
    _save(path, model, opt, train={"steps": 1})
    with torch.no_grad():
        model.weight.add_(1.0)
    with monkeypatch.context() as patch:
        _crash_on_call(patch, crash_at)
        with pytest.raises(OSError, match="simulated crash"):
            _save(path, model, opt, train={"steps": 2})
    loaded = ck.load_checkpoint(path)
    assert loaded.state["train"]["steps"] == 1 and _same_weights(loaded.model_state, good)
    assert len(os.listdir(path + ".ckpt")) > 2  # the crash's leftovers ...
    _save(path, model, opt, train={"steps": 3})
    assert ck.load_checkpoint(path).state["train"]["steps"] == 3
    left = sorted(os.listdir(path + ".ckpt"))  # ... are cleaned up
    assert left == ["MANIFEST.json", "gen-000002" if crash_at == 1 else "gen-000003"]


def test_first_save_that_never_finished_is_no_checkpoint(tmp_path, monkeypatch):
    model, _ = _model_and_optimizer()
    _crash_on_call(monkeypatch, 2)
    with pytest.raises(OSError):
        _save(str(tmp_path / "m"), model)
    assert ck.find_checkpoint(str(tmp_path / "m")) is None
    with pytest.raises(CheckpointError, match="has no MANIFEST.json"):
        ck.load_checkpoint(str(tmp_path / "m"))


@pytest.mark.multiprocess
def test_sigkill_while_committing_keeps_the_last_good_checkpoint(tmp_path):
    script = textwrap.dedent("""
        import os, signal, sys, torch
        from accelbatch import checkpoint as ck
        path = sys.argv[1]
        model = torch.nn.Linear(2, 2)
        with torch.no_grad():
            model.weight.fill_(1.0)
        ck.save_checkpoint(path, model=model, state={"steps": 1}, rng=False)
        real, calls = ck._write_bytes, []
        def dying(p, data):
            calls.append(p)
            if len(calls) == 2:  # the manifest: half of it, then the process is gone
                with open(p, "wb") as handle:
                    handle.write(data[: len(data) // 2])
                    handle.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            real(p, data)
        ck._write_bytes = dying
        with torch.no_grad():
            model.weight.fill_(2.0)
        ck.save_checkpoint(path, model=model, state={"steps": 2}, rng=False)
    """)
    env = {**os.environ, "PYTHONPATH": REPO, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "m")], env=env, timeout=120,
                          capture_output=True, text=True)
    assert proc.returncode == -9, proc.stderr
    loaded = ck.load_checkpoint(str(tmp_path / "m"))
    assert loaded.state == {"steps": 1} and torch.all(loaded.model_state["weight"] == 1.0)


# --- RNG ----------------------------------------------------------------------------------------------
def _draws():
    return (random.random(), random.gauss(0, 1), np.random.rand(3).tolist(), np.random.randn(),
            torch.rand(3).tolist(), torch.randint(0, 1000, (2,)).tolist())


def test_rng_round_trip_reproduces_draws(tmp_path):
    random.gauss(0, 1)  # leave a cached gaussian in Python's and NumPy's state
    np.random.randn()
    states = rng_state.capture_rng()
    first = _draws()
    model, _ = _model_and_optimizer()
    random.seed(123), np.random.seed(123), torch.manual_seed(123)
    ck.save_checkpoint(str(tmp_path / "m"), model=model, rng=states)  # through JSON on disk
    assert rng_state.restore_rng(ck.load_checkpoint(str(tmp_path / "m")))
    assert _draws() == first
    rng_state.restore_rng([rng_state.capture_rng(), states], rank=1)
    assert _draws() == first
    with pytest.raises(CheckpointError, match="RNG states for 2 replicas"):
        rng_state.restore_rng([states, states], rank=2)


# --- data position ------------------------------------------------------------------------------------
LENGTHS = [3, 1, 2, 4, 1, 2, 3]  # 16 examples in 7 episodes


def _world(rows, lengths=LENGTHS, seed=0, tasks=1):
    opts = Opts(datatype="train", batchsize=rows, seed=seed)
    agent = RecordingAgent(opts)
    if tasks == 1:
        world = DialogPartnerWorld(opts, [list_teacher(lengths)(opts), agent])
    else:
        subs = [DialogPartnerWorld(opts, [list_teacher(lengths[t:])(opts), agent]) for t in range(tasks)]
        world = MultiWorld(opts, subs, [f"t{t}" for t in range(tasks)])
    return (BatchWorld(opts, world, rows) if rows > 1 else world), agent


def _run(world, steps):
    for _ in range(steps):
        world.parley()


def _position(world):
    """What a checkpoint keeps of a world's data position (through JSON, as on disk)."""
    state = json.loads(json.dumps(world.state_dict()))
    assert rng_state.unsupported(state) == []
    return state


@pytest.mark.parametrize("rows, tasks, kill_at", [(1, 1, 5), (3, 1, 0), (3, 1, 4), (3, 1, 7), (4, 2, 5)])
def test_resume_continues_the_same_example_stream(rows, tasks, kill_at):
    steps = 12
    reference, ref_agent = _world(rows, tasks=tasks)
    _run(reference, steps)

    first, first_agent = _world(rows, tasks=tasks)
    _run(first, kill_at)
    position = _position(first)
    del first  # killed

    resumed, resumed_agent = _world(rows, tasks=tasks)
    resumed.load_state_dict(position)
    assert resumed.get_total_exs() == position["total_exs"]
    _run(resumed, steps - kill_at)
    assert first_agent.seen + resumed_agent.seen == ref_agent.seen
    assert resumed.get_total_exs() == reference.get_total_exs()


@pytest.mark.parametrize("kill_at", [1, 2, 3])
def test_kill_and_resume_sees_one_clean_epoch(kill_at):
    lengths, rows = [1] * 12, 3  # 4 steps of 3 rows = one epoch
    first, first_agent = _world(rows, lengths)
    _run(first, kill_at)
    position = _position(first)
    resumed, resumed_agent = _world(rows, lengths)
    resumed.load_state_dict(position)
    _run(resumed, 4 - kill_at)
    seen = first_agent.seen + resumed_agent.seen
    assert sorted(seen) == sorted(f"e{e}-0" for e in range(12))


def test_restore_into_other_data_or_rows_is_refused():
    world, _ = _world(3)
    _run(world, 2)
    position = _position(world)
    with pytest.raises(ValueError, match="other data"):
        _world(3, LENGTHS[:-1])[0].load_state_dict(position)
    with pytest.raises(ValueError, match="another order"):
        _world(3, seed=1)[0].load_state_dict(position)
    with pytest.raises(ValueError, match="rows per step"):
        _world(2)[0].load_state_dict(position)


@pytest.mark.multiprocess
@pytest.mark.parametrize("datatype", ["train", "train:stream"])
@pytest.mark.parametrize("workers", [0, 2])
def test_the_loader_world_of_two_tasks_resumes_each_task(tmp_path, datatype, workers):
    from accelbatch.build import create_world

    files = []
    for name, count in (("a", 14), ("b", 8)):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"text": f"{name} {i} " + "w " * (i % 5), "labels": ["x"],
                                            "episode_done": True}) + "\n" for i in range(count)))
        files.append(path)
    opts = Opts(task=",".join(f"jsonl:{f}" for f in files), datatype=datatype, batchsize=3, seed=0,
                dynamic_batching="batchsort", num_workers=workers)

    def build():
        agent = LabelEchoTorchAgent(opts)
        return create_world(opts, agent=agent), agent

    steps, kill_at = 14, 6
    reference, ref_agent = build()
    _run(reference, steps)
    first, first_agent = build()
    _run(first, kill_at)
    position = _position(first)
    before = first.report()[f"jsonl:{files[1]}/exs"]
    for world in (reference, first):
        world.shutdown()
    resumed, resumed_agent = build()
    resumed.load_state_dict(position)
    assert resumed.get_total_exs() == position["total_exs"]
    _run(resumed, steps - kill_at)
    assert first_agent.seen + resumed_agent.seen == ref_agent.seen and len(ref_agent.seen) == steps * 3
    assert resumed.get_total_exs() == reference.get_total_exs()
    assert reference.report()[f"jsonl:{files[1]}/exs"] == before + resumed.report()[f"jsonl:{files[1]}/exs"] > 0
    resumed.shutdown()


def test_torch_agent_conversation_in_progress_is_restored():
    class Tiny(TorchAgent):
        def build_model(self):
            return torch.nn.Linear(1, 1)

    opts = Opts(optimizer="sgd")
    turns = [Message(text=f"t{i}", labels=[f"l{i}"], episode_done=i == 2) for i in range(3)]
    agent = Tiny(opts)
    agent.observe(turns[0])
    agent.observe(turns[1])
    state = json.loads(json.dumps(agent.state_dict()))
    other = Tiny(opts)
    other.load_state_dict(state)
    expected = "t0\nl0\nt1\nl1\nt2"
    assert other.observe(turns[2])["full_text"] == agent.observe(turns[2])["full_text"] == expected


def test_check_resumable_names_the_options():
    model, _ = _model_and_optimizer()
    checkpoint = ck.Checkpoint(path="x.ckpt", model_state=model.state_dict(),
                               opts=Opts(batchsize=4, seed=1).to_dict())
    ck.check_resumable(checkpoint, Opts(batchsize=4, seed=1, learning_rate=0.5))
    message = r"--seed 0 \(checkpoint: 1\); -bs/--batchsize 8 \(checkpoint: 4\)"
    with pytest.raises(CheckpointError, match=message):
        ck.check_resumable(checkpoint, Opts(batchsize=8))


def test_a_resume_keeps_the_input_replica_grouping():
    """Groups change the rows a step holds (b x D x R/N x G), so a resume must keep them."""
    model, _ = _model_and_optimizer()
    saved = Opts(device="ipu", replication_factor=4, ipu_input_replica_grouping=2)
    checkpoint = ck.Checkpoint(path="x.ckpt", model_state=model.state_dict(), opts=saved.to_dict())
    ck.check_resumable(checkpoint, saved)
    with pytest.raises(CheckpointError, match=r"--ipu-input-replica-grouping 4 \(checkpoint: 2\)"):
        ck.check_resumable(checkpoint, saved.replace(ipu_input_replica_grouping=4))


# --- when to save -------------------------------------------------------------------------------------
def test_periodic_saver():
    now = [100.0]
    saver = run_control.PeriodicSaver(10, clock=lambda: now[0])
    assert not saver.due()
    now[0] = 109.9
    assert not saver.due()
    now[0] = 110.0
    assert saver.due() and not saver.due()  # once per period
    now[0] = 125.0
    saver.mark()
    now[0] = 134.0
    assert not saver.due()
    off = run_control.PeriodicSaver(-1, clock=lambda: now[0])
    now[0] = 1e9
    assert not off.enabled and not off.due()


def test_stop_signals_turn_sigterm_into_a_flag():
    import signal

    before = signal.getsignal(signal.SIGTERM)
    with run_control.StopSignals() as stop:
        assert stop.requested is None
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == signal.SIGTERM and stop.name == "SIGTERM"
        os.kill(os.getpid(), signal.SIGTERM)   # at once: one signal delivered twice (GNU timeout), one request
        assert stop.requested == signal.SIGTERM
        time.sleep(run_control.DOUBLE_DELIVERY_S)
        with pytest.raises(KeyboardInterrupt, match="SIGTERM again"):
            os.kill(os.getpid(), signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) is before
    with run_control.StopSignals(announce=False) as stop:   # another signal at once is a second request
        os.kill(os.getpid(), signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            os.kill(os.getpid(), signal.SIGINT)


def test_a_stop_agreed_on_another_replicas_signal_takes_its_own_late_copy_as_the_same_request():
    import signal

    with run_control.StopSignals(announce=False) as stop:
        stop.agree()
        assert stop.requested is not None
        os.kill(os.getpid(), signal.SIGINT)  # the parent's forward of that signal, late: not a second one
        assert stop.requested == signal.SIGINT
        time.sleep(run_control.DOUBLE_DELIVERY_S)
        with pytest.raises(KeyboardInterrupt, match="SIGINT again"):
            os.kill(os.getpid(), signal.SIGINT)


# --- the fp16 loss scaler ----------------------------------------------------------------------------

class _LoudMemNN(torch.nn.Module):
    """memnn with its loss times 30: its fp16 gradients overflow at the scaler's initial 65536."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, batch):
        out = dict(self.inner(batch))
        if "loss" in out:
            out["loss"] = out["loss"] * 30.0
        return out


def _loud_agent():
    from accelbatch.models.memnn import MemNNAgent

    class LoudMemNN(MemNNAgent):
        def build_model(self):
            return _LoudMemNN(super().build_model())

        def build_optimizer(self, model):
            return torch.optim.SGD(model.parameters(), lr=1e-5)

    return LoudMemNN


def _fp16_run(tmp_path, steps, resume=False):
    from accelbatch.build import create_world
    from accelbatch.run import run

    opts = Opts(task="babi:1", device="cpu", batchsize=4, mixed_precision="fp16", max_train_steps=steps,
                validation_every_n_epochs=-1, eval_splits="", progress=False, seed=3,
                model_file=str(tmp_path / "model"), save_every_n_secs=3600, resume=resume)
    world = create_world(opts, agent=_loud_agent())
    agent = world.get_model_agent()
    run(world, opts)
    return agent.engine


def test_the_fp16_loss_scale_is_saved_and_a_resume_goes_on_from_it(tmp_path):
    from accelbatch.backends.cpu import fp16_on_cpu_supported

    if not fp16_on_cpu_supported():
        pytest.skip(f"torch {torch.__version__} has no fp16 CPU autocast")
    whole = _fp16_run(tmp_path / "whole", 8)
    first = _fp16_run(tmp_path / "cut", 4)
    scale = first.hooks.scaler.get_scale()
    assert scale < 65536.0                     # overflows lowered it (updates were skipped)
    assert any(not torch.equal(p, q) for p, q in zip(whole.model.parameters(), first.model.parameters()))
    saved = ck.load_checkpoint(str(tmp_path / "cut" / "model")).scaler_state
    assert saved["scale"] == scale and saved["_growth_tracker"] == first.hooks.scaler.state_dict()["_growth_tracker"]
    resumed = _fp16_run(tmp_path / "cut", 8, resume=True)
    assert resumed.hooks.scaler.state_dict() == whole.hooks.scaler.state_dict()
    for (name, p), q in zip(whole.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), name


def test_stop_signals_stop_at_once_when_no_safe_point_comes_within_the_grace():
    """A step far longer than the grace (a sleep here) is cut short by the grace timer; a safe point within
    the grace turns the timer off, and the run may then save at leisure."""
    import signal
    import time

    with run_control.StopSignals(grace_s=0.3, announce=False) as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        begun = time.monotonic()
        with pytest.raises(KeyboardInterrupt, match="SIGTERM: the step had not ended 0.3 s after the signal"):
            time.sleep(30)
        assert time.monotonic() - begun < 5
    with run_control.StopSignals(grace_s=0.3, announce=False) as stop:
        os.kill(os.getpid(), signal.SIGINT)
        stop.at_safe_point()
        time.sleep(0.6)  # a save that takes longer than the grace is not interrupted
        assert stop.name == "SIGINT"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_position_carries_over_to_other_performance_options_of_its_front_end_and_no_further(tmp_path, capsys):
    """A loader position (steps of the schedule) resumes under other workers or dataloader mode, a clones
    position under streaming, each to the weights of the run in one go; a position of one front end under
    options that pick the other is refused in one line naming the options it was saved with."""
    from helpers import write_qa_episodes

    from accelbatch.cli import main

    write_qa_episodes(tmp_path)
    common = ["train", "-t", f"jsonl:{tmp_path}/data", "-m", "memnn", "-bs", "3", "-esz", "8", "--seed", "4",
              "--no-progress", "-veps", "-1", "--eval-splits", "", "-ltim", "-1"]

    def weights(path):
        return torch.load(path, weights_only=True)["model"]

    for name, before, after in (("loader", ["--num-workers", "1"], ["--dataloader-mode", "async"]),
                                ("clones", [], ["-dt", "train:stream"])):
        whole, cut = tmp_path / f"{name}-whole.pt", tmp_path / f"{name}-cut.pt"
        assert main([*common, *before, "-tstep", "12", "-mf", str(whole)]) == 0
        assert main([*common, *before, "-tstep", "5", "-mf", str(cut), "--save-every-n-secs", "1000"]) == 0
        assert main([*common, *after, "-tstep", "12", "-mf", str(cut), "--resume"]) == 0
        assert "not restored" not in capsys.readouterr().err
        ref, got = weights(whole), weights(cut)
        assert all(torch.equal(ref[k], got[k]) for k in ref), name
    assert main([*common, "--num-workers", "1", "-tstep", "14", "-mf", str(tmp_path / "clones-cut.pt"),
                 "--resume"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds the position of the world of teacher and agent clones" in err[0], err
    assert "through the batched loader" in err[0] and "num_workers=0" in err[0], err


@pytest.mark.parametrize("umask, mode", [(0o022, 0o755), (0o077, 0o700)])
def test_a_checkpoints_folders_take_the_umasks_mode_as_its_files_do(tmp_path, umask, mode):
    """Teammates on a shared server read a checkpoint as they read the model file (the staging folder was
    0700 whatever the umask)."""
    previous = os.umask(umask)
    try:
        ckdir = _save(str(tmp_path / "model"), *_model_and_optimizer())
    finally:
        os.umask(previous)
    generation = os.path.join(ckdir, "gen-000001")
    assert os.stat(generation).st_mode & 0o777 == mode == os.stat(ckdir).st_mode & 0o777
    assert os.stat(os.path.join(generation, "state.json")).st_mode & 0o777 == mode & 0o666
