"""--no-drop-last with --dynamic-batching and replica processes: a batch of fewer rows than -rf would give a
replica process no row of its own, so it is left out (counted in dropped_exs), and the run says so in one line,
once, from the first replica."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_replica_processes_say_once_that_a_tail_with_fewer_rows_than_replicas_is_left_out(tmp_path, capfd):
    """Five examples, -bs 2 -rf 2 (combined batch 4): each pass trains a 4-row batch and leaves out its 1-row
    tail, which replica 1 would get no row of: 3 passes train 12 examples and leave out 3, said once."""
    data, report = tmp_path / "five.jsonl", tmp_path / "report.json"
    data.write_text("".join(json.dumps({"text": f"hello world {i}", "labels": ["a"], "label_candidates": ["a", "b"]})
                            + "\n" for i in range(1, 6)))
    assert main(["train", "-t", f"jsonl:{data}", "-m", "bag", "-bs", "2", "--dynamic-batching", "full",
                 "--max-batch-tokens", "1000", "-rf", "2", "--no-drop-last", "-ne", "3", "--eval-splits", "",
                 "--no-progress", "--report-json", str(report)]) == 0
    train = json.loads(report.read_text())["train"]
    assert (train["exs"], train["dropped_exs"]) == (12, 3)
    said = [line for line in capfd.readouterr().err.splitlines() if "--no-drop-last" in line]
    assert len(said) == 1, said
    assert said[0] == ("accelbatch: --no-drop-last: 3 examples left out (dropped_exs): batches of fewer rows than the "
                       "-rf 2 replica processes, one of which would have no row of its own; train with -rf 1 to keep "
                       "every example")
