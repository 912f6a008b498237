"""Static shapes (--dynamic-batching buckets) for an agent without ``example_length``: the default length holds
what the agent's tokenizer makes, and an agent whose own length undercounts is told so in one line."""

from __future__ import annotations

import json
import runpy
import sys

import pytest

from accelbatch import cli
from accelbatch.data.batching import MessageLength
from accelbatch.dictionary import tokenize

# (text, its length counted by hand: the larger of its whitespace words and tokenize's words, which split at
# .,?!;:"'() and drop them)
TEXTS = [("I don't know,really", 5), ("it's 5 o'clock (isn't it?)", 8), ("a , b ; c", 5),
         ("plain words only", 3), ("", 0), ("...", 1), ("x'y'z", 3)]


@pytest.mark.parametrize("text, by_hand", TEXTS)
def test_the_default_length_holds_whitespace_words_and_tokenize_tokens(text, by_hand):
    length = MessageLength()({"text": text})
    assert length >= len(text.split()) and length >= len(tokenize(text))
    assert length == by_hand  # and no more: padding is not wasted


def test_the_default_length_is_clipped_at_the_truncation():
    assert MessageLength(truncate=3)({"text": "I don't know,really at all"}) == 3


def _write_contractions(path, rows: int = 12) -> str:
    with open(path, "w") as f:
        for i in range(rows):
            text = " ".join(["I don't know,really"] * (1 + i % 4))  # 4 lengths, more tokens than words
            f.write(json.dumps({"text": text, "labels": ["yes"], "label_candidates": ["yes", "no"],
                                "episode_done": True}) + "\n")
    return f"jsonl:{path}"


@pytest.mark.timeout(120)
def test_the_custom_agent_example_trains_on_contractions_with_bucket_shapes(tmp_path):
    """examples/custom_agent.py tokenizes with ``tokenize`` and gives no example_length."""
    task = _write_contractions(tmp_path / "train.jsonl")
    module = runpy.run_path("examples/custom_agent.py", run_name="example")
    report = module["main"](["-t", task, "-bs", "2", "-tstep", "4", "-dynb", "buckets", "--num-buckets", "2",
                             "--no-progress", "--eval-splits", "", "-veps", "-1"])
    assert report["train"]["steps"] == 4 and report["train"]["exs"] > 0


@pytest.mark.timeout(120)
def test_an_example_length_that_undercounts_is_one_line_naming_it(tmp_path, capsys):
    task = _write_contractions(tmp_path / "train.jsonl")
    (tmp_path / "short_agent.py").write_text(
        "import runpy\n"
        "MyAgent = runpy.run_path('examples/custom_agent.py', run_name='example')['MyAgent']\n"
        "class ShortAgent(MyAgent):\n"
        "    def __init__(self, opts, shared=None):\n"
        "        super().__init__(opts, shared)\n"
        "        self.example_length = lambda msg: 1\n")
    sys.path.insert(0, str(tmp_path))
    try:
        code = cli.main(["train", "-t", task, "-m", "short_agent:ShortAgent", "-bs", "2", "-tstep", "2",
                         "-dynb", "buckets", "--no-progress", "--eval-splits", "", "-veps", "-1"])
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("short_agent", None)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "example_length" in err[0] and "--dynamic-batching buckets" in err[0]
