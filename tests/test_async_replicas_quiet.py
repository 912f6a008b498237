"""Replicas fed by the asynchronous accessor over a torch DataLoader with workers end without a word: the
accessor's worker, stopped while it waits for its DataLoader's workers, printed two tracebacks of their
deaths (torch's SIGCHLD handler) on a run that ended well."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

DATA = textwrap.dedent("""
    import torch

    def make_dataset(split):
        g = torch.Generator().manual_seed({"train": 1, "valid": 2, "test": 3}[split])
        x = torch.randn(48 if split == "train" else 10, 3, generator=g)
        return torch.utils.data.TensorDataset(x, x @ torch.tensor([[1.0], [-2.0], [0.5]]))

    class Lin(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.l = torch.nn.Linear(3, 1)

        def forward(self, x, y=None):
            out = self.l(x)
            return out if y is None else (out, torch.nn.functional.mse_loss(out, y))
""")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_replicas_with_an_async_rebatched_dataloader_end_without_tracebacks(tmp_path):
    (tmp_path / "tp.py").write_text(DATA)
    ran = subprocess.run(
        [sys.executable, "-m", "accelbatch", "train", "-t", "torch:tp:make_dataset", "-m", "torch:tp:Lin",
         "-dt", "train:ordered", "-opt", "sgd", "-bs", "2", "-di", "2", "-ga", "3", "-ne", "1", "-vmt", "loss",
         "--no-progress", "--eval-splits", "valid", "--device", "cpu", "-rf", "2",
         "--dataloader-mode", "async-rebatched", "--num-workers", "2"],
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path)},
        capture_output=True, text=True, timeout=170)
    assert ran.returncode == 0, ran.stderr
    assert "Traceback" not in ran.stderr and "killed by signal" not in ran.stderr, ran.stderr


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("command", [["train", "-ne", "1", "-rf", "2"], ["eval", "-dt", "valid", "-nt", "2"]],
                         ids=["replicas", "hogwild"])
def test_an_evaluation_split_smaller_than_the_processes_is_scored_once_in_every_mode(tmp_path, command):
    """One valid example and two processes: one of them has no rows. The asynchronous accessor refused its
    empty pass ("the source yielded no batches", exit 1) where sync loading scores the one example."""
    def example(i):
        return json.dumps({"text": f"q{i} say a", "labels": ["a"], "label_candidates": ["a", "b"],
                           "episode_done": True}) + "\n"

    (tmp_path / "train.jsonl").write_text("".join(example(i) for i in range(8)))
    for split in ("valid", "test"):
        (tmp_path / f"{split}.jsonl").write_text(example(100))
    reports = {}
    for mode in ("sync", "async"):
        out = tmp_path / f"{mode}.json"
        ran = subprocess.run(
            [sys.executable, "-m", "accelbatch", *command, "-t", f"jsonl:{tmp_path}", "-m", "bag", "-bs", "2",
             "--no-progress", "--dataloader-mode", mode, "--report-json", str(out)],
            cwd=tmp_path, capture_output=True, text=True, timeout=110)
        assert ran.returncode == 0, ran.stderr
        reports[mode] = json.loads(out.read_text())
    for split in ("valid", "test") if command[0] == "train" else ("valid",):
        assert reports["async"][split]["exs"] == reports["sync"][split]["exs"] == 1
        assert reports["async"][split]["accuracy"] == reports["sync"][split]["accuracy"]
