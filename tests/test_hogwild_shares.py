"""Hogwild (-nt N) shares the training episodes between N processes: data of fewer episodes than processes is
refused in one line before any process starts, naming how many would have none."""

from __future__ import annotations

from accelbatch.cli import main


def test_more_hogwild_processes_than_episodes_are_refused_before_any_starts(tmp_path, capsys, monkeypatch):
    """3 episodes cannot be shared by 5 processes: 2 would have none, said before a process starts (each of
    them refused its share, after all had started: -nt 100 ran 100 processes first)."""
    import accelbatch.hogwild as hogwild

    def no_start(*args, **kwargs):
        raise AssertionError("a hogwild process was started")

    monkeypatch.setattr(hogwild.HogwildWorld, "_start", no_start, raising=False)
    monkeypatch.setattr(hogwild.HogwildWorld, "__init__", no_start)
    data = tmp_path / "three.jsonl"
    data.write_text("".join(f'{{"text": "q{i}", "labels": ["x"], "label_candidates": ["x", "y"]}}\n' for i in range(3)))
    assert main(["train", "-t", f"jsonl:{data}", "-m", "bag", "-bs", "1", "-nt", "5", "--no-progress"]) == 2
    assert (f"-t jsonl:{data}: 3 training episode(s) cannot be shared by 5 replicas or processes (-rf / -nt): 2 would "
            "have none; use fewer, or train on more data") in capsys.readouterr().err
