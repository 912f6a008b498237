"""``-m bag``: a bag-of-words ranker (EmbeddingBag + Linear over the text), trained with SGD.

A *ranker over label candidates*, not a classifier over a fixed label vocabulary: it scores each row's
``label_candidates`` by a dot product between the encoded text and each encoded candidate, and replies with
the best one. So it needs no label vocabulary built from the data, works on any task whose examples carry
candidates (``dialogues``, ``babi:1``), and every reply carries text the teacher scores (accuracy, F1).
Training minimises cross entropy over the candidates (the row's first label is the target; a row whose
label is not among its candidates is left out of the loss).

:class:`RankerAgent` holds what the bag and conv models share: hashed words (:data:`VOCAB` buckets, 0 is
padding), the text truncated to ``--text-truncate`` tokens keeping the end (ParlAI's rule: the latest turn
matters most), candidate tensors, replies. Subclasses give only the text encoder (``build_model``).

Optimizer: plain SGD at ``--learning-rate`` (whatever ``--optimizer`` says), as the benchmark asks; SGD keeps
no per-parameter state, which also suits hogwild processes sharing one model. Useful rates are larger than
Adam's default: about 0.5 for ``bag``, 0.1 for ``conv``. Fused on --device cuda.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from accelbatch.agents import TorchAgent, hash_tokens, optimizer_kwargs, tokenize
from accelbatch.messages import EVAL_LABELS, LABEL_CANDIDATES, LABELS, TEXT, Message

VOCAB = 8192
MAX_CANDIDATE_WORDS = 8
INIT_STD = 1.0


class CandidateScorer(nn.Module):
    """Shared tail of the rankers: encode candidates, score them against a text vector, the loss."""

    def __init__(self, dim: int):
        super().__init__()
        self.cand_emb = nn.EmbeddingBag(VOCAB, dim, mode="mean", padding_idx=0)
        nn.init.normal_(self.cand_emb.weight, std=INIT_STD)

    def score(self, text_vec: torch.Tensor, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        cands = batch["candidates"]  # [rows, C, W]
        rows, n_cands, words = cands.shape
        cand_vecs = self.cand_emb(cands.reshape(rows * n_cands, words)).view(rows, n_cands, -1)
        scores = torch.einsum("rcd,rd->rc", cand_vecs, text_vec)
        # the dtype's own minimum: -1e9 overflows fp16 (autocast) and masked_fill refuses it
        scores = scores.masked_fill(batch["cand_mask"] == 0, torch.finfo(scores.dtype).min)
        out = {"scores": scores}
        if "label_index" in batch:
            # rows without candidates (padding rows added by static-shape batching) are left out of the loss
            target = batch["label_index"].masked_fill(batch["cand_mask"].sum(dim=1) == 0, -1)
            if bool((target >= 0).any()):
                out["loss"] = F.cross_entropy(scores, target, ignore_index=-1)
            else:  # no row has its label among its candidates: nothing to learn from, a zero loss
                out["loss"] = scores.sum() * 0.0
        return out


class BagOfWords(CandidateScorer):
    """forward(batch) -> {"loss", "scores" [rows, candidates]}: mean of word vectors, one Linear."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.text_emb = nn.EmbeddingBag(VOCAB, dim, mode="mean", padding_idx=0)
        nn.init.normal_(self.text_emb.weight, std=INIT_STD)
        self.proj = nn.Linear(dim, dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.score(self.proj(self.text_emb(batch["text_vec"])), batch)


def pad_rows(rows: list[list[int]], multiple: int = 1) -> torch.Tensor:
    """Right-pad rows of ids with 0 to the longest (rounded up to ``multiple``): [rows, length] LongTensor."""
    width = max(1, max((len(r) for r in rows), default=1))
    width = -(-width // multiple) * multiple
    return torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.long)


class TokenLength:
    """Picklable length function for dynamic batching: the tokens ``vectorize`` keeps of a message's text."""

    def __init__(self, truncate: int):
        self.truncate = truncate

    def __call__(self, msg: Message) -> int:
        n = len(tokenize(msg.get("full_text", msg.get(TEXT)) or ""))
        return min(n, self.truncate) if self.truncate > 0 else n


class RankerAgent(TorchAgent):
    """Ranks label candidates; subclasses give ``build_model`` (forward(batch) -> scores and loss)."""

    pad_multiple = 1  # text padded to a multiple of this (1: exactly the longest row)
    required_fields = (LABEL_CANDIDATES,)  # the build refuses data without them (nothing to rank, zero loss)

    def __init__(self, opts: Any, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        # the loader sorts and buckets examples by this; it counts exactly the tokens of text_vec
        self.example_length = TokenLength(opts.text_truncate)

    def build_optimizer(self, model: nn.Module) -> torch.optim.Optimizer | None:
        params = [p for p in model.parameters() if p.requires_grad]
        if not params:
            return None
        return torch.optim.SGD(params, lr=self.opts.learning_rate, **optimizer_kwargs(self.opts, torch.optim.SGD))

    def vectorize(self, obs: Message) -> Message:
        text = obs.get("full_text", obs.get(TEXT)) or ""
        tokens = tokenize(text)
        if self.opts.text_truncate > 0 and len(tokens) > self.opts.text_truncate:
            tokens = tokens[-self.opts.text_truncate:]
        obs["text_vec"] = hash_tokens(tokens, VOCAB)
        cands = obs.get(LABEL_CANDIDATES) or []
        obs["cand_vecs"] = [hash_tokens(tokenize(c)[:MAX_CANDIDATE_WORDS], VOCAB) for c in cands]
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS) or []
        obs["label_index"] = next((i for i, c in enumerate(cands) if targets and c == targets[0]), -1)
        return obs

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        n_cand = max(1, max(len(o["cand_vecs"]) for o in observations))
        n_words = max(1, max((len(c) for o in observations for c in o["cand_vecs"]), default=1))
        empty = [0] * n_words
        cands = [[c + [0] * (n_words - len(c)) for c in o["cand_vecs"]]
                 + [empty] * (n_cand - len(o["cand_vecs"])) for o in observations]
        mask = [[1] * len(o["cand_vecs"]) + [0] * (n_cand - len(o["cand_vecs"])) for o in observations]
        return {
            "text_vec": pad_rows([o["text_vec"] for o in observations], self.pad_multiple),
            "candidates": torch.tensor(cands, dtype=torch.long),
            "cand_mask": torch.tensor(mask, dtype=torch.long),
            "label_index": torch.tensor([o["label_index"] for o in observations], dtype=torch.long),
        }

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        best = outputs["scores"].argmax(dim=-1).tolist()
        out = []
        for obs, k in zip(observations, best):
            cands = obs.get(LABEL_CANDIDATES) or []
            out.append({"text": cands[k]} if k < len(cands) else {})
        return out


class BagAgent(RankerAgent):
    """``-m bag``: :class:`BagOfWords` ranker, SGD."""

    def build_model(self) -> nn.Module:
        return BagOfWords(self.opts.embedding_size)
