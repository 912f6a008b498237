"""-t splits on commas (ParlAI's multitask syntax): a data file whose name holds a comma cannot be given, and
the error says so instead of only "no such file" for the part before the comma."""

from __future__ import annotations

from pathlib import Path

import pytest

from accelbatch.cli import main


def _write_jsonl(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('{"text": "hi", "labels": ["hi"], "episode_done": true}\n')


def _error_line(capsys: pytest.CaptureFixture, task: str) -> str:
    """The stderr line of ``accelbatch eval -t TASK -m repeat_label`` (which must exit 2)."""
    assert main(["eval", "-t", task, "-m", "repeat_label"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1, lines
    return lines[0]


def test_comma_in_an_existing_file_name_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                 capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "w" / "a,b.jsonl")
    task = "jsonl:w/a,b.jsonl"
    first, second = task.split(",")
    expected = (f"accelbatch: error: -t {task}: commas separate tasks (multitask), so this is the tasks "
                f"'{first}' and '{second}'; the file {task.partition(':')[2]} exists: rename it without the comma")
    assert _error_line(capsys, task) == expected


def test_two_commas_join_three_parts(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    target = tmp_path / "x,y,z.txt"
    target.write_text("text:hi\tlabels:hi\tepisode_done:True\n")
    task = f"parlai:{target}"
    parts = task.split(",")
    assert len(parts) == 3
    line = _error_line(capsys, task)
    assert f"so this is the tasks '{parts[0]}', '{parts[1]}' and '{parts[2]}'" in line
    assert line.endswith(f"the file {target} exists: rename it without the comma")


def test_comma_in_an_existing_folder_name_is_named(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    folder = tmp_path / "d,1"
    _write_jsonl(folder / "valid.jsonl")
    line = _error_line(capsys, f"jsonl:{folder}")
    assert line.endswith(f"the file {folder / 'valid.jsonl'} exists: rename it without the comma")


def test_missing_path_without_comma_keeps_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                       capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    assert _error_line(capsys, "jsonl:w/zz.jsonl") == \
        "accelbatch: error: w/zz.jsonl: no such file; check the path given to -t"


def test_comma_with_no_joined_file_keeps_its_message(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    monkeypatch.chdir(tmp_path)
    _write_jsonl(tmp_path / "w" / "other.jsonl")  # neither w/a nor w/a,b.jsonl exists
    assert _error_line(capsys, "jsonl:w/a,b.jsonl") == \
        "accelbatch: error: w/a: no such file; check the path given to -t"


def test_tasks_with_commas_still_run_as_multitask(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    one, two = tmp_path / "one.jsonl", tmp_path / "two.jsonl"
    _write_jsonl(one)
    _write_jsonl(two)
    assert main(["eval", "-t", f"jsonl:{one},jsonl:{two}", "-m", "repeat_label"]) == 0
