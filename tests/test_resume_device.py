"""A --resume goes on where and how the run ran: a stopped IPU run resumes on the IPU with the optimizer state
the device kept (same weights as the run never stopped); resumed on another device, that state cannot be read
there, which is said in one line."""

from __future__ import annotations

import json

import pytest
import torch

from accelbatch.cli import main

RUN = ["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-bs", "4", "-di", "2", "-opt", "adam", "--seed", "9",
       "--no-progress", "--eval-splits", ""]
IPU = ["--device", "ipu", "--ipu-emulator"]


def _weights(path) -> dict[str, torch.Tensor]:
    saved = torch.load(path, weights_only=True)
    return saved.get("model", saved)


def _uninterrupted(tmp_path) -> dict[str, torch.Tensor]:
    assert main([*RUN, *IPU, "-tstep", "6", "-mf", str(tmp_path / "full.pt")]) == 0
    return _weights(tmp_path / "full.pt")


@pytest.mark.slow
def test_a_stopped_ipu_run_resumes_on_the_ipu_with_its_optimizer_state(tmp_path, capfd, caplog):
    full = _uninterrupted(tmp_path)
    part = tmp_path / "part.pt"
    assert main([*RUN, *IPU, "-tstep", "3", "-mf", str(part)]) == 0
    capfd.readouterr()
    caplog.clear()
    assert main(["train", "-mf", str(part), "--resume", "-tstep", "6"]) == 0
    out = capfd.readouterr().out
    assert out.rstrip().splitlines()[-2] == "device: ipu" and "starts afresh" not in caplog.text, (out, caplog.text)
    resumed = _weights(part)
    assert all(torch.equal(full[k], resumed[k]) for k in full)


@pytest.mark.slow
def test_resumed_on_another_device_the_ipus_optimizer_state_is_said_to_start_afresh(tmp_path, caplog):
    part = tmp_path / "part.pt"
    assert main([*RUN, *IPU, "-tstep", "3", "-mf", str(part)]) == 0
    assert main(["train", "-mf", str(part), "--resume", "-tstep", "6", "--device", "cpu"]) == 0
    assert "the checkpoint's Adam state was kept by an IPU (the device's format), which this device cannot read: " \
           "it starts afresh (resume with --device ipu to continue it)" in caplog.text


def test_a_cpu_model_continued_on_the_ipu_that_stays_the_best_is_evaluated_from_its_file(tmp_path):
    """The file's model validates better than the continued run's (-lr 1.0): the final valid reloads the file's
    weights into the IPU's engine, whose optimizer cannot take a CPU optimizer state (the run failed with
    RuntimeError 'Only IPU optimizer states can be loaded onto the IPU', its report lost)."""
    path, first, later = tmp_path / "m.pt", tmp_path / "first.json", tmp_path / "later.json"
    common = ["train", "-t", "babi:1", "-m", "bag", "-esz", "8", "-mf", str(path), "--eval-splits", "valid",
              "--no-progress"]
    assert main([*common, "-tstep", "40", "-veps", "0.2", "--report-json", str(first)]) == 0
    assert main([*common, *IPU, "-tstep", "3", "-veps", "-1", "-lr", "1.0", "--report-json", str(later)]) == 0
    read = [json.loads(p.read_text())["valid"] for p in (first, later)]
    assert read[1]["accuracy"] == read[0]["accuracy"] and read[1]["loss"] == pytest.approx(read[0]["loss"], 1e-5)
