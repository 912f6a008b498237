"""What the ranking models (bag, conv, memnn) and the custom agent example make of their inputs, counted by hand
on tiny files: a row without candidates is a miss, --label-truncate cuts candidates (keeping their start),
memnn's -tr cuts each line (keeping its end), and an example's target is the first of its labels among its
candidates."""

from __future__ import annotations

import json
import math
import runpy
from pathlib import Path

import pytest

from accelbatch.cli import main

RANKERS = ["bag", "conv", "memnn"]
EIGHT = "one two three four five six seven eight"


def _report(tmp_path: Path, verb: str, data: str, model: str, *args: str) -> dict:
    """The report of ``accelbatch VERB`` on the jsonl file ``data`` (tiny model, fixed seed)."""
    out = tmp_path / f"report{len(list(tmp_path.glob('report*')))}.json"
    extra = ["-tstep", "3", "-veps", "-1", "--eval-splits", "valid"] if verb == "train" else []
    assert main([verb, "-t", f"jsonl:{data}", "-m", model, "-esz", "8", "--seed", "3", "--no-progress",
                 "--report-json", str(out), *extra, *args]) == 0
    return json.loads(out.read_text())["valid"]


def _rows(*rows: dict) -> list[dict]:
    return [dict(r, episode_done=True) for r in rows]


# one hit (its only candidate is the label), then a row with an empty list of candidates and one without the key
NO_CANDIDATES = _rows({"text": "a b", "eval_labels": ["x"], "label_candidates": ["x"]},
                      {"text": "c d", "eval_labels": ["x"], "label_candidates": []},
                      {"text": "e f", "eval_labels": ["x"]})


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", RANKERS)
def test_a_row_without_candidates_is_scored_as_a_miss(tmp_path, write_jsonl, model):
    """1 hit of 3 scored rows: accuracy and f1 1/3 (bag and conv left the two rows out: accuracy 1.0 of 1);
    the loss is the hit's alone, 0 over a single candidate."""
    report = _report(tmp_path, "eval", write_jsonl(NO_CANDIDATES), model)
    assert report["exs"] == 3 and "scored_exs" not in report
    assert report["accuracy"] == pytest.approx(1 / 3) and report["f1"] == pytest.approx(1 / 3)
    assert report["loss"] == pytest.approx(0.0, abs=1e-6)


def _twins(first: str, second: str) -> list[dict]:
    """Rows whose two candidates are ``first`` and ``second``, the label the first."""
    return _rows(*({"text": f"pick {n}", "eval_labels": [first], "label_candidates": [first, second]}
                   for n in range(3)))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("model", ["bag", "conv"])
def test_label_truncate_is_the_candidates_word_limit(tmp_path, write_jsonl, model):
    """Candidates equal in the words kept score alike: loss ln 2 (two equal scores). By default (-1) bag and conv
    keep 8 words; --label-truncate 9 tells apart candidates that differ at word 9 (it was ignored: ln 2), not
    those that differ at word 10 (the start is kept)."""
    at_nine = write_jsonl(_twins(f"{EIGHT} nine", f"{EIGHT} ten"), "nine.jsonl")
    at_ten = write_jsonl(_twins(f"{EIGHT} nine x", f"{EIGHT} nine y"), "ten.jsonl")
    assert _report(tmp_path, "eval", at_nine, model)["loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert _report(tmp_path, "eval", at_ten, model, "--label-truncate", "9")["loss"] == \
        pytest.approx(math.log(2), rel=1e-6)
    assert abs(_report(tmp_path, "eval", at_nine, model, "--label-truncate", "9")["loss"] - math.log(2)) > 1e-4


def _questions(*texts: str) -> list[dict]:
    return _rows(*({"text": t, "eval_labels": [label], "label_candidates": ["x", "y"]}
                   for t, label in zip(texts, ["x", "y", "x"])))


@pytest.mark.timeout(60)
def test_memnn_keeps_the_last_tr_words_of_each_line(tmp_path, write_jsonl):
    """With -tr 1 each memory and question keeps its last word: the same report as the file cut by hand (memnn
    kept each line's first 16 words whatever -tr said). By default (-tr 256) a 17th word counts."""
    sixteen = " ".join(["w"] * 16)
    long = write_jsonl(_questions("p q r s kitchen\nwhere is it", "x y z apple", f"{sixteen} pear"), "long.jsonl")
    cut = write_jsonl(_questions("kitchen\nit", "apple", "pear"), "cut.jsonl")
    want = _report(tmp_path, "eval", cut, "memnn")
    got = _report(tmp_path, "eval", long, "memnn", "-tr", "1")
    assert (got["loss"], got["accuracy"]) == (want["loss"], want["accuracy"])
    without = write_jsonl(_questions("p q r s kitchen\nwhere is it", "x y z apple", sixteen), "without.jsonl")
    assert _report(tmp_path, "eval", long, "memnn")["loss"] != _report(tmp_path, "eval", without, "memnn")["loss"]


FRUIT = ["apple", "kiwi", "pear"]


def _labelled(labels: list[str]) -> list[dict]:
    return _rows(*({"text": f"fruit {n}", "labels": labels, "label_candidates": FRUIT} for n in range(4)))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", RANKERS)
def test_the_target_is_the_first_label_among_the_candidates(tmp_path, write_jsonl, model, capsys):
    """Labels ["zzz", "kiwi"] and ["kiwi", "apple"] train and evaluate as ["kiwi"] alone does (bag and conv
    refused the first: 'zzz' is no candidate; memnn took 'apple', the first candidate that is a label)."""
    want = _report(tmp_path, "train", write_jsonl(_labelled(["kiwi"]), "kiwi.jsonl"), model)
    for n, labels in enumerate((["zzz", "kiwi"], ["kiwi", "apple"])):
        got = _report(tmp_path, "train", write_jsonl(_labelled(labels), f"{n}.jsonl"), model)
        assert (got["loss"], got["accuracy"]) == (want["loss"], want["accuracy"]), labels
    capsys.readouterr()
    none = write_jsonl(_labelled(["zzz", "yyy"]), "none.jsonl")
    assert main(["train", "-t", f"jsonl:{none}", "-m", model, "-esz", "8", "--no-progress", "-tstep", "1"]) == 2
    assert "a training example's labels ['zzz', 'yyy']: none is among its 3 label_candidates" in \
        capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("batchsize", ["1", "3"])
def test_the_custom_agent_example_scores_a_row_without_candidates_as_a_miss(write_jsonl, batchsize):
    """It indexed the row's empty candidates (IndexError); now it replies "" to it: 1 hit of 3."""
    module = runpy.run_path("examples/custom_agent.py", run_name="example")
    report = module["main"](["-t", f"jsonl:{write_jsonl(NO_CANDIDATES)}", "-dt", "valid", "-bs", batchsize,
                             "--no-progress"])
    assert report["valid"]["exs"] == 3 and report["valid"]["accuracy"] == pytest.approx(1 / 3)
