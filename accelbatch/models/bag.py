"""``-m bag``: a bag-of-words ranker (EmbeddingBag + Linear over the text).

A *ranker over label candidates*, not a classifier over a fixed label vocabulary: it scores each row's
``label_candidates`` by a dot product between the encoded text and each encoded candidate, and replies with
the best one. So it needs no label vocabulary built from the data, works on any task whose examples carry
candidates (``dialogues``, ``babi:1``), and every reply carries text the teacher scores (accuracy, F1).
Training minimises cross entropy over the candidates; the target is the first of the row's labels that is
one of them (:func:`target_index`). In evaluation a row whose labels are not among its candidates (or that has
none) is scored as a miss (an empty reply) and left out of the loss, which is the mean over the other rows
exactly, whatever the batch size (:func:`candidate_loss`).

:class:`RankerAgent` holds what the bag and conv models share: hashed words (:data:`VOCAB` buckets, 0 is
padding), the text truncated to ``--text-truncate`` tokens keeping the end (ParlAI's rule: the latest turn
matters most), each candidate cut to its first ``--label-truncate`` words (:func:`candidate_words`: 8 at -1),
candidate tensors, replies. Subclasses give only the text encoder (``build_model``).

Optimizer: ``--optimizer`` at ``--learning-rate``, as for every TorchAgent (fused on --device cuda). The
defaults (Adam, 0.01) learn: 2 epochs of ``dialogues:4000`` reach valid accuracy 0.84 (bag) and 0.69 (conv),
where SGD at 0.01 reached 0.24 and 0.13. With ``-opt sgd`` useful rates are larger: about 0.5 for ``bag``, 0.1
for ``conv`` (conv diverged at 0.5 on ``babi:1``). On ``babi:1`` both stay near 0.40 whatever the optimizer
and rate: a bag of words, or max-pooled 5-word windows, cannot tell which of a person's moves came last.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F

from accelbatch.agents import ROW_COUNTED, ROW_LOSS, TorchAgent
from accelbatch.dictionary import HashDictionary, SharedDictionary, tokenize
from accelbatch.messages import EVAL_LABELS, LABEL_CANDIDATES, LABELS, TEXT, Message
from accelbatch.tasks.files import DataFileError

VOCAB = 8192
MAX_CANDIDATE_WORDS = 8  # words a candidate keeps, its first, when --label-truncate is -1 (bag and conv)
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
            out.update(candidate_loss(scores, batch["label_index"], batch["cand_mask"]))
        return out


def candidate_loss(scores: torch.Tensor, label_index: torch.Tensor, cand_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """The rankers' loss over ``scores`` [rows, candidates]: ``loss``, the mean cross entropy over the scored rows,
    and per row :data:`~accelbatch.agents.ROW_LOSS` (0 where not scored) and ``ROW_COUNTED`` (1 where scored),
    from which evaluation reports the mean over every scored row exactly, however the rows are batched.

    A row is scored when its label is among its candidates (``label_index`` >= 0) and it has candidates (padding
    rows of static shapes have none, whatever their zero ``label_index``). A batch without scored rows has loss 0
    and no gradient. Training rows are all scored (a label outside the candidates is refused): there ``loss`` is
    the plain mean cross entropy."""
    target = label_index.masked_fill(cand_mask.sum(dim=1) == 0, -1)
    # reduction "none": rows left out are exactly 0 (a sum of the masked scores would be -inf, and x 0.0 NaN)
    per_row = F.cross_entropy(scores, target, ignore_index=-1, reduction="none")
    counted = (target >= 0).to(per_row.dtype)
    # clamp: no scored row gives 0 / 1, on the device (no host read to test for it)
    return {"loss": per_row.sum() / counted.sum().clamp_min(1.0), ROW_LOSS: per_row.detach(), ROW_COUNTED: counted}


class BagOfWords(CandidateScorer):
    """forward(batch) -> {"loss", "scores" [rows, candidates]}: mean of word vectors, one Linear."""

    def __init__(self, dim: int):
        super().__init__(dim)
        self.text_emb = nn.EmbeddingBag(VOCAB, dim, mode="mean", padding_idx=0)
        nn.init.normal_(self.text_emb.weight, std=INIT_STD)
        self.proj = nn.Linear(dim, dim)

    def forward(self, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return self.score(self.proj(self.text_emb(batch["text_vec"])), batch)


def long_tensor(flat: array, shape: tuple[int, ...]) -> torch.Tensor:
    """A LongTensor of ``shape`` holding the int64 array ``flat`` (its own copy: one memcpy, where
    ``torch.tensor`` on a list converts element by element, about 3x slower for a batch)."""
    if not flat:
        return torch.zeros(shape, dtype=torch.long)
    return torch.frombuffer(flat, dtype=torch.long).clone().view(shape)


def pad_rows(rows: list[list[int]], multiple: int = 1) -> torch.Tensor:
    """Right-pad rows of ids with 0 to the longest (rounded up to ``multiple``): [rows, length] LongTensor."""
    if not rows:
        return torch.zeros(0, dtype=torch.long)
    width = max(1, max(map(len, rows)))
    width = -(-width // multiple) * multiple
    flat, zeros = array("q"), array("q", bytes(8 * width))
    for row in rows:
        flat.extend(row)
        flat.extend(zeros[len(row):])
    return long_tensor(flat, (len(rows), width))


def candidate_words(opts: Any, default: int = MAX_CANDIDATE_WORDS) -> int:
    """Words each label candidate keeps, its first (as ParlAI truncates labels): ``--label-truncate``, or the
    model's ``default`` when it is -1."""
    return default if opts.label_truncate == -1 else opts.label_truncate  # Opts refuses other values < 1


def target_index(candidates: Any, labels: Sequence[str] | None) -> int:
    """The position among ``candidates`` of the first of ``labels`` that is one of them (its first position),
    -1 when none is: the candidate a ranker learns to pick, and evaluation's loss scores."""
    for label in labels or ():
        found = _index(candidates, label)
        if found >= 0:
            return found
    return -1


def unrankable(task: str, obs: Message, candidates: Any, labels: Sequence[str] | None) -> DataFileError:
    """The error for a training example none of whose labels is among its label_candidates: a ranker learns to
    pick the label from them, so it cannot learn from it (ParlAI refuses such an example in training too;
    evaluation scores it, as a miss)."""
    labels = list(labels or ())
    count = f"{len(candidates)} label_candidates"
    if not labels:
        what = "labels are empty"
    elif len(labels) == 1:
        what = f"label {labels[0]!r} is not among its {count}"
    else:
        what = f"labels {labels!r}: none is among its {count}"
    return DataFileError(f"-t {task}: a training example's {what} (text {str(obs.get(TEXT))[:60]!r}); "
                         "a ranking model learns to pick the label from the candidates: add the label to the "
                         "example's label_candidates, or leave the example out")


def _index(candidates: Any, target: str) -> int:
    """The first position of ``target`` among ``candidates`` (any sequence), -1 when absent."""
    try:
        return candidates.index(target)  # lists and tuples: in C
    except ValueError:
        return -1
    except AttributeError:
        return next((i for i, c in enumerate(candidates) if c == target), -1)


class TokenLength:
    """Picklable length function for dynamic batching: the tokens ``vectorize`` keeps of a message's text.
    With the agent's ``dictionary`` it counts from its text cache, so the loader's length and ``vectorize``
    tokenize a text once (pickled together to a data worker, the two keep sharing one dictionary)."""

    def __init__(self, truncate: int, dictionary: HashDictionary | None = None):
        self.truncate = truncate
        self.dictionary = dictionary

    def __call__(self, msg: Message) -> int:
        text = msg.get("full_text", msg.get(TEXT)) or ""
        if self.dictionary is not None:
            return self.dictionary.text_length(text, self.truncate)
        n = len(tokenize(text))
        return min(n, self.truncate) if self.truncate > 0 else n


class RankerAgent(SharedDictionary, TorchAgent):
    """Ranks label candidates; subclasses give ``build_model`` (forward(batch) -> scores and loss)."""

    dictionary_size = VOCAB
    pad_multiple = 1  # text padded to a multiple of this (1: exactly the longest row)
    required_fields = (LABEL_CANDIDATES,)  # the build refuses data without them (nothing to rank, zero loss)

    def __init__(self, opts: Any, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)
        # the loader sorts and buckets examples by this; it counts exactly the tokens of text_vec
        self.example_length = TokenLength(opts.text_truncate, self.dictionary)

    def vectorize(self, obs: Message) -> Message:
        text = obs.get("full_text", obs.get(TEXT)) or ""
        words = self.dictionary
        obs["text_vec"] = words.text_ids(text, self.opts.text_truncate)
        cands = obs.get(LABEL_CANDIDATES) or []
        obs["cand_vecs"] = words.short_texts_ids(cands, candidate_words(self.opts))
        targets = obs.get(LABELS) or obs.get(EVAL_LABELS)
        obs["label_index"] = target_index(cands, targets)
        if obs["label_index"] < 0 and LABELS in obs:
            raise unrankable(self.opts.task, obs, cands, targets)
        return obs

    def batchify(self, observations: list[Message]) -> dict[str, torch.Tensor]:
        cand_vecs = [o["cand_vecs"] for o in observations]
        counts = list(map(len, cand_vecs))
        n_cand = max(1, max(counts))
        n_words = max(1, max((len(c) for cs in cand_vecs for c in cs), default=1))
        pad = [[0] * (n_words - k) for k in range(n_words + 1)]  # what a candidate of k words lacks
        absent = [[0] * (n_words * k) for k in range(n_cand + 1)]  # k missing candidates
        flat: list[int] = []
        for cs in cand_vecs:
            for c in cs:
                flat += c
                flat += pad[len(c)]
            flat += absent[n_cand - len(cs)]
        return {
            "text_vec": pad_rows([o["text_vec"] for o in observations], self.pad_multiple),
            "candidates": long_tensor(array("q", flat), (len(observations), n_cand, n_words)),
            "cand_mask": (torch.arange(n_cand) < torch.tensor(counts).unsqueeze(1)).long(),
            "label_index": torch.tensor([o["label_index"] for o in observations], dtype=torch.long),
        }

    def replies(self, outputs: dict[str, torch.Tensor], observations: list[Message]) -> list[dict[str, Any]]:
        """The best candidate of each row; an empty text where a row has none, which the metrics score as a
        miss (a reply without text would not be scored at all)."""
        best = outputs["scores"].argmax(dim=-1).tolist()
        out = []
        for obs, k in zip(observations, best):
            cands = obs.get(LABEL_CANDIDATES) or []
            out.append({"text": cands[k] if k < len(cands) else ""})
        return out


class BagAgent(RankerAgent):
    """``-m bag``: :class:`BagOfWords` ranker."""

    def build_model(self) -> nn.Module:
        return BagOfWords(self.opts.embedding_size)
