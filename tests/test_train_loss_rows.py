"""The train row's loss is the mean over the labelled examples trained, as ParlAI's per-example loss: context turns
(no labels) in a batch add nothing, so it is the same whatever the batch size, and a resumed run's merges it
weighted by those examples (the teacher's exs also counts the context turns).

The agent's model gives each row the loss its text names, so the expected figure is a mean over the data."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import sigint_at_batch
from torch import nn

from accelbatch.agents import ROW_COUNTED, ROW_LOSS, TorchAgent
from accelbatch.build import create_world
from accelbatch.cli import main
from accelbatch.opts import Opts
from accelbatch.run import evaluate, run


class FixedLosses(nn.Module):
    """Each labelled row's loss is the number its text ends with; ``rows``: per-row outputs (ROW_LOSS)."""

    def __init__(self, rows: bool):
        super().__init__()
        self.w, self.rows = nn.Parameter(torch.zeros(())), rows

    def forward(self, batch):
        per_row, counted = batch["loss"] + 0.0 * self.w, batch["counted"]
        out = {"loss": (per_row * counted).sum() / counted.sum().clamp_min(1.0)}
        if self.rows:
            out.update({ROW_LOSS: (per_row * counted).detach(), ROW_COUNTED: counted})
        return out


class FixedLossAgent(TorchAgent):
    row_outputs = True

    def build_model(self):
        return FixedLosses(self.row_outputs)

    def vectorize(self, obs):
        labels = obs.get("labels", obs.get("eval_labels"))
        return {"loss": float(obs["text"].rsplit(" ", 1)[1]), "counted": float(labels is not None)}

    def batchify(self, observations):
        return {key: torch.tensor([o[key] for o in observations]) for key in ("loss", "counted")}

    def replies(self, outputs, observations):
        return [{"text": "x"} for _ in observations]


class MeanLossOnly(FixedLossAgent):
    row_outputs = False


def _data(tmp_path, uniform=False):
    """33 turns in episodes of 1-4, some of them context turns (no labels); the labelled turns' mean loss
    (``uniform``: every turn's loss the same, so any set of labelled turns has that mean)."""
    rows, losses = [], []
    for episode in range(14):
        turns = 1 + episode % 4
        for turn in range(turns):
            loss = 1.25 if uniform else round(0.1 + (episode * 7 + turn * 3) % 11 * 0.25, 2)
            row = {"text": f"turn {episode}.{turn} {loss}", "episode_done": turn == turns - 1}
            if turn != 1:  # the second turn of an episode is context
                row["labels"] = ["x"]
                losses.append(loss)
            rows.append(row)
    for split in ("train", "valid", "test"):
        (tmp_path / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return len(rows), sum(losses) / len(losses)


def _opts(tmp_path, **extra):
    return Opts(**{"task": f"jsonl:{tmp_path}", "datatype": "train:ordered", "num_epochs": 1.0,
                   "validation_every_n_epochs": -1, "eval_splits": "", "progress": False, "learning_rate": 1e-6,
                   **extra})


@pytest.mark.parametrize("agent", [FixedLossAgent, MeanLossOnly], ids=["row-losses", "batch-mean"])
def test_the_train_loss_is_the_mean_over_labelled_examples_whatever_the_batch_size(tmp_path, agent):
    examples, expected = _data(tmp_path)
    for batchsize in (1, 7, 35):
        opts = _opts(tmp_path, batchsize=batchsize)
        report = run(create_world(opts, agent=agent), opts)["train"]
        assert report["exs"] == examples
        assert report["loss"] == pytest.approx(expected, rel=1e-6), batchsize


# several micro-batches a call, some of context turns alone (loss 0): each weighed by its labelled rows
@pytest.mark.parametrize("plan", [dict(gradient_accumulation=2), dict(device_iterations=2),
                                  dict(replication_factor=2),
                                  dict(gradient_accumulation=2, device="ipu", ipu_emulator=True, datatype="train")],
                         ids=["ga2", "di2", "rf2-in-process", "ga2-ipu"])
@pytest.mark.parametrize("agent", [FixedLossAgent, MeanLossOnly], ids=["row-losses", "batch-mean"])
def test_the_train_loss_is_the_mean_over_labelled_examples_of_every_micro_batch(tmp_path, agent, plan):
    _, expected = _data(tmp_path, uniform=plan.get("device") == "ipu")  # an IPU drops a partial last step
    opts = _opts(tmp_path, batchsize=1, drop_last=plan.get("device") == "ipu", output_mode="all", **plan)
    report = run(create_world(opts, agent=agent), opts)  # all: the loss of every micro-batch is reported
    assert report["train"]["loss"] == pytest.approx(expected, rel=1e-6)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("batchsize", [1, 3])  # -bs 1: context turns alone in a step (no training call sees one)
def test_a_resumed_run_merges_the_loss_over_the_examples_it_averages(tmp_path, batchsize):
    examples, expected = _data(tmp_path)
    opts = _opts(tmp_path, batchsize=batchsize, num_epochs=3.0, model_file=str(tmp_path / "m" / "m.pt"),
                 model="test_train_loss_rows:FixedLossAgent")
    with pytest.raises(KeyboardInterrupt, match="checkpoint saved"):
        run(create_world(opts, agent=sigint_at_batch(FixedLossAgent, 20)), opts)
    report_json = tmp_path / "report.json"
    assert main(["train", "-mf", opts.model_file, "--resume", "--no-progress", "--report-json",
                 str(report_json)]) == 0
    train = json.loads(report_json.read_text())["train"]
    assert train["exs"] == 3 * examples
    assert train["loss"] == pytest.approx(expected, rel=1e-7)


# an evaluation call of several micro-batches (-di 2 at -bs 1), some of context turns alone: on every device
# each micro-batch's mean counts for its labelled rows
@pytest.mark.parametrize("device", ["cpu", "ipu"])
def test_the_eval_loss_is_the_mean_over_labelled_examples_of_every_micro_batch(tmp_path, device):
    _, expected = _data(tmp_path)
    opts = _opts(tmp_path, datatype="valid", batchsize=1, device_iterations=2, device=device,
                 ipu_emulator=device == "ipu")
    world = create_world(opts, agent=MeanLossOnly)
    try:
        report = evaluate(world)
    finally:
        world.shutdown()
    assert report["loss"] == pytest.approx(expected, rel=1e-6)
