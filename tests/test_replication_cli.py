"""`accelbatch train --replication-factor 2` starts its own gloo processes; data sharded per replica."""

from __future__ import annotations

import json
import multiprocessing

import pytest
from helpers import live_children

from accelbatch.cli import main


def _children() -> list[int]:
    return [pid for pid, _ in live_children()]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_two_replicas_train_and_evaluate_every_example_once(tmp_path, write_jsonl):
    path = write_jsonl([{"text": f"q{i}", "labels": [f"a{i}"]} for i in range(101)])
    report_path = tmp_path / "r.json"
    before = set(_children())
    rc = main(["train", "-t", f"jsonl:{path}", "-m", "repeat_label", "-rf", "2", "-bs", "4",
               "--max-train-steps", "3", "--no-progress", "--report-json", str(report_path)])
    assert rc == 0
    report = json.loads(report_path.read_text())
    assert report["replicas"] == 2
    assert report["valid"]["exs"] == 101 and report["valid"]["accuracy"] == 1.0  # each example once, summed
    assert report["train"]["exs"] == 3 * 4 * 2  # steps x micro batch x replicas
    assert not multiprocessing.active_children() and set(_children()) <= before


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.slow
def test_bad_input_met_in_a_replica_is_one_line_and_exit_2(tmp_path, capsys):
    """The replicas read the file: its error comes back as the one line a single process prints (a crash
    keeps the replica's traceback: tests/test_fault_injection.py)."""
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "x", "labels": ["y"]}\n{"text": \n')
    rc = main(["train", "-t", f"jsonl:{bad}", "-m", "repeat_label", "-rf", "2", "--no-progress"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"accelbatch: error: {bad}:2: not valid JSON") and len(err.splitlines()) == 1, err
    assert not multiprocessing.active_children()


def _weights(path) -> dict:
    import torch

    return torch.load(path, map_location="cpu", weights_only=True)["model"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("extra", [[], ["-ga", "2"], ["--dataloader-mode", "async"]], ids=["default", "ga2", "async"])
def test_real_replicas_train_the_weights_of_the_single_process_plan(tmp_path, extra):
    """Two gloo replicas run what one process running the same plan (the IPU emulator's replicas in turn)
    hands each replica: the same rows in the same micro-batches, so the same weights (float tolerance) and
    the same evaluation."""
    import torch

    common = ["train", "-t", "babi:1", "-m", "memnn", "-tstep", "6", "-bs", "4", "-rf", "2", "--no-progress"]
    reports = {}
    for name, device in (("cpu", ["--device", "cpu"]), ("ipu", ["--device", "ipu", "--ipu-emulator"])):
        report = tmp_path / f"{name}.json"
        assert main(common + device + extra + ["-mf", str(tmp_path / f"{name}.pt"), "--report-json",
                                               str(report)]) == 0
        reports[name] = json.loads(report.read_text())
    cpu, ipu = _weights(tmp_path / "cpu.pt"), _weights(tmp_path / "ipu.pt")
    for key in cpu:
        torch.testing.assert_close(cpu[key], ipu[key], rtol=1e-5, atol=1e-6, msg=key)
    assert reports["cpu"]["valid"]["exs"] == reports["ipu"]["valid"]["exs"] == 1000
    assert reports["cpu"]["valid"]["accuracy"] == reports["ipu"]["valid"]["accuracy"]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
def test_two_torchrun_nodes_train_the_weights_of_one_process(tmp_path):
    """Two torchrun agents as two "nodes" on 127.0.0.1 (c10d rendezvous, one process each, gloo) run
    `accelbatch train -rf 2`; the weights equal one process running the same plan (the IPU emulator runs
    both replicas' micro-batches in turn, the same combined batch)."""
    import os
    import signal
    import subprocess
    import sys

    import torch
    from accelbatch.backends.distributed import find_free_port

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    common = ["train", "-t", "babi:1", "-m", "memnn", "-tstep", "6", "-bs", "4", "-rf", "2", "--no-progress"]
    port, env = find_free_port(), dict(os.environ, OMP_NUM_THREADS="1")
    nodes = [subprocess.Popen([torchrun, "--nnodes", "2", "--node-rank", str(rank), "--nproc-per-node", "1",
                               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
                               "accelbatch-test", "-m", "accelbatch", *common, "--device", "cpu",
                               "-mf", str(tmp_path / "nodes.pt"), "--report-json", str(tmp_path / "nodes.json")],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True)
             for rank in (0, 1)]
    try:
        outputs = [node.communicate(timeout=300)[0].decode() for node in nodes]
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    assert [node.returncode for node in nodes] == [0, 0], "\n".join(out[-3000:] for out in outputs)
    report = json.loads((tmp_path / "nodes.json").read_text())
    assert report["replicas"] == 2 and report["train"]["exs"] == 6 * 4 * 2 and report["valid"]["exs"] == 1000
    assert main(common + ["--device", "ipu", "--ipu-emulator", "-mf", str(tmp_path / "one.pt")]) == 0
    nodes_w, one = _weights(tmp_path / "nodes.pt"), _weights(tmp_path / "one.pt")
    for key in one:
        torch.testing.assert_close(nodes_w[key], one[key], rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchrun_processes_without_their_replication_factor_are_refused(tmp_path):
    """torchrun --nproc-per-node 2 with -rf left at 1 ran two whole trainings writing the same -mf; now each
    process says, in one line, that -rf disagrees with the processes running."""
    import os
    import subprocess
    import sys

    from accelbatch.backends.distributed import find_free_port

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    done = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(find_free_port()), "-m",
                           "accelbatch", "train", "-t", "babi:1", "-m", "memnn", "-tstep", "4", "--no-progress",
                           "--device", "cpu", "-mf", str(tmp_path / "m.pt")],
                          capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert done.returncode != 0
    # each process says it (two writes to one pipe may share a line; torchrun may end the second first)
    said = done.stderr.count("accelbatch: error: ")
    refused = done.stderr.count("accelbatch: error: --replication-factor 1 but 2 processes are running")
    assert 1 <= said == refused <= 2, done.stderr[-3000:]
    assert not (tmp_path / "m.pt").exists()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_real_replicas_report_an_agents_own_count_and_the_shared_skips_as_one_process(tmp_path, write_jsonl):
    """An agent's Metrics.add count (rows_replied: a sum) is the rows of every replica, as with -rf 1 and as
    the replicas emulated in one process (ab.run) count it; skipped_updates (a poisoned row's update, skipped
    by both replicas alike) is 1, not 2; the averages equal the emulated replicas'."""
    import accelbatch as ab

    rows = [{"text": "poison!" if i == 37 else "x" * (1 + i % 6), "labels": ["big" if i % 3 else "small"]}
            for i in range(101)]
    args = ["-t", f"jsonl:{write_jsonl(rows)}", "-m", "counting_agent:CountingLine", "-ne", "1", "-bs", "4",
            "--skip-nan", "-opt", "sgd", "-lr", "0.01", "--no-progress"]
    reports = {}
    for rf in ("1", "2"):
        path = tmp_path / f"rf{rf}.json"
        assert main(["train", *args, "-rf", rf, "--report-json", str(path)]) == 0
        reports[rf] = json.loads(path.read_text())
    assert reports["2"]["replicas"] == 2
    opts = ab.Opts.from_args([*args, "-rf", "2"])
    emulated = ab.run(ab.create_world(opts), opts)
    for split in ("train", "valid", "test"):
        one, real, emu = reports["1"][split], reports["2"][split], emulated[split]
        assert one["rows_replied"] == real["rows_replied"] == emu["rows_replied"] == one["exs"] == real["exs"], split
        for key in ("exs", "accuracy", "f1", "loss"):
            assert real[key] == pytest.approx(emu[key], rel=1e-6), (split, key)
    assert reports["1"]["train"]["skipped_updates"] == reports["2"]["train"]["skipped_updates"] == 1
    assert emulated["train"]["skipped_updates"] == 1
    assert not multiprocessing.active_children()


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_the_metrics_logs_train_windows_hold_every_replicas_rows(tmp_path):
    """Each train record merges the replicas' rows of its window, so the windows add up to the train row (they
    held rank 0's rows alone: half the examples)."""
    log, report = tmp_path / "log.jsonl", tmp_path / "r.json"
    assert main(["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-rf", "2", "-bs", "2", "-tstep", "6",
                 "-ltim", "0", "-veps", "-1", "--eval-splits", "", "--no-progress", "--metrics-log", str(log),
                 "--report-json", str(report)]) == 0
    windows = [r for r in map(json.loads, log.read_text().splitlines()) if r["split"] == "train"]
    train = json.loads(report.read_text())["train"]
    assert sum(w["exs"] for w in windows) == train["exs"] == 6 * 2 * 2
    merged_loss = sum(w["loss"] * w["exs"] for w in windows) / train["exs"]
    assert merged_loss == pytest.approx(train["loss"], rel=1e-6)
    # -ltim 0 (every step): one record a step from the first on (replicas merged steps 1 and 2 in one record)
    assert [(w["step"], w["exs"]) for w in windows] == [(step, 4) for step in range(1, 7)]


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_torchrun_replicas_stop_together_when_another_run_holds_the_model_file(tmp_path):
    """Rank 0 alone was refused the -mf lock; rank 1 waited in its first collective for the group's timeout,
    then printed gloo's traceback."""
    import os
    import subprocess
    import sys

    from accelbatch.backends.distributed import find_free_port

    from accelbatch.run_control import ModelFileLock

    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    if not os.path.exists(torchrun):
        pytest.skip("torchrun is not installed next to this python")
    held = ModelFileLock(str(tmp_path / "m.pt"))  # another training run's
    try:
        done = subprocess.run([torchrun, "--nproc-per-node", "2", "--master-port", str(find_free_port()), "-m",
                               "accelbatch", "train", "-t", "babi:1", "-m", "memnn", "-tstep", "4", "-rf", "2",
                               "--no-progress", "--device", "cpu", "--replica-timeout-s", "120",
                               "-mf", str(tmp_path / "m.pt")],
                              capture_output=True, text=True, timeout=240, env=dict(os.environ, OMP_NUM_THREADS="1"))
    finally:
        held.release()
    assert done.returncode != 0
    assert "another training run" in done.stderr and "is writing it now" in done.stderr, done.stderr[-3000:]
    # torchrun's own traceback (ChildFailedError) only: no replica's gloo error
    assert done.stderr.count("Traceback") <= 1 and "gloo" not in done.stderr, done.stderr[-3000:]


def test_a_torchrun_replica_whose_peer_went_away_says_so_in_one_line(monkeypatch):
    """The survivor of a killed torchrun replica printed gloo's 30-line traceback of its own wait."""
    from accelbatch.cli import error_message

    gloo = RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:41234: "
                        "Connection reset by peer\nException raised from ... (most recent call first):")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    code, line = error_message(gloo)
    assert code == 1 and line.startswith("replica 0 of 2: another replica went away during a collective")
    assert line.endswith("Connection reset by peer") and "\n" not in line
    assert error_message(RuntimeError("shape mismatch")) is None  # a bug keeps its traceback
    monkeypatch.delenv("RANK")
    assert error_message(gloo) is None  # not a torchrun replica: accelbatch's own supervisor names the lost one
