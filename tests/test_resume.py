"""Kill a training run (SIGKILL at a random point, or SIGTERM) and --resume: nothing lost or repeated."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from helpers import wait_for_first_checkpoint, write_qa_episodes

from accelbatch.checkpoint import load_checkpoint


def _dataset(root):
    write_qa_episodes(root)


def _command(root, model_file, *extra):
    return [sys.executable, "-m", "accelbatch", "train", "-t", f"jsonl:{root}/data", "-m", "memnn", "-bs", "3",
            "-ne", "2", "-veps", "-1", "--eval-splits", "", "--no-progress", "-ltim", "1000",
            "-mf", str(model_file), *extra]


ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def _weights(path):
    return torch.load(path, weights_only=True)["model"]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("how, plan", [("SIGKILL", ()), ("SIGTERM", ()),
                                       ("SIGKILL", ("-bs", "1", "-ga", "3", "-di", "2"))],
                         ids=["SIGKILL", "SIGTERM", "SIGKILL-ga3-di2"])
@pytest.mark.multiprocess
@pytest.mark.slow
def test_interrupted_run_resumes_to_the_same_weights(tmp_path, how, plan):
    """A checkpoint is taken between world steps; a step is the whole combined batch (b x D x R x G), so
    with gradient accumulation the cut never splits an accumulation window and the resume starts the next."""
    _dataset(tmp_path)
    reference = tmp_path / "ref" / "model.pt"
    subprocess.run(_command(tmp_path, reference, *plan, "--report-json", str(tmp_path / "ref.json")), env=ENV,
                   check=True, capture_output=True, timeout=240)

    model = tmp_path / "cut" / "model.pt"
    proc = subprocess.Popen(_command(tmp_path, model, "--save-every-n-secs", "0.01", *plan), env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_first_checkpoint(proc, model, max_delay_s=0.4)
    proc.send_signal(getattr(signal, how))
    _, err = proc.communicate(timeout=60)
    if how == "SIGTERM":
        assert proc.returncode == 130 and "continue with --resume" in err
    steps_at_cut = load_checkpoint(str(model)).state["train"]["steps"]
    assert steps_at_cut > 0

    resumed = subprocess.run(_command(tmp_path, model, "--resume", *plan, "--report-json",
                                      str(tmp_path / "cut.json")), env=ENV, capture_output=True, text=True,
                             timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    ref, got = _weights(reference), _weights(model)
    assert ref.keys() == got.keys()
    for key in ref:
        assert torch.equal(ref[key], got[key]), key
    # the train row covers the examples trained before the cut (kept in the checkpoint) and after it
    ref_train, cut_train = (json.loads((tmp_path / f"{n}.json").read_text())["train"] for n in ("ref", "cut"))
    assert cut_train["exs"] == ref_train["exs"]
    for key in ("loss", "accuracy"):
        assert cut_train[key] == pytest.approx(ref_train[key], abs=1e-6), key


def test_a_tampered_checkpoint_is_refused_with_a_clear_message(tmp_path, capsys):
    from accelbatch.cli import main

    _dataset(tmp_path)
    model = tmp_path / "m" / "model.pt"
    assert main(["train", "-t", f"jsonl:{tmp_path}/data", "-bs", "3", "-tstep", "4", "--save-every-n-secs",
                 "0.001", "-mf", str(model), "--no-progress", "--eval-splits", "", "-veps", "-1"]) == 0
    state = next((tmp_path / "m" / "model.pt.ckpt").glob("gen-*")) / "state.json"
    state.write_text(state.read_text().replace('"steps": 4', '"steps": 5'))
    assert main(["train", "-t", f"jsonl:{tmp_path}/data", "-bs", "3", "-tstep", "8", "--resume",
                 "-mf", str(model), "--no-progress", "--eval-splits", "", "-veps", "-1"]) == 2
    err = capsys.readouterr().err
    assert "state.json" in err and "--resume" in err
