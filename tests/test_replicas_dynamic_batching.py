"""Real gloo replicas (`-rf 2 --device cpu`) with --dynamic-batching run the batches one process plans for the
combined batch, each its rows of every call: the weights and counts of the in-process replicas (IPU emulator, or
emulated on cpu)."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main

BABI = ["-t", "babi:1", "-m", "memnn", "-esz", "16", "-tstep", "20"]
DIALOGUES = ["-t", "dialogues:300", "-m", "bag", "-ne", "1"]
# replicas fed by the async accessor train the sync replicas' weights: test_resume_loader.py's async-R2 case
CASES = {
    "batchsort": BABI + ["--dynamic-batching", "batchsort"],
    "buckets": DIALOGUES + ["--dynamic-batching", "buckets"],  # a pass's partial batches left out: dropped_exs
    "no-drop-last": DIALOGUES + ["--dynamic-batching", "batchsort", "--no-drop-last"],  # a 7-row tail: [4, 3]
}


def _train(tmp_path, name: str, args: list[str]) -> tuple[dict, dict]:
    import torch

    model, report = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    # the valid split only: the test split's evaluation is checked nowhere here
    assert main(["train", *args, "--seed", "1", "-opt", "sgd", "-lr", "0.1", "-bs", "4", "-rf", "2",
                 "--eval-splits", "valid", "--no-progress", "-mf", str(model), "--report-json", str(report)]) == 0
    return torch.load(model, map_location="cpu", weights_only=True)["model"], json.loads(report.read_text())


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", list(CASES))
def test_real_replicas_train_the_in_process_replicas_weights_and_counts(tmp_path, monkeypatch, case):
    import torch

    real, real_rep = _train(tmp_path, "real", CASES[case] + ["--device", "cpu"])
    if case == "no-drop-last":  # the emulator trains no partial batch: the replicas emulated on cpu instead
        monkeypatch.setattr("accelbatch.cli._spawns_replicas", lambda opts: False)
        emu, emu_rep = _train(tmp_path, "emu", CASES[case] + ["--device", "cpu"])
    else:
        emu, emu_rep = _train(tmp_path, "emu", CASES[case] + ["--device", "ipu", "--ipu-emulator"])
    assert real_rep["replicas"] == 2
    for key in emu:
        torch.testing.assert_close(real[key], emu[key], rtol=0, atol=1e-6, msg=key)
    keys = ["steps", "epochs", "accuracy", "dropped_exs", "exs"]  # exs: also when a tail's shares differ
    assert {k: real_rep["train"].get(k) for k in keys} == {k: emu_rep["train"].get(k) for k in keys}
    # evaluation too runs the batches one process plans: each replica process planned its own share before
    assert {k: real_rep["valid"].get(k) for k in ("accuracy", "exs")} == \
        {k: emu_rep["valid"].get(k) for k in ("accuracy", "exs")}
    # the padding counts what each process is fed: a replica process pads its rows to their own longest, the
    # in-process replicas (one tensor) to the combined batch's; static shapes (buckets) are the same either way
    tokens = real_rep["valid"]["batch_tokens"], emu_rep["valid"]["batch_tokens"]
    assert tokens[0] == tokens[1] if case.startswith("buckets") else tokens[0] < tokens[1], tokens
    if case.startswith("buckets"):  # every example trained or counted as left out, as one process counts them
        assert emu_rep["train"]["dropped_exs"] > 0
        assert real_rep["train"]["exs"] + real_rep["train"]["dropped_exs"] == 647


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(400)
@pytest.mark.parametrize("batching", ["full", "batchsort"])
def test_replica_processes_evaluate_the_batches_one_process_plans(tmp_path, batching):
    """full: a call whose rows for replica 1 are all padding (that replica's batch of none); batchsort: a
    tail of 26 rows for D x R = 4 micro-batches (their rows 8, 8, 8, 2)."""
    reports = {}
    for device in (["--device", "cpu"], ["--device", "ipu", "--ipu-emulator"]):
        out = tmp_path / f"{device[1]}.json"
        assert main(["eval", "-t", "dialogues:200", "-m", "bag", "--seed", "5", "-bs", "8", "-di", "2", "-rf", "2",
                     "-dt", "valid", "--dynamic-batching", batching, "--no-progress", *device,
                     "--report-json", str(out)]) == 0
        reports[device[1]] = json.loads(out.read_text())["valid"]
    keys = ("exs", "accuracy", "f1")
    assert {k: reports["cpu"][k] for k in keys} == {k: reports["ipu"][k] for k in keys}
    # the padding counts what each process is fed: a replica process pads its rows to their own longest, the
    # IPU's replicas are fed one tensor padded to the combined batch's longest row
    assert reports["cpu"]["batch_tokens"] < reports["ipu"]["batch_tokens"]
    assert reports["cpu"]["exs"] == 122 and reports["cpu"]["pad_fraction"] > 0
