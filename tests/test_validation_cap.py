"""-vme counts scored examples (turns with labels), as ParlAI's report exs, not context turns; a plain agent
with its own save()/load() keeps its best validation beside -mf, as a TorchAgent does."""

from __future__ import annotations

import json

import pytest

import accelbatch as ab
from accelbatch.messages import Message
from accelbatch.run import evaluate

CONTEXT = [("c1", None), ("c2", None), ("c3", None), ("q1", "yes"), ("c4", None), ("c5", None), ("c6", None),
           ("q2", "yes"), ("q3", "yes"), ("q4", "yes")]  # episodes of 4, 4, 1 and 1 turns; 4 with labels


def _context_file(tmp_path):
    path, ends = tmp_path / "ctx.jsonl", {"q1", "q2", "q3", "q4"}
    path.write_text("".join(json.dumps({"text": text, **({"labels": [label]} if label else {}),
                                        "episode_done": text in ends}) + "\n" for text, label in CONTEXT))
    return path


@pytest.mark.parametrize("cap", [1, 2, 3, 4])
def test_a_capped_evaluation_counts_examples_with_labels(tmp_path, cap):
    """-bs 1 in data order: the cap ends the evaluation at the turn that brings the labelled count to it (the
    context turns before a question are served, not counted)."""
    opts = ab.Opts(task=f"jsonl:{_context_file(tmp_path)}", model="repeat_label", datatype="valid", batchsize=1)
    world = ab.create_world(opts)
    try:
        report = evaluate(world, max_exs=cap)
    finally:
        world.shutdown()
    assert report["exs"] == cap and report["accuracy"] == 1.0
    served = [text for text, _ in CONTEXT].index(f"q{cap}") + 1  # every turn up to the cap-th question
    assert world.get_total_exs() == served


class Graded(ab.Agent):
    """A plain agent (no TorchAgent) with its own save/load: it answers the first RIGHT of the valid examples
    v0..v9 correctly, so a validation scores RIGHT / 10; its file records RIGHT."""

    RIGHT = 0

    def act(self):
        obs = self.observation or {}
        number = int(obs.get("text", "v0")[1:])
        return Message(id="graded", text="right" if number < type(self).RIGHT else "wrong")

    def save(self, path):
        with open(path, "w") as f:
            json.dump({"right": type(self).RIGHT}, f)

    def load(self, path):
        with open(path) as f:
            json.load(f)


@pytest.mark.timeout(60)
def test_a_plain_agent_with_save_keeps_its_best_validated_model(tmp_path, monkeypatch):
    data = tmp_path / "v.jsonl"
    data.write_text("".join(json.dumps({"text": f"v{i}", "labels": ["right"], "episode_done": True}) + "\n"
                            for i in range(10)))
    model_file = tmp_path / "m.json"
    opts = ab.Opts(task=f"jsonl:{data}", batchsize=2, num_epochs=1, validation_every_n_epochs=1,
                   model_file=str(model_file), eval_splits="valid", progress=False)
    monkeypatch.setattr(Graded, "RIGHT", 9)
    assert ab.run(ab.create_world(opts, agent=Graded), opts)["valid"]["accuracy"] == 0.9  # the final valid
    assert json.loads(model_file.read_text()) == {"right": 9} and (tmp_path / "m.json.trainstats").is_file()
    monkeypatch.setattr(Graded, "RIGHT", 1)  # a worse model: validates 0.1
    ab.run(ab.create_world(opts, agent=Graded), opts)
    assert json.loads(model_file.read_text()) == {"right": 9}  # kept: only a better validation replaces it
