"""``-m random_candidate`` answers from the candidates only: without candidates it says "I don't know." (ParlAI's
RandomCandidateAgent), never the label, so its accuracy is chance level on any task."""

from __future__ import annotations

import accelbatch as ab
from accelbatch.messages import Message
from accelbatch.models.utility import RandomCandidateAgent


def test_without_candidates_it_does_not_know():
    agent = RandomCandidateAgent(ab.Opts())
    for msg in (Message(text="abc", labels=["cba"]), Message(text="abc", eval_labels=["cba"]), Message(text="hi")):
        agent.observe(msg)
        assert agent.act()["text"] == "I don't know."
    agent.observe(Message(text="abc", eval_labels=["y"], label_candidates=["x", "y", "z"]))
    assert agent.act()["text"] in {"x", "y", "z"}
    agent.observe(Message())  # a padding row (past the end of the data): no reply
    assert "text" not in agent.act()


def test_a_task_without_candidates_scores_zero():
    # every reverse label is a reversed word: "I don't know." is never one (it scored 1.0, replying the label)
    opts = ab.Opts(task="reverse:200", model="random_candidate", datatype="valid", progress=False)
    world = ab.create_world(opts)
    report = ab.evaluate(world)
    world.shutdown()
    assert report["exs"] == 10 and report["accuracy"] == 0.0
