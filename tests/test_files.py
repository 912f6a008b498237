from __future__ import annotations

import re
import sys

import pytest

from accelbatch.tasks.files import DataFileError, FileIndex, iter_episodes, load_episodes, parse_parlai_line


def test_parlai_format_fields_lists_and_escapes():
    msg = parse_parlai_line("text:hello\\tworld\tlabels:hi|hey__PIPE__you\tepisode_done:True\n", "f.txt", 3)
    assert msg["text"] == "hello\tworld"
    assert msg["labels"] == ["hi", "hey|you"]
    assert msg["episode_done"] is True


def test_parlai_format_episodes_continue_until_episode_done(tmp_path):
    path = tmp_path / "d.txt"
    path.write_text("text:a\tlabels:1\ntext:b\tlabels:2\tepisode_done:True\n\ntext:c\tlabels:3\n")
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


@pytest.mark.parametrize("ending", ["\n", "\r\n", ""], ids=["lf", "crlf", "last-line"])
def test_a_bad_json_line_names_the_column_in_that_line(tmp_path, ending):
    """'{"text": "hello", "labels": ["a"]' lacks its closing brace: the parser expects it at column 34, one past
    the line's 33 characters, whatever ends the line (it used to say column 1 of the next line)."""
    path = tmp_path / "bad.jsonl"
    path.write_bytes(('{"text": "ok", "labels": ["a"]}\n{"text": "hello", "labels": ["a"]' + ending).encode())
    with pytest.raises(DataFileError) as exc:
        load_episodes(str(path), "jsonl")
    assert f"{path}:2: not valid JSON (Expecting ',' delimiter at column 34)" in str(exc.value)
    path.write_text('{"text": "ok" "labels": ["a"]}\n')  # a missing comma inside the line: where it is
    with pytest.raises(DataFileError, match=r":1: not valid JSON \(Expecting ',' delimiter at column 15\)"):
        load_episodes(str(path), "jsonl")


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


NEEDS_BOTH = "; every line of a ParlAI-format file needs both"
HASH = r".* \(a line starting with '#' is not a comment in the ParlAI format: remove it\)"


@pytest.mark.parametrize("line, error", [("text:hello\tepisode_done:True", "no labels: field" + NEEDS_BOTH),
                                         ("labels:hi\tepisode_done:True", "no text: field" + NEEDS_BOTH),
                                         ("episode_done:True", "no text: and no labels: field" + NEEDS_BOTH),
                                         ("id:x\ttext:hello", "no labels: field" + NEEDS_BOTH),
                                         # ParlAI reads every line as an exchange: a '#' line is no comment
                                         ("#text:commented\tlabels:x", "no text: field" + NEEDS_BOTH + HASH),
                                         ("# a comment", "field 1 '# a comment' is not 'key:value'" + HASH)])
def test_a_parlai_line_without_text_or_labels_names_file_and_line(tmp_path, line, error):
    path = tmp_path / "train.txt"
    path.write_text(f"text:a\tlabels:b\n{line}\n")
    with pytest.raises(DataFileError, match=f"{path}:2: {error}"):
        load_episodes(str(path))


def test_a_parlai_line_with_eval_labels_has_its_answers(tmp_path):
    path = tmp_path / "valid.txt"
    path.write_text("text:a\teval_labels:b\tepisode_done:True\n")
    assert load_episodes(str(path))[0][0]["eval_labels"] == ["b"]


# ParlAI's text format as ParlAI reads it (parlai/utils/misc.py str_to_msg): every real tab separates fields,
# "|" separates list items, and in a value the two characters \t, \n and the word __PIPE__ stand for a tab, a
# newline and "|"; a backslash is no escape of its own. The expected values below are written out by hand.

def _msg_to_str(msg: dict) -> str:
    """A ParlAI-format line as ParlAI's msg_to_str writes one (tab -> \\t, newline -> \\n, | -> __PIPE__)."""
    def esc(value: str) -> str:
        return value.replace("\t", "\\t").replace("\n", "\\n").replace("|", "__PIPE__")
    fields = [f"{k}:{'|'.join(esc(v) for v in val) if isinstance(val, list) else esc(val)}"
              for k, val in msg.items()]
    return "\t".join(fields)


def test_a_backslash_ending_a_parlai_value_does_not_hide_the_next_tab(tmp_path):
    path = tmp_path / "win.txt"
    path.write_bytes(b"labels:ok\ttext:dir C:\\\tepisode_done:True\nlabels:k\ttext:b\n"
                     b"text:dir D:\\\tlabels:fine\n")
    episodes = load_episodes(str(path))
    assert [[(m["text"], m["labels"]) for m in ep] for ep in episodes] == [
        [("dir C:\\", ["ok"])],  # episode_done:True is its own field: the episode ends here
        [("b", ["k"]), ("dir D:\\", ["fine"])]]


def test_parlai_escapes_are_read_as_parlai_reads_them(tmp_path):
    path = tmp_path / "esc.txt"
    path.write_bytes(b"text:a\\\\nb\tlabels:x__PIPE__y|z\n"
                     b"text:tab\\there|pipe\\\\x\tlabels:a\\|b\tlabel_candidates:p__PIPE__q|r\\ts\tid:i__PIPE__d\n")
    first, second = load_episodes(str(path))[0]
    assert first["text"] == "a" + "\\" + "\n" + "b"  # \\n: a backslash, then the escape \n
    assert first["labels"] == ["x|y", "z"]
    assert second["text"] == "tab" + "\t" + "here|pipe" + "\\" * 2 + "x"
    assert second["labels"] == ["a" + "\\", "b"]  # \| is no escape: a label ending in a backslash
    assert second["label_candidates"] == ["p|q", "r\ts"]
    assert second["id"] == "i|d"


def test_what_parlais_writer_writes_reads_back_the_same(tmp_path):
    messages = [{"text": "C:\\ and a\ttab | pipe\nnewline \\\\server", "labels": ["x|y", "ends in \\", "z"]},
                {"text": "second", "labels": ["\\"], "label_candidates": ["\\", "a|b", "c\td"]}]
    path = tmp_path / "written.txt"
    path.write_text("".join(_msg_to_str(m) + "\n" for m in messages), encoding="utf-8")
    read = [dict(m) for m in load_episodes(str(path))[0]]
    assert read == [{**m, "episode_done": i == len(messages) - 1} for i, m in enumerate(messages)]


def test_a_field_given_twice_on_a_parlai_line_is_an_error(tmp_path):
    path = tmp_path / "twice.txt"
    path.write_text("text:a\tlabels:b\ntext:c\tlabels:d\ttext:e\n")
    with pytest.raises(DataFileError, match=f"{path}:2: field 3 gives text: a second time"):
        load_episodes(str(path))


@pytest.mark.parametrize("name, body", [
    ("bom.txt", b"text:a\tlabels:b\tepisode_done:True\ntext:c\tlabels:d|e\n"),
    ("bom.jsonl", b'{"text": "a", "labels": ["b"]}\n{"text": "c", "labels": ["d", "e"]}\n'),
    ("bom_blank.txt", b"\ntext:a\tlabels:b\tepisode_done:True\ntext:c\tlabels:d|e\n"),
], ids=["parlai", "jsonl", "parlai-blank-line"])
def test_a_utf8_bom_starting_the_file_is_not_data(tmp_path, name, body):
    path = tmp_path / name
    path.write_bytes(b"\xef\xbb\xbf" + body)
    episodes = [[dict(m) for m in ep] for ep in load_episodes(str(path))]
    assert episodes == [[{"text": "a", "labels": ["b"], "episode_done": True}],
                        [{"text": "c", "labels": ["d", "e"], "episode_done": True}]]


@pytest.mark.parametrize("name, body, error", [
    ("joined.txt", b"text:a\tlabels:b\n\xef\xbb\xbftext:c\tlabels:d\n", ":2: the line starts with a byte-order mark"),
    ("joined.jsonl", b'{"text": "a", "labels": ["b"]}\n\xef\xbb\xbf{"text": "c", "labels": ["d"]}\n',
     ":2: the line starts with a byte-order mark"),
    ("cr.txt", b"text:a\tlabels:x\rtext:b\tlabels:y\r", ":1: a carriage return .* convert them to"),
    ("cr.jsonl", b'{"text": "a", "labels": ["x"]}\r{"text": "b", "labels": ["y"]}\r',
     ":1: a carriage return .* convert them to"),
], ids=["bom-parlai", "bom-jsonl", "lone-cr-parlai", "lone-cr-jsonl"])
def test_a_bom_after_the_first_line_or_lone_carriage_return_line_ends_are_named(tmp_path, name, body, error):
    """Files joined together (a BOM mid-file), lines ending in a lone \\r (classic Mac): named with the fix."""
    path = tmp_path / name
    path.write_bytes(body)
    with pytest.raises(DataFileError, match=f"{path}{error}"):
        load_episodes(str(path))


@pytest.mark.parametrize("ending", [b"\n", b"\r\n"], ids=["lf", "crlf"])
def test_a_carriage_return_inside_a_parlai_value_is_kept_as_parlai_keeps_it(tmp_path, ending):
    """ParlAI's reader splits lines on \\n alone: a \\r inside a value is part of it (it was refused as classic
    Mac line ends, whose suggested conversion split the example in two)."""
    path = tmp_path / "stray.txt"
    path.write_bytes(b"text:a\tlabels:x" + ending + b"text:say \rhi\tlabels:y\rz|w" + ending)
    episodes = [[dict(m) for m in ep] for ep in load_episodes(str(path))]
    assert episodes == [[{"text": "a", "labels": ["x"], "episode_done": False},
                         {"text": "say \rhi", "labels": ["y\rz", "w"], "episode_done": True}]]


@pytest.mark.parametrize("last", [b"text:e\tlabels:f\r", b"text:e\tlabels:f\tepisode_done:True\r"],
                         ids=["label", "episode_done"])
def test_a_crlf_files_last_line_without_its_newline_keeps_no_carriage_return(tmp_path, last):
    path = tmp_path / "crlf.txt"
    path.write_bytes(b"text:a\tlabels:b\r\n" + last)
    episodes = [[dict(m) for m in ep] for ep in load_episodes(str(path))]
    assert episodes == [[{"text": "a", "labels": ["b"], "episode_done": False},
                         {"text": "e", "labels": ["f"], "episode_done": True}]]


# a JSON escape of half a UTF-16 pair (\ud83d: an emoji cut in two) decodes to a string no UTF-8 encoder takes
@pytest.mark.parametrize("row, field", [
    ('{"text": "cut \\ud83d", "labels": ["a"]}', "'text'"),
    ('{"text": "t", "labels": ["a", "b\\udc00"]}', "'labels'[1]"),
    ('{"text": "t", "eval_labels": ["\\ud83d!"]}', "'eval_labels'[0]"),
    ('{"text": "t", "labels": ["a"], "label_candidates": ["a", "\\ud800"]}', "'label_candidates'[1]"),
    ('{"text": "t", "labels": ["a"], "text_candidates": ["\\udfff"]}', "'text_candidates'[0]"),
    ('{"text": "t", "labels": ["a"], "id": "sp\\ud83deaker"}', "'id'"),
    ('{"text": "t", "labels": ["a"], "meta": {"notes": ["ok", "\\ud83d"]}}', "'meta'['notes'][1]"),
    ('{"text": "t", "labels": ["a"], "\\ud83d": 1}', "the key '\\ud83d'"),
], ids=["text", "labels", "eval_labels", "label_candidates", "text_candidates", "id", "nested", "key"])
def test_a_lone_surrogate_in_a_jsonl_string_names_file_line_and_field(tmp_path, row, field):
    path = tmp_path / "cut.jsonl"
    path.write_text('{"text": "smile \\ud83d\\ude00", "labels": ["a"]}\n' + row + "\n", encoding="ascii")
    with pytest.raises(DataFileError) as exc:
        load_episodes(str(path))
    message = str(exc.value)
    assert message.startswith(f"{path}:2: {field} is not valid Unicode: a lone surrogate \\u")
    assert "\n" not in message and "remove" in message
    message.encode("utf-8")  # the message itself prints
    path.write_text('{"text": "smile \\ud83d\\ude00", "labels": ["a"]}\n', encoding="ascii")
    assert load_episodes(str(path))[0][0]["text"] == "smile \N{GRINNING FACE}"  # a whole pair is one character


@pytest.mark.parametrize("verb", [["display-data"], ["eval"], ["train", "-ne", "1", "--no-progress"]],
                         ids=["display-data", "eval", "train"])
def test_a_lone_surrogate_ends_every_verb_in_one_line(tmp_path, capsys, verb):
    from accelbatch.cli import main

    path = tmp_path / "cut.jsonl"
    path.write_text('{"text": "ok", "labels": ["a"]}\n{"text": "cut \\ud83d", "labels": ["a"]}\n', encoding="ascii")
    rc = main([verb[0], "-t", f"jsonl:{path}", *verb[1:]])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and f"{path}:2: 'text' is not valid Unicode" in err[0]


def test_a_streamed_file_gives_the_examples_of_the_loaded_file(tmp_path):
    """Streaming reads each episode again from its offset: the same fixed parsing, the same examples."""
    path = tmp_path / "mixed.txt"
    path.write_bytes(b"\xef\xbb\xbftext:dir C:\\\tlabels:x__PIPE__y|z\tepisode_done:True\r\n"
                     b"text:a\\\\nb\tlabels:b\\\r\n"
                     b"text:c\tlabels:d\tepisode_done:True\r")
    expected = [[{"text": "dir C:\\", "labels": ["x|y", "z"], "episode_done": True}],
                [{"text": "a\\\nb", "labels": ["b\\"], "episode_done": False},
                 {"text": "c", "labels": ["d"], "episode_done": True}]]
    index = FileIndex.build(str(path))
    streamed = [[dict(m) for m in index.read(i)] for i in range(len(index.turns))]
    assert streamed == expected
    assert [[dict(m) for m in ep] for ep in load_episodes(str(path))] == expected


def test_a_jsonl_key_given_twice_is_an_error_and_keys_in_values_or_nested_objects_are_not(tmp_path):
    good = tmp_path / "good.jsonl"
    good.write_text('{"text": "say \\"x\\": y", "labels": ["a"], "meta": {"text": "inner", "labels": 1}}\n')
    [[msg]] = load_episodes(str(good))
    assert msg["text"] == 'say "x": y' and msg["meta"] == {"text": "inner", "labels": 1}
    bad = tmp_path / "bad.jsonl"
    for second in ('{"text": "a", "labels": ["x"], "text": "b"}', '{"text" : "a", "labels" : ["x"], "text" : "b"}',
                   '{"text"\t:"a", "labels":["x"], "text":"b"}'):  # JSON allows whitespace before the colon
        bad.write_text('{"text": "a", "labels": ["x"]}\n' + second + "\n")
        with pytest.raises(DataFileError, match=f"{bad}:2: the key 'text' is given twice"):
            load_episodes(str(bad))
    good.write_text('{"text" : "a", "labels"\t: ["x"]}\n')
    assert load_episodes(str(good)) == [[{"text": "a", "labels": ["x"], "episode_done": True}]]


@pytest.mark.parametrize("value, says", [
    ("[" * 5000 + "]" * 5000, "JSON nested too deeply for Python's reader (about 1,000 levels of [ or {); flatten"),
    ("1" * 5000, "not readable as JSON (Exceeds the limit (4300 digits) for integer string conversion"),
], ids=["deep", "long-number"])
def test_a_jsonl_line_json_can_parse_and_python_cannot_hold_is_one_error_naming_it(tmp_path, value, says):
    if "digits" in says and not hasattr(sys, "get_int_max_str_digits"):
        pytest.skip("this Python has no limit on the digits of an int")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "a", "labels": ["x"]}\n{"text": "a", "labels": ["x"], "v": ' + value + "}\n")
    with pytest.raises(DataFileError, match=re.escape(f"{path}:2: {says}")):
        load_episodes(str(path))
