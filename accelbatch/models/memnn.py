"""Reference model: an end-to-end memory network ranking label candidates (bag-of-words memories).

Each line of the conversation so far is a memory (bag of hashed words plus an embedding of how many
lines ago it was said); the last line is the question. One attention hop over the memories, then the
candidates are scored by a dot product with the answer vector. Learns the bundled ``babi:1`` task to
over 95% validation accuracy within a few epochs on a laptop CPU. The loss is the rankers'
(:func:`~accelbatch.models.bag.candidate_loss`): in evaluation, the mean over the rows whose label is among
their candidates, whatever the batch size; the target is the first of a row's labels among its candidates.

Limits: the last :data:`MAX_MEMORIES` lines before the question are its memories (fixed: the time embeddings
have a row per age). Each memory and the question keep their last ``--text-truncate`` words (-1: all), as
ParlAI's memnn truncates each memory and the query; each candidate keeps its first ``--label-truncate`` words
(:data:`MAX_WORDS` at -1), as ParlAI's rankers truncate candidates.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from accelbatch.agents import TorchAgent
from accelbatch.dictionary import SharedDictionary
from accelbatch.messages import EVAL_LABELS, LABEL_CANDIDATES, LABELS, Message
from accelbatch.models.bag import candidate_loss, candidate_words, long_tensor, target_index, unrankable

VOCAB = 4096
MAX_MEMORIES = 32  # lines before the question kept as memories, the latest (fixed: the time embeddings' rows)
MAX_WORDS = 16  # words a candidate keeps (its first) at --label-truncate -1; word widths are multiples of it


class MemoryNetwork(nn.Module):
    """forward(batch) -> {"loss", "scores" [rows, candidates]}."""

    def __init__(self, vocab: int, dim: int, max_memories: int):
        super().__init__()
        self.query_emb = nn.EmbeddingBag(vocab, dim, mode="sum", padding_idx=0)
        self.memory_in = nn.EmbeddingBag(vocab, dim, mode="sum", padding_idx=0)
        self.memory_out = nn.EmbeddingBag(vocab, dim, mode="sum", padding_idx=0)
        self.time_in = nn.Embedding(max_memories + 1, dim, padding_idx=0)
        self.time_out = nn.Embedding(max_memories + 1, dim, padding_idx=0)
        self.cand_emb = nn.EmbeddingBag(vocab, dim, mode="sum", padding_idx=0)
        for emb in (self.query_emb, self.memory_in, self.memory_out, self.cand_emb, self.time_in, self.time_out):
            nn.init.normal_(emb.weight, std=0.1)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        memories, query, cands = batch["memories"], batch["query"], batch["candidates"]
        rows, mems, words = memories.shape
        flat = memories.view(rows * mems, words)
        age = batch["memory_age"]  # [rows, mems], 0 for padding, 1 = most recent
        m_in = self.memory_in(flat).view(rows, mems, -1) + self.time_in(age)
        m_out = self.memory_out(flat).view(rows, mems, -1) + self.time_out(age)
        u = self.query_emb(query)
        logits = torch.einsum("rmd,rd->rm", m_in, u)
        logits = logits.masked_fill(age == 0, torch.finfo(logits.dtype).min)
        attention = logits.softmax(dim=-1)
        answer = u + torch.einsum("rm,rmd->rd", attention, m_out)
        c_rows, n_cands, c_words = cands.shape
        cand_vecs = self.cand_emb(cands.view(c_rows * n_cands, c_words)).view(c_rows, n_cands, -1)
        scores = torch.einsum("rcd,rd->rc", cand_vecs, answer)
        # the dtype's own minimum: -1e9 overflows fp16 (autocast) and masked_fill refuses it
        scores = scores.masked_fill(batch["cand_mask"] == 0, torch.finfo(scores.dtype).min)
        out = {"scores": scores}
        if "label_index" in batch:
            # padding rows (static shapes: no candidates) and labels outside the candidates are left out
            out.update(candidate_loss(scores, batch["label_index"], batch["cand_mask"]))
        return out


class MemNNAgent(SharedDictionary, TorchAgent):
    """``-m memnn``: ranks ``label_candidates`` with :class:`MemoryNetwork`; the word ids of each line,
    question and candidate come from the dictionary its clones share."""

    dictionary_size = VOCAB
    required_fields = (LABEL_CANDIDATES,)  # the build refuses data without them (nothing to rank)

    def build_model(self) -> nn.Module:
        return MemoryNetwork(VOCAB, self.opts.embedding_size, MAX_MEMORIES)

    def vectorize(self, obs: Message) -> Message:
        lines = obs.get("full_text", obs.get("text", "")).split("\n")
        # each line keeps its last -tr words (-1: all), as ParlAI's memnn truncates each memory and the query
        line_ids, keep = self.dictionary.text_ids, self.opts.text_truncate
        vecs = [line_ids(line, keep) for line in lines[-MAX_MEMORIES - 1:]]
        obs["query_vec"], obs["memory_vecs"] = vecs[-1], vecs[:-1]  # the last line asks, the ones before remember
        cands = obs.get(LABEL_CANDIDATES) or []
        obs["cand_vecs"] = self.dictionary.short_texts_ids(cands, candidate_words(self.opts, MAX_WORDS))
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS)
        obs["label_index"] = target_index(cands, targets)
        if obs["label_index"] < 0 and LABELS in obs:
            raise unrankable(self.opts.task, obs, cands, targets)
        return obs

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        rows = len(observations)
        longest = max(1, max(len(o["memory_vecs"]) for o in observations))
        n_mem = min(MAX_MEMORIES, -(-longest // 8) * 8)  # a multiple of 8: few distinct shapes
        n_cand = max(1, max(len(o["cand_vecs"]) for o in observations))
        ages = array("q")
        for o in observations:
            count = len(o["memory_vecs"])
            ages.extend(range(count, 0, -1))  # 1 = the most recent line
            ages.frombytes(bytes(8 * (n_mem - count)))
        counts = torch.tensor([len(o["cand_vecs"]) for o in observations])
        memories, queries = [o["memory_vecs"] for o in observations], [[o["query_vec"]] for o in observations]
        cands = [o["cand_vecs"] for o in observations]
        words = _width(memories + queries)  # one width for the lines, memories and questions
        batch = {"memories": _padded(memories, n_mem, words),
                 "memory_age": long_tensor(ages, (rows, n_mem)),
                 "query": _padded(queries, 1, words).view(rows, words),
                 "candidates": _padded(cands, n_cand, _width(cands)),
                 "cand_mask": (torch.arange(n_cand) < counts.unsqueeze(1)).long()}
        labels = [o["label_index"] for o in observations]
        if any(i >= 0 for i in labels):  # -1: an evaluation example whose label no candidate holds
            batch["label_index"] = torch.tensor(labels, dtype=torch.long)
        return batch

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        best = outputs["scores"].argmax(dim=-1).tolist()
        out = []
        for obs, index in zip(observations, best):
            cands = obs.get(LABEL_CANDIDATES) or []
            out.append({"text": cands[index] if index < len(cands) else ""})
        return out


def _width(groups: Iterable[list[list[int]]]) -> int:
    """Word width for these groups of id rows: the longest row rounded up to a multiple of :data:`MAX_WORDS`,
    at least MAX_WORDS (few distinct shapes; the 0 padding ids add nothing to the sums)."""
    longest = max((len(ids) for group in groups for ids in group), default=0)
    return max(1, -(-longest // MAX_WORDS)) * MAX_WORDS


def _padded(groups: list[list[list[int]]], count: int, width: int) -> torch.Tensor:
    """[len(groups), count, width] LongTensor: each group's id rows right-padded with 0 to ``width`` words,
    each group to ``count`` rows (one copy from a flat array, no tensor made per row)."""
    flat, zeros = array("q"), array("q", bytes(8 * width))
    for group in groups:
        for ids in group:
            flat.extend(ids)
            flat.extend(zeros[len(ids):])
        flat.frombytes(bytes(8 * width * (count - len(group))))
    return long_tensor(flat, (len(groups), count, width))
