"""Replicas of a training run decide together whether a call trains: a replica whose rows are all context
turns (no labels) trains along with the others (its loss 0) instead of evaluating, which left the others
waiting in the gradient all-reduce (gloo aborted the run). The weights are those of one process running
the same plan's micro-batches (-ga 2 for -rf 2, every micro-batch's outputs returned)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from accelbatch.cli import main

# episodes of 4, 4, 1 and 1 turns; the context turns have no labels
TURNS = [("c1", None), ("c2", None), ("c3", None), ("q1", "yes"), ("c4", None), ("c5", None), ("c6", None),
         ("q2", "no"), ("q3", "yes"), ("q4", "no")]


EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")


@pytest.mark.slow
@pytest.mark.multiprocess
@pytest.mark.timeout(180)
@pytest.mark.parametrize("model", ["memnn", "custom_agent:MyAgent"])
def test_replicas_train_on_context_turns_as_one_process_runs_the_plan(tmp_path, monkeypatch, model):
    """memnn gives no loss for rows without labels (0 is taken); examples/custom_agent.py's loss is 0 for a
    micro-batch of context turns alone, which -ga 2 cuts too (cross_entropy's mean over no row is NaN)."""
    monkeypatch.syspath_prepend(EXAMPLES)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [EXAMPLES, os.environ.get("PYTHONPATH")])))
    data = tmp_path / "ctx.jsonl"
    data.write_text("".join(json.dumps({"text": text, **({"labels": [label], "label_candidates": ["yes", "no"]}
                                                         if label else {}),
                                        "episode_done": not text.startswith("c")}) + "\n" for text, label in TURNS))
    base = ["train", "-t", f"jsonl:{data}", "-m", model, "-esz", "8", "-bs", "1", "-tstep", "6", "-veps", "0.5",
            "-vme", "2", "--eval-splits", "valid", "--no-progress"]
    reports = {}
    # -ga 2 returns every micro-batch's replies (--output-mode all), as the replicas do: the next turns' history
    # holds the model's reply to a context turn (with final, such data is refused)
    for name, plan in (("replicas", ["-rf", "2", "--device", "cpu"]), ("one", ["-ga", "2", "--output-mode", "all"])):
        assert main([*base, *plan, "-mf", str(tmp_path / name / "m.pt"),
                     "--report-json", str(tmp_path / f"{name}.json")]) == 0, name
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
    weights = [torch.load(tmp_path / name / "m.pt", weights_only=True)["model"] for name in ("replicas", "one")]
    assert all(torch.allclose(weights[0][k], weights[1][k], atol=1e-6) for k in weights[1])
    assert reports["replicas"]["valid"]["exs"] == 4
    assert reports["replicas"]["valid"]["loss"] == pytest.approx(reports["one"]["valid"]["loss"], abs=1e-5)
