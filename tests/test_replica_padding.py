"""Padding figures count what each process is fed: with -rf 2 and dynamic batching each replica pads its rows of a
combined batch to their own longest row, and batch_tokens / pad_fraction add up those tensors (they described the
combined batch padded as one)."""

from __future__ import annotations

import json

import pytest

from accelbatch.cli import main


def _fed(record, mode):
    lines = [line.split() for line in record.read_text().splitlines() if line.startswith(mode)]
    fed = sum(int(rows) * int(width) for _, rows, width, _ in lines)
    real = sum(int(tokens) for *_, tokens in lines)
    return fed, (fed - real) / fed


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
@pytest.mark.parametrize("mode", ["full", "batchsort"])
def test_replicas_report_the_padding_of_the_tensors_they_are_fed(tmp_path, monkeypatch, mode):
    texts = [" ".join(f"w{(i * 7 + j) % 23}" for j in range(1 + (i * 5) % 11)) for i in range(40)]
    for split in ("train", "valid"):
        (tmp_path / f"{split}.jsonl").write_text("".join(
            json.dumps({"text": text, "labels": ["yes" if i % 3 else "no"], "label_candidates": ["yes", "no"],
                        "episode_done": True}) + "\n" for i, text in enumerate(texts)))
    record, report = tmp_path / "shapes.txt", tmp_path / "report.json"
    monkeypatch.setenv("RECORD_SHAPES", str(record))
    assert main(["train", "-t", f"jsonl:{tmp_path}", "-m", "recording_agent:ShapeRecordingBag", "-bs", "3",
                 "-tr", "10", "--dynamic-batching", mode, "-rf", "2", "-ne", "1", "--no-progress", "-veps", "-1",
                 "--eval-splits", "valid", "--report-json", str(report)]) == 0
    scores = json.loads(report.read_text())
    for split, kind in (("train", "train"), ("valid", "eval")):
        fed, padding = _fed(record, kind)
        assert scores[split]["batch_tokens"] == fed, split
        assert scores[split]["pad_fraction"] == pytest.approx(padding, abs=1e-4), split
