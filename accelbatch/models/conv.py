"""``-m conv``: Embedding + Conv1d + max pooling + Linear, ranking label candidates.

The convolution runs over every position of the padded ``[rows, length]`` text, padding included, so
padding costs real compute: this is the model that shows what dynamic batching saves. The pooling is masked
(padding positions never win the max) and the padding embedding is zero, so a row's scores do not depend on
how much padding its batch has: batching changes the speed, never the answers.

Candidates (each its first ``--label-truncate`` words, 8 at -1), text truncation, the target, the loss,
replies and the optimizer (``--optimizer``) are :class:`~accelbatch.models.bag.RankerAgent`'s.
"""

from __future__ import annotations

import torch
from torch import nn

from accelbatch.models.bag import INIT_STD, VOCAB, CandidateScorer, RankerAgent

HIDDEN = 128
KERNEL = 5


class ConvText(CandidateScorer):
    """forward(batch) -> {"loss", "scores" [rows, candidates]}."""

    def __init__(self, dim: int, hidden: int = HIDDEN, kernel: int = KERNEL):
        super().__init__(dim)
        self.emb = nn.Embedding(VOCAB, dim, padding_idx=0)
        # word vectors of norm ~1: the convolution's gradients stay O(1), so -opt sgd at the rate the ranker's
        # docstring recommends (~0.1) is stable even with few rows per batch (std 1 gave gradient norms ~15)
        nn.init.normal_(self.emb.weight, std=INIT_STD / dim ** 0.5)
        with torch.no_grad():
            self.emb.weight[0].zero_()
        self.conv = nn.Conv1d(dim, hidden, kernel, padding=kernel // 2)
        self.out = nn.Linear(hidden, dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = batch["text_vec"]  # [rows, length], 0 = padding
        mask = (text != 0).unsqueeze(1)  # [rows, 1, length]
        h = torch.relu(self.conv(self.emb(text).transpose(1, 2)))  # [rows, hidden, length]
        pooled = h.masked_fill(~mask, -1.0).amax(dim=2).clamp_min(0.0)  # relu >= 0: empty rows give 0
        return self.score(self.out(pooled), batch)


class ConvAgent(RankerAgent):
    """``-m conv``: :class:`ConvText` ranker."""

    def build_model(self) -> nn.Module:
        return ConvText(self.opts.embedding_size)
