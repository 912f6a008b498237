from __future__ import annotations

import pytest

from accelbatch.tasks.files import DataFileError, iter_episodes, load_episodes, parse_parlai_line


def test_parlai_format_fields_lists_and_escapes():
    msg = parse_parlai_line("text:hello\\tworld\tlabels:hi|hey\\|you\tepisode_done:True\n", "f.txt", 3)
    assert msg["text"] == "hello\tworld"
    assert msg["labels"] == ["hi", "hey|you"]
    assert msg["episode_done"] is True


def test_parlai_format_episodes_continue_until_episode_done(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("text:a\tlabels:1\ntext:b\tlabels:2\tepisode_done:True\n# a comment\n\ntext:c\tlabels:3\n")
    episodes = list(iter_episodes(str(path)))
    assert [[m["text"] for m in ep] for ep in episodes] == [["a", "b"], ["c"]]
    assert episodes[-1][-1]["episode_done"] is True  # an unfinished last episode is closed, not dropped


def test_jsonl_lines_are_single_episodes_by_default(write_jsonl):
    path = write_jsonl([{"text": "x", "labels": "y"}, {"text": "z", "labels": ["w"]}])
    episodes = load_episodes(path, "jsonl")
    assert len(episodes) == 2 and episodes[0][0]["labels"] == ["y"]


@pytest.mark.parametrize("content, bad_line, fragment", [
    ('{"text": "ok", "labels": ["a"]}\n{"text": "broken"\n', 2, "not valid JSON"),
    ('{"text": "ok", "labels": ["a"]}\n[1, 2]\n', 2, "expected an object"),
    ('{"text": "ok", "labels": 5}\n', 1, "'labels' must be a string or a list"),
    ('{"text": "ok", "labels": ["a"]}\n{"text": "ok", "labels": {"yes": 1}}\n', 2,
     "'labels' must be a string or a list"),
    ('{"id": "no text"}\n', 1, "no 'text' and no 'labels'"),
])
def test_malformed_jsonl_names_file_and_line(tmp_path, content, bad_line, fragment):
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(DataFileError, match=fragment) as exc:
        load_episodes(str(path), "jsonl")
    assert f"{path}:{bad_line}:" in str(exc.value)


def test_malformed_parlai_line_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_text("text:fine\tlabels:ok\tepisode_done:True\ntext:x\tnocolon\n")
    with pytest.raises(DataFileError, match=f"{path}:2: field 2"):
        load_episodes(str(path))


def test_empty_and_missing_files_are_errors(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    with pytest.raises(DataFileError, match="holds no examples"):
        load_episodes(str(empty))
    with pytest.raises(DataFileError, match="no such file"):
        load_episodes(str(tmp_path / "missing.jsonl"))


@pytest.mark.parametrize("line, missing", [("text:hello\tepisode_done:True", "no labels: field"),
                                           ("labels:hi\tepisode_done:True", "no text: field"),
                                           ("episode_done:True", "no text: and no labels: field"),
                                           ("id:x\ttext:hello", "no labels: field")])
def test_a_parlai_line_without_text_or_labels_names_file_and_line(tmp_path, line, missing):
    path = tmp_path / "train.txt"
    path.write_text(f"text:a\tlabels:b\n{line}\n")
    with pytest.raises(DataFileError, match=f"{path}:2: {missing}; every line of a ParlAI-format file needs both"):
        load_episodes(str(path))


def test_a_parlai_line_with_eval_labels_has_its_answers(tmp_path):
    path = tmp_path / "valid.txt"
    path.write_text("text:a\teval_labels:b\tepisode_done:True\n")
    assert load_episodes(str(path))[0][0]["eval_labels"] == ["b"]
