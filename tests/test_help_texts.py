"""Each verb's --help read literally: an option it lists is taken and read, the defaults it shows are the values
a run uses, and what it says about -vmm, -tr, -dt and -dp is what the code does."""

from __future__ import annotations

import argparse
import io
import re
from dataclasses import fields
from types import CodeType

import pytest

from accelbatch.best_valid import metric_mode
from accelbatch.cli import build_cli, main
from accelbatch.models.generator import text_tokens
from accelbatch.opts import Opts

VERBS = ("train", "eval", "display-data", "display-model", "interactive")
OPTIONS = {f.name for f in fields(Opts)}
QUIET = ["--no-progress", "-ltim", "-1"]


def _parser(verb: str) -> argparse.ArgumentParser:
    return build_cli().parse_known_args(["tasks"])[0].verb_parsers[verb]


def _helps(verb: str) -> dict[str, str]:
    """Field name -> the help text `accelbatch VERB --help` prints for it (the options it lists)."""
    parser = _parser(verb)
    formatter = parser._get_formatter()
    return {a.dest: " ".join(formatter._expand_help(a).split()) for a in parser._actions
            if a.dest in OPTIONS and a.help != argparse.SUPPRESS}


def _help(capsys: pytest.CaptureFixture, verb: str) -> str:
    with pytest.raises(SystemExit):
        main([verb, "--help"])
    return " ".join(capsys.readouterr().out.split())


def test_interactive_neither_lists_nor_takes_skip_generation(capsys):
    assert "--skip-generation" not in _help(capsys, "interactive")
    assert "skip_generation" not in _helps("interactive")
    assert main(["interactive", "-t", "babi:1", "--skip-generation"]) == 2
    assert capsys.readouterr().err == ("accelbatch: error: --skip-generation: interactive answers with generated "
                                       "replies; leave it out\n")


def test_display_model_neither_lists_nor_takes_skip_generation(capsys):
    """display-model shows the model's replies: with --skip-generation a generator's were empty, unsaid."""
    assert "--skip-generation" not in _help(capsys, "display-model")
    assert main(["display-model", "-m", "transformer/generator", "-t", "reverse:20", "--skip-generation"]) == 2
    assert capsys.readouterr().err == ("accelbatch: error: --skip-generation: display-model shows the generated "
                                       "replies; leave it out (eval --skip-generation scores the loss alone)\n")


def test_display_data_neither_lists_nor_ignores_display_examples(capsys):
    assert "display-examples" not in _help(capsys, "display-data")
    assert main(["display-data", "-t", "babi:1", "-n", "1", "--no-display-examples"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == ["accelbatch: error: --display-examples: display-data does not take it: it shows every example"]
    assert main(["display-data", "-t", "babi:1", "-n", "1"]) == 0
    shown = capsys.readouterr().out
    assert main(["display-data", "-t", "babi:1", "-n", "1", "--display-examples"]) == 0  # what it does anyway
    assert capsys.readouterr().out == shown


def test_a_switch_given_as_the_verb_runs_anyway_is_taken(monkeypatch, capsys):
    monkeypatch.setattr("sys.stdin", io.StringIO("hello\n"))
    assert main(["interactive", "-m", "repeat_label", "--no-skip-generation", "--no-progress"]) == 0


def _code_strings(code: CodeType) -> set[str]:
    """Every string constant of ``code``, in tuples and sets too."""
    found: set[str] = set()
    for const in code.co_consts:
        items = const if isinstance(const, (tuple, frozenset)) else (const,)
        found |= {c for c in items if isinstance(c, str)}
    return found


def test_vmm_help_names_the_metrics_metric_mode_minimises():
    listed = re.search(r"\(default: min for (.+?); max otherwise\)", _helps("train")["validation_metric_mode"])
    assert listed, _helps("train")["validation_metric_mode"]
    named = set(re.split(r", | or ", listed.group(1)))
    # every name metric_mode's code holds, and the usual metrics: those it minimises when -vmm is not given
    candidates = _code_strings(metric_mode.__code__) | named | {"accuracy", "f1", "bleu-4", "token_acc", "hits@1"}
    minimised = {m for m in candidates if metric_mode(Opts(validation_metric=m)) == "min"}
    assert named == minimised


def _shown(value: object, typ: type) -> object:
    """A '(default: X)' value back as the parser holds it."""
    return {"on": True, "off": False}[value] if typ is bool else typ(value)


@pytest.mark.parametrize("verb", VERBS)
def test_each_listed_default_is_the_value_a_run_gets(verb):
    parser = _parser(verb)
    helps, parsed = _helps(verb), vars(parser.parse_args([]))
    own = {a.dest: a.help for a in parser._actions if a.dest in helps}  # as written, before --help adds to it
    types = {f.name: bool if f.type in ("bool", "bool | None") else type(f.default) for f in fields(Opts)}
    for name, text in helps.items():
        if parsed[name] is None or re.search(r"\(default[: ]|by default|\(the default\)", own[name]):
            continue  # no default to show, or the text says it in its own words
        shown = re.findall(r"\(default: ([^)]*)\)$", text)
        assert shown, f"{verb} {name}: {text}"
        assert _shown(shown[0], types[name]) == parsed[name], f"{verb} {name}: {text}"


@pytest.mark.parametrize("verb, name, shown", [
    ("train", "batchsize", "32"), ("train", "num_epochs", "5"), ("train", "learning_rate", "0.01"),
    ("train", "optimizer", "adam"), ("train", "validation_every_n_epochs", "1"), ("train", "log_every_n_secs", "2"),
    ("train", "validation_metric", "accuracy"), ("train", "eval_splits", "valid,test"),
    ("train", "embedding_size", "64"), ("train", "buffer_size", "3"), ("train", "data_timeout_s", "60"),
    ("train", "replica_timeout_s", "300"), ("train", "drop_last", "on"), ("train", "include_labels", "on"),
    ("train", "skip_generation", "off"), ("train", "datatype", "train"), ("eval", "datatype", "valid"),
    ("display-data", "datatype", "train:ordered"), ("display-model", "datatype", "valid"),
])
def test_the_defaults_the_tester_missed_are_shown(verb, name, shown):
    assert _helps(verb)[name].endswith(f"(default: {shown})"), _helps(verb)[name]


def test_text_truncate_help_says_its_default_and_what_a_generator_keeps_with_minus_one():
    text = _helps("train")["text_truncate"]
    assert text.endswith(f"(default: {Opts().text_truncate})")
    minus_one = re.search(r"-1: ([^)]*)\)", text).group(1)
    assert "all" in minus_one and str(text_tokens(Opts(text_truncate=-1))) in minus_one
    assert text_tokens(Opts()) == Opts().text_truncate  # the default is what a generator keeps too


def test_datatype_help_explains_each_mode():
    text = _helps("train")["datatype"]
    assert "':stream'" in text and "':ordered' in data order" in text and "':evalmode'" in text


def test_train_refusal_lists_every_datatype_train_takes(capsys):
    assert main(["train", "-t", "babi:1", "-dt", "valid", *QUIET]) == 2
    listed = re.search(r"a training datatype \(([^)]*)\)", capsys.readouterr().err).group(1).split(", ")
    assert sorted(listed) == ["train", "train:ordered", "train:stream", "train:stream:ordered"]
    for datatype in listed:  # each is taken: one step trains
        assert main(["train", "-t", "babi:1", "-m", "repeat_label", "-dt", datatype, "-tstep", "1",
                     "--eval-splits", "", *QUIET]) == 0, datatype
    capsys.readouterr()


def test_a_missing_file_under_datapath_says_dp_was_joined(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w").mkdir()
    assert main(["display-data", "-t", "jsonl:w/data", "-dp", "w"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("accelbatch: error: w/w/data: no such file"), err
    assert "-dp/--datapath w joined with -t's relative path w/data" in err[0]
    assert main(["display-data", "-t", "jsonl:w/data"]) == 2  # no -dp: the path as -t gave it
    err = capsys.readouterr().err
    assert "w/data: no such file" in err and "-dp" not in err


def test_a_comma_in_a_file_name_under_datapath_keeps_its_own_message(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "w" / "d").mkdir(parents=True)
    (tmp_path / "w" / "d" / "a,b.jsonl").write_text('{"text": "q", "labels": ["a"]}\n', encoding="utf-8")
    assert main(["display-data", "-t", "jsonl:d/a,b.jsonl", "-dp", "w"]) == 2
    assert "rename it without the comma" in capsys.readouterr().err


@pytest.mark.parametrize("verb, rest", [("train", []), ("eval", []), ("display-data", []), ("display-model", []),
                                        ("interactive", []), ("report", ["runs"]), ("tasks", [])])
def test_every_verb_takes_progress_as_scripts_pass_it_to_all(verb, rest):
    from accelbatch.cli import build_cli

    for flag in ("--progress", "--no-progress"):
        args = build_cli().parse_args([verb, *rest, flag])
        assert args.progress is (flag == "--progress")
