"""Your own TorchAgent on the bundled task, on any device: the library call in full.

The model is deliberately simple (a bag of words of the last lines: about 40% on babi:1, where the
memnn reference model reaches 99%); what matters here is the shape of the agent.

    python examples/custom_agent.py                      # cpu
    python examples/custom_agent.py --device cuda        # a GPU, through accelerate
    python examples/custom_agent.py --device ipu --ipu-emulator
    python examples/custom_agent.py -rf 2 -di 2          # simulated replicas, 2 device iterations

The agent says what to compute (build_model, vectorize, batchify, replies); the backend decides where.
Every option of `accelbatch train` is accepted.
"""

from __future__ import annotations

import sys

import torch
from torch import nn
from torch.nn import functional as F

import accelbatch as ab
from accelbatch.agents import hash_tokens, pad_2d, tokenize
from accelbatch.cli import run_script

VOCAB = 2048


class BagOfWordsRanker(nn.Module):
    """Scores each candidate by a dot product with the bag of words of the last two lines + question."""

    def __init__(self, dim: int):
        super().__init__()
        self.text = nn.EmbeddingBag(VOCAB, dim, mode="sum", padding_idx=0)
        self.cand = nn.Embedding(VOCAB, dim, padding_idx=0)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        query = self.text(batch["text_vec"])                       # [rows, dim]
        scores = torch.einsum("rd,rcd->rc", query, self.cand(batch["cand_ids"]))
        # rows have different numbers of candidates: pad_2d's id 0 columns must win neither argmax nor loss
        # (the lowest finite score, not -inf, keeps an all-padding row's loss finite)
        scores = scores.masked_fill(batch["cand_ids"] == 0, torch.finfo(scores.dtype).min)
        out = {"scores": scores}
        if "label_index" in batch:
            # the mean over the rows with a label (-1: a context turn, which trains nothing); a micro-batch of
            # context turns alone has loss 0, not cross_entropy's 0/0 NaN (-ga, -di and -rf cut calls into them)
            target = batch["label_index"]
            labelled = target >= 0
            per_row = F.cross_entropy(scores, target.clamp_min(0), reduction="none") * labelled
            out["loss"] = per_row.sum() / labelled.sum().clamp_min(1)
        return out


class MyAgent(ab.TorchAgent):
    def build_model(self) -> nn.Module:
        return BagOfWordsRanker(self.opts.embedding_size)

    def vectorize(self, obs: ab.Message) -> ab.Message:
        lines = obs.get("full_text", obs.get("text", "")).split("\n")
        obs["text_vec"] = hash_tokens(tokenize(" ".join(lines[-3:])), VOCAB)
        cands = obs.get("label_candidates") or []
        obs["cand_ids"] = [hash_tokens([c], VOCAB)[0] for c in cands]
        answers = obs.get("labels") or obs.get("eval_labels") or []
        obs["label_index"] = next((i for i, c in enumerate(cands) if c in answers), -1)
        return obs

    def batchify(self, observations: list[ab.Message]) -> dict[str, torch.Tensor]:
        batch = {"text_vec": pad_2d([o["text_vec"] for o in observations]),
                 "cand_ids": pad_2d([o["cand_ids"] for o in observations])}
        if any(o["label_index"] >= 0 for o in observations):
            batch["label_index"] = torch.tensor([o["label_index"] for o in observations])
        return batch

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[ab.Message]) -> list[dict]:
        best = outputs["scores"].argmax(-1).tolist()
        out = []
        for o, i in zip(observations, best):
            cands = o.get("label_candidates") or []
            # a row without candidates replies "": scored as a miss, as the bundled rankers do
            out.append({"text": cands[i] if i < len(cands) else ""})
        return out


def main(argv: list[str] | None = None) -> dict:
    opts = ab.Opts.from_args(argv, task="babi:1", num_epochs=2.0)
    world = ab.create_world(opts, agent=MyAgent)
    report = ab.run(world, opts)
    print(ab.format_report(report))
    return report


if __name__ == "__main__":
    sys.exit(run_script(main))  # bad input: one line and exit 2, as accelbatch train says it
