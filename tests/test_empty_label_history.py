"""An empty label ``labels: [""]`` is an utterance of the history in both paths, as in ParlAI: the per-row clones'
History (the default BatchWorld) and the loader's squashed history (--num-workers) give the same texts, so the
same seed trains the same weights with and without --num-workers."""

from __future__ import annotations

import json

import pytest
import torch

from accelbatch.agents import TorchAgent
from accelbatch.cli import main
from accelbatch.data.squash import histories
from accelbatch.messages import Message
from accelbatch.opts import Opts

EPISODE = [Message(text="q d1", labels=[""], episode_done=False),
           Message(text="q d2", labels=["a2"], episode_done=False),
           Message(text="q d3", labels=["a3"], episode_done=True)]


class _TextAgent(TorchAgent):
    """A TorchAgent with the base observe: its observations' ``full_text`` is the clone's History."""

    def build_model(self) -> torch.nn.Module:
        return torch.nn.Linear(1, 1)


def _hand_built(context_length: int) -> list[str]:
    """Each turn's history written out: the utterances q d1, "", q d2, a2, q d3 (the empty label is one)."""
    said = [["q d1"], ["q d1", "", "q d2"], ["q d1", "", "q d2", "a2", "q d3"]]
    return ["\n".join(turns if context_length == -1 else turns[-context_length:]) for turns in said]


@pytest.mark.parametrize("context_length", [-1, 1, 2, 3])
def test_an_empty_label_is_an_utterance_of_both_histories(context_length):
    agent = _TextAgent(Opts(model="x", context_length=context_length, include_labels=True))
    clone_texts = [agent.observe(Message(turn))["full_text"] for turn in EPISODE]
    assert clone_texts == _hand_built(context_length)  # -1: 'q d1\n\nq d2' for the second turn (was 'q d1\nq d2')
    assert histories(EPISODE, context_length) == _hand_built(context_length)


def _write_task(folder) -> str:
    """40 two-turn episodes whose first turn is labelled "" (a candidate), the second with a colour."""
    colours = ["red", "blue", "green", "yellow"]
    candidates = [*colours, ""]
    rows = []
    for i in range(40):
        colour = colours[i % 4]
        rows += [{"text": f"q d{i} colour {colour}", "labels": [""], "label_candidates": candidates,
                  "episode_done": False},
                 {"text": f"what colour d{i}", "labels": [colour], "label_candidates": candidates,
                  "episode_done": True}]
    folder.mkdir()
    for split in ("train", "valid"):
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return f"jsonl:{folder}"


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_num_workers_trains_the_same_weights_on_empty_labels(tmp_path):
    task = _write_task(tmp_path / "data")
    weights, reports = [], []
    for name, extra in (("rows", []), ("workers", ["--num-workers", "1"])):
        model, report = tmp_path / f"{name}.pt", tmp_path / f"{name}.json"
        assert main(["train", "-t", task, "-m", "memnn", "-ne", "1", "-bs", "4", "--seed", "1", "--eval-splits",
                     "valid", "--no-progress", "-mf", str(model), "--report-json", str(report), *extra]) == 0
        weights.append(torch.load(model, map_location="cpu", weights_only=True)["model"])
        reports.append(json.loads(report.read_text())["valid"])
    rows, workers = weights
    assert rows.keys() == workers.keys()
    assert all(torch.equal(rows[key], workers[key]) for key in rows), "--num-workers 1 trained other weights"
    assert reports[0] == {**reports[1], "time_s": reports[0]["time_s"]}


def test_an_empty_reply_to_a_context_turn_is_no_utterance():
    """A context turn (no labels, no candidates) answered "" by a ranker (scored as a miss where it counts) says
    nothing: the next turn's history keeps the context turn within -histsz 2, as the loader's squashing does."""
    agent = _TextAgent(Opts(model="x", context_length=2, include_labels=True))
    turns = [Message(text="remember red", episode_done=False),
             Message(text="what colour", labels=["red"], episode_done=True)]
    agent.observe(Message(turns[0]))
    agent.self_observe(Message(text=""))
    assert agent.observe(Message(turns[1]))["full_text"] == "remember red\nwhat colour" == histories(turns, 2)[1]
