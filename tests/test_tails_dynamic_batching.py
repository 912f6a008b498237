"""--no-drop-last with dynamic batching: a tail is a call whose rows are not a multiple of D x R x G; a multiple
trains as with --drop-last; a tail longer than the combined batch runs in at most D updates; replica processes
keep every batch --drop-last keeps; the option is refused only where it changes something."""

from __future__ import annotations

import json
import random
from functools import partial

import numpy as np
import pytest
import torch

from accelbatch.cli import main
from accelbatch.data.batching import BatchingConfig
from accelbatch.data.buckets import BucketShape
from accelbatch.data.schedule import BatchPlan, EpisodeTable
from accelbatch.data.steps import _every_replica_runs
from accelbatch.loader_world import _replica_rows
from accelbatch.opts import Opts
from accelbatch.plan import ExecutionPlan


def _rows(lay) -> list[int]:
    return [lay.micro_rows(j) for j in range(lay.num_micro_batches)]


def test_a_multiple_of_the_factor_is_no_tail_without_drop_last():
    """b=8, D=2: a 6-row dynamic batch runs D=2 updates of 3 rows, as PopTorch and --drop-last run it."""
    for drop_last in (True, False):
        lay = ExecutionPlan(micro_batch=8, device_iterations=2, drop_last=drop_last).layout(6)
        assert not lay.partial and _rows(lay) == [3, 3] and lay.updates == ((0,), (1,))
    tail = ExecutionPlan(micro_batch=8, device_iterations=2, drop_last=False).layout(7)  # 7 % 2: a tail
    assert tail.partial and _rows(tail) == [7] and tail.num_updates == 1


def test_a_tail_longer_than_the_combined_batch_runs_in_at_most_d_updates():
    """b=4, R=2 (combined 8): a 9-row tail is cut into ceil(9 / 2) = 5 and 4 rows, one update, a replica each."""
    plan = ExecutionPlan(micro_batch=4, replication_factor=2, drop_last=False)
    lay = plan.layout(9)
    assert lay.partial and _rows(lay) == [5, 4] and lay.replica == (0, 1) and lay.num_updates == 1
    assert lay.weight == pytest.approx([5 / 9, 4 / 9])
    assert _replica_rows(plan, 9) == [[0, 1, 2, 3, 4], [5, 6, 7, 8]]
    lay = ExecutionPlan(micro_batch=2, device_iterations=3, drop_last=False).layout(13)  # b' = ceil(13 / 3) = 5
    assert _rows(lay) == [5, 5, 3] and lay.num_updates == 3


def _bucket_counts(drop_last: bool) -> tuple[int, int]:
    """(batches, examples left out) of one pass that R=2 replica processes plan (b=4, combined 8)."""
    plan = ExecutionPlan(micro_batch=4, replication_factor=2, drop_last=drop_last)
    # 13 short examples: an 8-row batch and a 5-row partial one; 9 long ones: four full 2-row batches and 1 in
    # a partial one
    lengths = np.array([3] * 13 + [9] * 9)
    shapes = (BucketShape(padded_len=4, rows=8), BucketShape(padded_len=10, rows=2))
    batching = BatchingConfig("buckets", 4, max_tokens=40, shapes=shapes, row_multiple=2)
    runs = partial(_every_replica_runs, partial(_replica_rows, plan))
    bp = BatchPlan(EpisodeTable.of_lengths([1] * 22), 0, lengths, batching, True, False, 0, drop_last, runs)
    return bp.count(0)


def test_replica_processes_without_drop_last_drop_no_more_than_with_it():
    """Hand count. --drop-last keeps the full batches (8 rows, 4 x 2 rows): 16 trained, 6 left out. Without it
    the 5-row tail ([4, 1], a micro-batch per replica) trains too; only the 1-row tail is left out (replica 1
    would get no row): 21 trained, 1 left out. (It left out the 2-row batches too, 9 in all: a 2-row call ran as
    one micro-batch of 2 on replica 0.)"""
    assert _bucket_counts(True) == (5, 6)
    assert _bucket_counts(False) == (6, 1)


def _jsonl(path) -> None:
    rng = random.Random(3)
    words = ["alpha", "beta", "gamma", "delta", "xi"]
    with open(path, "w") as f:
        for i in range(53):
            text = " ".join(rng.choice(words) for _ in range(rng.randint(1, 12)))
            f.write(json.dumps({"text": f"{i} {text}", "labels": [rng.choice(words[:4])],
                                "label_candidates": words[:4], "episode_done": True}) + "\n")


def _train(tmp_path, name: str, args: list[str]) -> tuple[dict, dict]:
    model, report = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
    assert main(["train", "-m", "bag", "--seed", "5", "-ne", "1", "-opt", "sgd", "-lr", "0.1", "--no-progress",
                 "-veps", "-1", "--eval-splits", "valid", "-mf", str(model), "--report-json", str(report),
                 *args]) == 0
    return torch.load(model, map_location="cpu", weights_only=True)["model"], json.loads(report.read_text())


def _same_weights(a: dict, b: dict) -> None:
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)


def test_no_drop_last_trains_as_drop_last_when_nothing_is_dropped(tmp_path):
    """-di 2 with full dynamic batching: every batch has a multiple of 2 rows, none is dropped, so --drop-last
    is the reference: --no-drop-last trains the same weights (it ran 6-row batches as one update of 6)."""
    args = ["-t", "dialogues:60", "-bs", "8", "--dynamic-batching", "full", "--max-batch-tokens", "200", "-di", "2"]
    ref, ref_rep = _train(tmp_path, "ref", args + ["--drop-last"])
    got, rep = _train(tmp_path, "got", args + ["--no-drop-last"])
    assert "dropped_exs" not in ref_rep["train"] and ref_rep["train"]["exs"] == rep["train"]["exs"]
    _same_weights(ref, got)


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_replica_processes_train_a_long_tail_as_the_in_process_replicas(tmp_path, monkeypatch):
    """A bucket's partial batch of 9 real rows (more than the combined 8) trains in -rf 2 processes as in one
    process emulating the replicas (it failed: 'the batch dimension (9) must be a multiple of ... 2')."""
    data = tmp_path / "plain.jsonl"
    _jsonl(data)
    args = ["-t", f"jsonl:{data}", "-bs", "4", "--dynamic-batching", "buckets", "-rf", "2", "--device", "cpu"]
    real, real_rep = _train(tmp_path, "real", args + ["--no-drop-last"])
    dropped, dropped_rep = _train(tmp_path, "dropped", args + ["--drop-last"])
    monkeypatch.setattr("accelbatch.cli._spawns_replicas", lambda opts: False)
    emu, emu_rep = _train(tmp_path, "emu", args + ["--no-drop-last"])
    _same_weights(emu, real)
    assert real_rep["train"]["exs"] == emu_rep["train"]["exs"] == 53  # one-turn examples: nothing left out
    assert dropped_rep["train"]["exs"] + dropped_rep["train"]["dropped_exs"] == 53


def test_drop_last_help_says_what_each_case_trains(tmp_path):
    """What the help says, checked: batchsort's partial batch (53 = 13 x 4 + 1: a 1-row batch, mid-pass when
    shuffled) is trained with --no-drop-last and dropped with --drop-last; without dynamic batching the
    option changes nothing (the same weights)."""
    from accelbatch.opts import build_parser

    text = next(a.help for a in build_parser()._actions if "--drop-last" in a.option_strings)
    assert "--no-drop-last trains them" in text and "this option changes nothing" in text
    data = tmp_path / "plain.jsonl"
    _jsonl(data)
    args = ["-t", f"jsonl:{data}", "-bs", "4"]
    _, kept = _train(tmp_path, "kept", args + ["--dynamic-batching", "batchsort", "--no-drop-last"])
    _, dropped = _train(tmp_path, "dropped", args + ["--dynamic-batching", "batchsort", "--drop-last"])
    assert (kept["train"]["exs"], kept["train"].get("dropped_exs", 0)) == (53, 0)
    assert (dropped["train"]["exs"], dropped["train"]["dropped_exs"]) == (52, 1)
    _same_weights(_train(tmp_path, "a", args + ["--drop-last"])[0], _train(tmp_path, "b", args + ["--no-drop-last"])[0])


def test_ipu_no_drop_last_refused_only_with_dynamic_batching():
    """Without dynamic batching rows run on into the next pass, so --no-drop-last changes nothing on ipu."""
    from accelbatch.build import setup_runtime
    from accelbatch.opts import OptionError

    with pytest.raises(OptionError, match="--no-drop-last"):
        setup_runtime(Opts(device="ipu", ipu_emulator=True, drop_last=False, dynamic_batching="buckets"))
    runtime = setup_runtime(Opts(device="ipu", ipu_emulator=True, drop_last=False))
    assert runtime.plan.drop_last is False
