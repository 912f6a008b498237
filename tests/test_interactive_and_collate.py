"""interactive's --candidates (the task's candidates needed only without it; one naming none refused) and
--collate (what it returns checked in one line; refused for a model that builds its own batches)."""

from __future__ import annotations

import io
import json

import pytest
import torch

from accelbatch.cli import main

ROWS = [{"text": "Mary went to the kitchen. Where is Mary?", "labels": ["kitchen"], "episode_done": True},
        {"text": "John went to the garden. Where is John?", "labels": ["garden"], "episode_done": True}]
TORCH_RUN = ["train", "-t", "torch:torch_task:make_dataset", "-m", "torch:torch_task:Classifier", "-bs", "4",
             "-tstep", "1", "--no-progress", "--eval-splits", "", "-veps", "-1"]


def int_collate(items: list) -> int:
    """A user's collate that returns a number, not tensors."""
    return 5


def dict_collate(items: list) -> dict:
    """A user's collate that returns a dict of tensors (the model takes a tensor or a tuple of them)."""
    xs, ys = zip(*items)
    return {"x": torch.stack(xs), "y": torch.stack(ys)}


def scaled_collate(items: list) -> tuple:
    """A user's collate that feeds the model its inputs scaled: a model trained on them scores otherwise on
    default_collate's."""
    xs, ys = zip(*items)
    return torch.stack(xs) * 10 - 3, torch.stack(ys)


def _errors(err: str) -> list[str]:
    """The error lines of stderr (an untrained model's note may come before them)."""
    return [line for line in err.splitlines() if line.startswith("accelbatch: error: ")]


def _interactive(monkeypatch, lines: list[str], *args: str) -> int:
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{line}\n" for line in lines)))
    return main(["interactive", "--no-progress", *args])


@pytest.mark.parametrize("model", ["memnn", "bag"])
def test_interactive_candidates_given_need_none_in_the_task(model, write_jsonl, monkeypatch, capsys):
    """The task has no label_candidates: --candidates is what the ranker chooses from, one reply a line."""
    task = f"jsonl:{write_jsonl(ROWS)}"
    questions = ["Where is Mary?", "Where is John?", "Where is the milk?"]
    assert _interactive(monkeypatch, questions, "-m", model, "-t", task, "--candidates", "kitchen | garden") == 0
    replies = [line.split("]: ", 1)[1] for line in capsys.readouterr().out.splitlines() if "]: " in line]
    assert len(replies) == len(questions) and set(replies) <= {"kitchen", "garden"}, replies


def test_interactive_without_candidates_on_a_task_without_them_says_to_give_them(write_jsonl, monkeypatch,
                                                                                   capsys):
    task = f"jsonl:{write_jsonl(ROWS)}"
    assert _interactive(monkeypatch, ["Where is Mary?"], "-m", "bag", "-t", task) == 2
    (error,) = _errors(capsys.readouterr().err)
    assert f"none of the {len(ROWS)} examples read of -t {task}" in error and "give --candidates" in error, error


@pytest.mark.parametrize("model, candidates, unread", [
    ("bag", [], False), ("bag", ["--candidates", "kitchen|garden"], True),
    ("transformer/generator", [], True), ("transformer/generator", ["--candidates", "kitchen|garden"], True)])
def test_interactive_says_a_task_it_does_not_read(model, candidates, unread, write_jsonl, monkeypatch, capsys):
    """-t and -dp are read by interactive only for the candidates it offers a ranker without --candidates: a
    generator, or --candidates, leaves them unread (they were taken without a word)."""
    path = write_jsonl([{**row, "label_candidates": ["kitchen", "garden", "hall"]} for row in ROWS])
    given = ["-t", "jsonl:" + path.rsplit("/", 1)[1], "-dp", path.rsplit("/", 1)[0]]
    assert _interactive(monkeypatch, ["Where is Mary?"], "-m", model, "-esz", "8", *given, *candidates) == 0
    captured = capsys.readouterr()
    notes = [line.split(":")[1].strip() for line in captured.err.splitlines() if "not used by this run" in line]
    said = (["-dp/--datapath", "-t/--task"] if unread else []) + \
        (["--candidates"] if candidates and model != "bag" else [])  # a generator writes its replies
    assert notes == said, captured.err
    reply = captured.out.strip().split("]: ", 1)[1]
    assert model != "bag" or reply in ("kitchen", "garden") + (() if candidates else ("hall",)), reply


@pytest.mark.parametrize("given", ["", "|", " | "])
def test_interactive_candidates_naming_none_is_one_line(given, monkeypatch, capsys):
    assert _interactive(monkeypatch, ["Where is Mary?"], "-m", "bag", "-t", "babi:1", "--candidates", given) == 2
    captured = capsys.readouterr()
    assert captured.out == "", captured.out  # no blank reply
    (error,) = _errors(captured.err)
    assert f"--candidates {given!r}: names no candidate" in error, error


def test_interactive_candidates_that_are_not_utf8_are_one_line(monkeypatch, capsys):
    # Python reads a command line's bytes that are not UTF-8 (here latin-1's é) as lone surrogates
    given = b"caf\xe9|no".decode("utf-8", "surrogateescape")
    assert _interactive(monkeypatch, ["Where is Mary?"], "-m", "bag", "-t", "babi:1", "--candidates", given) == 2
    captured = capsys.readouterr()
    (error,) = _errors(captured.err)
    assert "--candidates: 'caf\\udce9' is not valid UTF-8 (the byte 0xe9 at character 3)" in error, error


@pytest.mark.parametrize("collate, returned", [("int_collate", "an int"), ("dict_collate", "a dict")])
def test_a_collate_returning_no_tensors_is_one_line_naming_what_it_returned(collate, returned, capsys):
    path = f"test_interactive_and_collate:{collate}"
    assert main([*TORCH_RUN, "--collate", path]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert f"--collate {path} returned {returned}; it must return a tensor or a tuple of tensors" in err, err


def test_collate_for_a_model_that_builds_its_own_batches_is_refused(capsys):
    assert main(["train", "-t", "babi:1", "-m", "memnn", "--collate", "zzz.nothing:fn", "-tstep", "1",
                 "--no-progress", "-veps", "-1", "--eval-splits", ""]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--collate zzz.nothing:fn: only -m torch:pkg.mod:Model" in err \
        and "leave --collate out" in err, err


def test_the_collate_a_model_was_trained_with_is_kept_for_eval_mf(tmp_path, capsys):
    """PATH.opt keeps --collate: eval -mf PATH batches the items as the training did (it used default_collate,
    scoring the model on inputs it was not trained on), and says it took it."""
    model, trained, evaluated = tmp_path / "m.pt", tmp_path / "train.json", tmp_path / "eval.json"
    collate = f"{__name__}:scaled_collate"
    assert main([*TORCH_RUN[:-4], "-tstep", "6", "--collate", collate, "-mf", str(model), "--eval-splits", "valid",
                 "--report-json", str(trained)]) == 0
    assert json.loads((tmp_path / "m.pt.opt").read_text())["collate"] == collate
    capsys.readouterr()
    assert main(["eval", "-mf", str(model), "-dt", "valid", "--no-progress", "--report-json", str(evaluated)]) == 0
    assert f"--collate {collate}" in capsys.readouterr().err
    want, got = json.loads(trained.read_text())["valid"], json.loads(evaluated.read_text())["valid"]
    assert (got["exs"], got["accuracy"]) == (want["exs"], want["accuracy"])
    assert got["loss"] == pytest.approx(want["loss"], rel=1e-6)  # summed in batches of another size


@pytest.mark.parametrize("model", ["transformer/generator", "bag"])
def test_interactive_mf_needs_the_task_s_data_only_for_a_ranker_without_candidates(model, tmp_path, monkeypatch,
                                                                                     capsys):
    """The training data moved: a generator (which writes its replies) and a ranker given --candidates still
    answer; a ranker without them is told, in one line, that the task's data is gone and to give them. A
    generator given --candidates is told they are not used (it took them silently)."""
    data = tmp_path / "data"
    data.mkdir()
    rows = "".join(json.dumps({**row, "label_candidates": ["kitchen", "garden"]}) + "\n" for row in ROWS)
    for split in ("train", "valid", "test"):
        (data / f"{split}.jsonl").write_text(rows)
    model_file = tmp_path / "m.pt"
    assert main(["train", "-t", f"jsonl:{data}", "-m", model, "-esz", "8", "-tstep", "1", "-bs", "2",
                 "-mf", str(model_file), "--no-progress", "--eval-splits", ""]) == 0
    data.rename(tmp_path / "moved")
    capsys.readouterr()
    assert _interactive(monkeypatch, ["Where is Mary?"], "-mf", str(model_file), "--candidates", "kitchen|garden") == 0
    captured = capsys.readouterr()
    assert len([line for line in captured.out.splitlines() if "]: " in line]) == 1
    unused = "--candidates: not used by this run: -m transformer/generator generates its replies"
    assert (unused in captured.err) == (model != "bag"), captured.err
    rc = _interactive(monkeypatch, ["Where is Mary?"], "-mf", str(model_file))
    errors = _errors(capsys.readouterr().err)
    if model == "bag":
        assert rc == 2 and len(errors) == 1 and f"reads {data}, which does not exist" in errors[0], errors
        assert "give --candidates" in errors[0]
    else:
        assert rc == 0 and not errors, errors
