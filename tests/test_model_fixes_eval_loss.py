"""The ranking models' evaluation loss is the mean over the rows whose label is among their candidates, exactly:
the same for every batch size, micro-batching and dynamic batching, equal to a one-example-at-a-time reference,
and never NaN when a whole batch has no scored row. Training keeps the plain mean cross entropy."""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

import accelbatch as ab
from accelbatch.agents import ROW_COUNTED, ROW_LOSS
from accelbatch.messages import Message
from accelbatch.models.bag import BagAgent, candidate_loss
from accelbatch.models.memnn import MemNNAgent
from accelbatch.tasks.files import DataFileError

CANDS = ["x", "y", "z"]
# rows 2, 3 and 5 have labels outside their candidates (a miss, left out of the loss); with -bs 2 the second
# batch holds no scored row at all, which gave a NaN loss (the masked scores' sum overflowed to -inf, x 0.0)
ROWS = [
    {"text": "apple pie", "labels": ["x"], "label_candidates": CANDS},
    {"text": "cherry", "labels": ["q"], "label_candidates": ["x"]},
    {"text": "dog days", "labels": ["w"], "label_candidates": CANDS},
    {"text": "egg", "labels": ["y"], "label_candidates": ["x", "y"]},
    {"text": "fig tree leaf", "labels": ["q"], "label_candidates": ["y", "z"]},
    {"text": "grape", "labels": ["z"], "label_candidates": CANDS},
    {"text": "", "labels": ["y"], "label_candidates": CANDS},
]


def _rows():
    return [dict(r, episode_done=True) for r in ROWS]


def reference_loss(agent, rows) -> float:
    """One example at a time: -log softmax over the row's own candidates at its label, averaged over the rows
    whose label is a candidate (written out with logsumexp, no cross_entropy or masking)."""
    nlls = []
    for row in rows:
        if row["labels"][0] not in row["label_candidates"]:
            continue
        obs = agent.vectorize(Message(text=row["text"], eval_labels=row["labels"],
                                      label_candidates=row["label_candidates"]))
        with torch.no_grad():
            scores = agent.model(agent.batchify([obs]))["scores"][0].double()
        real = scores[: len(row["label_candidates"])]
        index = row["label_candidates"].index(row["labels"][0])
        nlls.append(float(torch.logsumexp(real, 0) - real[index]))
    return sum(nlls) / len(nlls)


def evaluate(path: str, model: str, **changes) -> tuple[dict, object]:
    opts = ab.Opts(task=f"jsonl:{path}", model=model, datatype="valid", embedding_size=8, progress=False, seed=3,
                   **changes)
    world = ab.create_world(opts)
    try:
        return ab.evaluate(world), world.get_model_agent()
    finally:
        world.shutdown()


@pytest.mark.parametrize("model", ["bag", "conv", "memnn"])
def test_eval_loss_is_the_mean_over_scored_rows_whatever_the_batching(write_jsonl, model):
    path = write_jsonl(_rows())
    first, agent = evaluate(path, model, batchsize=1)
    want = reference_loss(agent, _rows())
    assert first["exs"] == len(ROWS)
    assert first["loss"] == pytest.approx(want, rel=1e-5)
    for changes in ({"batchsize": 2}, {"batchsize": 3}, {"batchsize": 7}, {"batchsize": 2, "device_iterations": 2},
                    {"batchsize": 3, "dynamic_batching": "buckets"}, {"batchsize": 2, "dynamic_batching": "full"}):
        report, _ = evaluate(path, model, **changes)
        assert report["exs"] == len(ROWS), changes
        assert math.isfinite(report["loss"]), changes
        assert report["loss"] == pytest.approx(want, rel=1e-5), changes
        assert report["accuracy"] == first["accuracy"], changes


def test_the_testers_files_give_one_loss_for_every_batch_size(write_jsonl):
    """/tmp/explore_data/miss.jsonl and nan.jsonl: bag gave 0.5684 / 0.5688 / 0.8526 at -bs 1/2/3, and NaN."""
    miss = write_jsonl([{"text": "apple", "labels": ["x"], "label_candidates": ["x", "y"]},
                        {"text": "cherry", "labels": ["z"], "label_candidates": ["x", "y"]},
                        {"text": "dog", "labels": ["y"], "label_candidates": ["x", "y"]}], "miss.jsonl")
    nan = write_jsonl([{"text": "apple", "labels": ["q"], "label_candidates": ["x"]},
                       {"text": "cherry", "labels": ["q"], "label_candidates": ["x", "y", "z"]},
                       {"text": "dog", "labels": ["y"], "label_candidates": ["x", "y"]}], "nan.jsonl")
    for path in (miss, nan):
        losses = [evaluate(path, "bag", batchsize=bs)[0]["loss"] for bs in (1, 2, 3)]
        assert all(math.isfinite(v) for v in losses)
        assert losses == pytest.approx([losses[0]] * 3, rel=1e-6)


@pytest.mark.parametrize("cls", [BagAgent, MemNNAgent])
def test_training_batches_keep_the_mean_cross_entropy_and_unscored_batches_give_zero(cls):
    agent = cls(ab.Opts(embedding_size=8))
    # training: every row is scored (a label outside the candidates is refused), the plain mean cross entropy
    rows = [agent.vectorize(Message(text=r["text"], labels=r["labels"], label_candidates=r["label_candidates"]))
            for r in ROWS if r["labels"][0] in r["label_candidates"]]
    batch = agent.batchify(rows)
    with torch.no_grad():
        out = agent.model(batch)
    assert float(out["loss"]) == pytest.approx(float(F.cross_entropy(out["scores"], batch["label_index"])),
                                               rel=1e-6)
    with pytest.raises(DataFileError, match="not among its 1 label_candidates"):
        agent.vectorize(Message(text="cherry", labels=["q"], label_candidates=["x"]))
    # evaluation: a batch none of whose labels is a candidate has loss 0 and a finite gradient (it was NaN)
    rows = [agent.vectorize(Message(text=t, eval_labels=["q"], label_candidates=c))
            for t, c in (("a b", ["x"]), ("c", ["x", "y", "z"]))]
    batch = agent.batchify(rows)
    batch.setdefault("label_index", torch.tensor([-1, -1]))  # memnn's batchify leaves it out: force the loss
    out = agent.model(batch)
    assert float(out["loss"].detach()) == 0.0
    out["loss"].backward()
    assert all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in agent.model.parameters())


def test_candidate_loss_by_hand():
    # row 0 scores x (label) 2 against y 0: nll = log(e^2 + e^0) - 2; row 3 scores z (label) 1 against x 0 and
    # y 0: nll = log(e^1 + 2) - 1; row 1 is a miss (-1) and row 2 a padding row (no candidates, a zero label
    # index): both left out, so the loss is the mean of the two nlls
    low = torch.finfo(torch.float32).min
    scores = torch.tensor([[2.0, 0.0, low], [1.0, 5.0, 3.0], [low, low, low], [0.0, 0.0, 1.0]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0], [1, 1, 1]])
    out = candidate_loss(scores, torch.tensor([0, -1, 0, 2]), mask)
    nll = [math.log(math.exp(2) + 1) - 2, 0.0, 0.0, math.log(math.e + 2) - 1]
    assert out[ROW_LOSS].tolist() == pytest.approx(nll, rel=1e-6)
    assert out[ROW_COUNTED].tolist() == [1.0, 0.0, 0.0, 1.0]
    assert float(out["loss"]) == pytest.approx((nll[0] + nll[3]) / 2, rel=1e-6)
    half = candidate_loss(scores.half().masked_fill(scores == low, torch.finfo(torch.float16).min),
                          torch.tensor([-1, -1, 0, -1]), mask)
    assert float(half["loss"]) == 0.0 and half[ROW_COUNTED].sum() == 0
