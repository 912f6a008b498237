"""Metrics with ParlAI's names (exs, accuracy, f1, loss) that aggregate across clones and processes.

A :class:`Metrics` object holds sums and counts, so two of them merge by addition: clones share one
object, processes send theirs (``state()``) to be merged (``merge_state``). Accuracy and F1 for a
batch are computed in one pass over the batch by :func:`score_batch`; :meth:`Metrics.add_rows` and
:meth:`Metrics.add_replies` (the BatchWorld's path) count the batches' (reply, answers) pairs and score them a
few thousand rows at a time, each distinct pair once, weighted by how often it occurred.
"""

from __future__ import annotations

import math
import re
import string
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from itertools import repeat
from typing import Iterable, Sequence

import numpy as np

from accelbatch.messages import TEXT
from accelbatch.report_merge import (  # noqa: F401
    AVERAGED_METRICS,
    LOSS_COUNT,
    SCORED,
    SHARED_COUNTS,
    TOKEN_WEIGHTED,
    combine_reports,
    finish_merged,
    merge_reports,
    report_weights,
)

REPLY_METRICS = "metrics"  # ParlAI's local metrics in a reply (not read: see _tell_reply_metrics)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCT = str.maketrans(string.punctuation, " " * len(string.punctuation))  # as ParlAI: a space


def wants_bleu(metrics: str) -> bool:
    """Whether --metrics asks for bleu-4 ('all', or a list naming it)."""
    return bool({m.strip() for m in metrics.split(",")} & {"all", "bleu-4"})


def normalize_answer(text: str) -> str:
    """Lower case, punctuation and articles made spaces, single spaces (ParlAI's normalisation)."""
    text = _ARTICLES.sub(" ", text.lower().translate(_PUNCT))
    return " ".join(text.split())


def _f1_tokens(pred: list[str], gold: list[str]) -> float:
    common = Counter(pred) & Counter(gold)
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(pred), same / len(gold)
    return 2 * precision * recall / (precision + recall)


def f1_score(prediction: str, answers: Sequence[str]) -> float:
    """Best token-level F1 of the prediction against any of the answers."""
    pred = normalize_answer(prediction).split()
    return max((_f1_tokens(pred, normalize_answer(a).split()) for a in answers), default=0.0)


def bleu4(prediction: str, answers: Sequence[str], epsilon: float = 1e-12) -> float:
    """Sentence BLEU-4 of the prediction against the answers (normalised words), as ParlAI's bleu-4: clipped
    n-gram precisions for n = 1..4 averaged in log space, a precision with no match counted as ``epsilon``
    over its n-grams, the brevity penalty against the answer closest in length; 0 without a word in common.
    Words are split on single spaces, as ParlAI splits them for nltk: a text that normalises to nothing (an
    empty reply, an answer such as "The.") is one empty word."""
    hyp = normalize_answer(prediction).split(" ")
    refs = [normalize_answer(a).split(" ") for a in answers]
    if not refs:
        return 0.0
    log_sum = 0.0
    for n in range(1, 5):
        grams = Counter(tuple(hyp[i:i + n]) for i in range(len(hyp) - n + 1))
        most: Counter = Counter()
        for ref in refs:
            most |= Counter(tuple(ref[i:i + n]) for i in range(len(ref) - n + 1))
        matched, total = sum(min(c, most[g]) for g, c in grams.items()), max(1, sum(grams.values()))
        if n == 1 and matched == 0:
            return 0.0
        log_sum += math.log((matched or epsilon) / total) / 4
    closest = min((len(r) for r in refs), key=lambda r: (abs(r - len(hyp)), r))
    brevity = 1.0 if len(hyp) > closest else math.exp(1 - closest / len(hyp))
    return brevity * math.exp(log_sum)


def exact_match(prediction: str, answers: Sequence[str]) -> bool:
    norm = normalize_answer(prediction)
    return any(norm == normalize_answer(a) for a in answers)


_UNIT_BITS = 1074  # every float is a whole number of 2**-1074


def exact_units(value: float, times: int = 1) -> int:
    """``value * times`` exactly, as a whole number of 2**-1074: sums of these are exact, so they do not depend
    on the order or grouping of their terms (which scoring in chunks, when a report is asked, changes)."""
    numerator, denominator = value.as_integer_ratio()
    return (numerator * times) << (_UNIT_BITS + 1 - denominator.bit_length())


def from_units(units: int) -> float:
    """The float nearest a sum of :func:`exact_units` (integer division rounds correctly)."""
    return units / (1 << _UNIT_BITS)


def _units_of(rows: dict[float, int]) -> int:
    """The exact sum of value x rows over ``rows`` (value -> rows): few distinct values, few big-int steps."""
    return sum(exact_units(value, n) for value, n in rows.items())


def score_batch(predictions: Sequence[str | None], answers: Sequence[Sequence[str]]) -> tuple[int, float, float]:
    """(examples, correct, f1 sum) for a batch of replies, in one pass.

    A row whose prediction is None (the model gave no text, e.g. a training row the output mode did not
    return) counts as an example but is not scored: its accuracy/f1 contribution is excluded from the
    denominators through the returned scored count. Returns (scored, correct, f1_sum).

    Each row's score equals ``exact_match`` and ``f1_score`` of that reply; a (prediction, answers) pair
    seen before is not normalised again (classification-like tasks repeat a few labels and predictions).
    The f1 sum is the exact sum of the rows' F1, rounded once (``math.fsum``'s value).
    """
    correct, f1s = _score_rows(predictions, answers)
    return len(f1s), correct, from_units(_units_of(Counter(f1s)))


def _score_rows(predictions: Sequence[str | None], answers: Sequence[Sequence[str]]) -> tuple[int, list[float]]:
    """(correct, each scored row's F1) of a batch of replies."""
    correct, f1s = 0, []
    score, keep = _score_pair, f1s.append
    for pred, golds in zip(predictions, answers):
        if pred is None or golds is None:  # no reply text, or no answers: not scored
            continue
        hit, f1 = score(pred, golds if type(golds) is tuple else tuple(golds))
        correct += hit
        keep(f1)
    return correct, f1s


@lru_cache(maxsize=1 << 16)
def _score_pair(pred: str, golds: tuple[str, ...]) -> tuple[bool, float]:
    """(exact match, best F1) of one reply; a memo of a pure function, bounded. Built from each text's
    normal form, itself remembered per text (answers and candidate replies recur across examples)."""
    pred_norm, pred_counts, pred_len = _normal_form(pred)
    forms = [_normal_form(g) for g in golds]
    hit = any(pred_norm == norm for norm, _, _ in forms)
    if hit and pred_norm:
        return True, 1.0
    return hit, max((_f1_counts(pred_counts, pred_len, counts, length) for _, counts, length in forms), default=0.0)


@lru_cache(maxsize=1 << 16)
def _normal_form(text: str) -> tuple[str, dict[str, int], int]:
    """(normalized text, its token counts, its number of tokens); the dict is never changed."""
    norm = normalize_answer(text)
    counts: dict[str, int] = {}
    tokens = norm.split()
    for token in tokens:
        counts[token] = counts.get(token, 0) + 1
    return norm, counts, len(tokens)


def clear_score_memos() -> None:
    """Forget every remembered score and normal form (benchmarks of cold scoring)."""
    _score_pair.cache_clear()
    _normal_form.cache_clear()


def _f1_counts(pred: dict[str, int], pred_len: int, gold: dict[str, int], gold_len: int) -> float:
    """Token F1 from two token counts: the same value as :func:`_f1_tokens` on the token lists."""
    small, large = (pred, gold) if len(pred) <= len(gold) else (gold, pred)
    same = 0
    for token, count in small.items():
        other = large.get(token)
        if other:
            same += count if count < other else other
    if same == 0:
        return 0.0
    precision, recall = same / pred_len, same / gold_len
    return 2 * precision * recall / (precision + recall)


def score_counted(counts: dict[tuple[str, ...] | None, dict[str | None, int]]) -> tuple[int, int, int]:
    """(scored, correct, f1 sum in :func:`exact_units`) of the rows counted in ``counts`` (answers -> prediction
    -> rows); rows without a prediction or answers (None) are not scored, rows with an empty list of answers are
    misses. Each distinct pair is scored once, weighted
    by its rows."""
    scored, correct, f1_rows = 0, 0, {}
    score = _score_pair
    for golds, by_prediction in counts.items():
        if golds is None:
            continue
        for pred, count in by_prediction.items():
            if pred is None:
                continue
            hit, f1 = score(pred, golds)
            scored += count
            correct += hit * count
            f1_rows[f1] = f1_rows.get(f1, 0) + count
    return scored, correct, _units_of(f1_rows)


PENDING_ROWS = 16384  # rows add_rows/add_replies keep before scoring them (bounds memory; report() scores the rest)
_VOCAB_KEEP = 4 * PENDING_ROWS  # predictions numbered before the numbering starts again (bounds its memory)


class _Numbering(dict):
    """Predictions numbered in the order first seen: ``numbering[text]`` adds an unseen text (called per row
    through ``map`` in C; only a new text runs Python), ``texts[number]`` gives it back. Kept across
    scorings: replies repeat across batches."""

    def __init__(self) -> None:
        super().__init__()
        self.texts: list[str | None] = []

    def __missing__(self, text: str | None) -> int:
        self[text] = number = len(self.texts)
        self.texts.append(text)
        return number

    def clear(self) -> None:
        super().clear()
        self.texts.clear()


class AnswerTable:
    """Distinct answers (tuples of strings) by id: a store numbers its examples' answers once, so a batch's
    answers travel as an int array and are counted with numpy instead of hashing tuples per row."""

    def __init__(self) -> None:
        self.answers: list[tuple[str, ...]] = []
        self._ids: dict[tuple[str, ...], int] = {}

    def id(self, answers: tuple[str, ...]) -> int:
        found = self._ids.get(answers)
        if found is None:
            found = self._ids[answers] = len(self.answers)
            self.answers.append(answers)
        return found

    def ids(self, answers: Sequence[tuple[str, ...] | None]) -> np.ndarray:
        """The ids of these answers (-1 for None: a row with nothing to score)."""
        return np.fromiter((-1 if a is None else self.id(a) for a in answers), dtype=np.int64, count=len(answers))


@lru_cache(maxsize=None)  # once per process and names: every split's and task's Metrics meet the same replies
def _tell_reply_metrics(names: tuple[str, ...]) -> None:
    """Say that replies carry ParlAI's local metrics, which the report does not hold."""
    print(f"accelbatch: the model's replies carry 'metrics' ({', '.join(names) or 'not a dict'}), which "
          "accelbatch's teachers do not average into the report (ParlAI's do): report them from the agent's "
          "report(), which the world's report includes", file=sys.stderr)


@dataclass
class Metrics:
    """Sums and counts; ``report()`` turns them into ParlAI-named averages. The F1 and BLEU sums are exact
    (:func:`exact_units`), so a report is the same whenever the rows were scored (reports asked on a timer)."""

    exs: int = 0
    scored: int = 0
    correct: float = 0.0
    f1_units: int = 0
    loss_sum: float = 0.0
    loss_count: int = 0
    extra: dict[str, float] = field(default_factory=dict)
    # also score bleu-4: asked by --metrics bleu-4 or all; accelbatch's default leaves it out (its cost per
    # example), unlike ParlAI's, whose default metrics include it
    bleu: bool = False
    bleu_units: int = 0
    # rows kept to be scored: their answers' ids (chunks) in _table and their predictions, see score_pending
    _ids: list[Sequence[int]] = field(default_factory=list, repr=False, compare=False)
    _predictions: list[str | None] = field(default_factory=list, repr=False, compare=False)
    _table: AnswerTable | None = field(default=None, repr=False, compare=False)
    _vocab: _Numbering = field(default_factory=_Numbering, repr=False, compare=False)
    _f1_rows: Counter = field(default_factory=Counter, repr=False, compare=False)  # add_batch's, not yet summed
    _bleu_rows: Counter = field(default_factory=Counter, repr=False, compare=False)
    _own: AnswerTable = field(default_factory=AnswerTable, repr=False, compare=False)
    _told_reply_metrics: bool = field(default=False, repr=False, compare=False)

    def add_rows(self, predictions: Sequence[str | None], answers: Sequence[tuple[str, ...] | None],
                 examples: int) -> None:
        """Count ``examples`` examples and keep the rows to be scored (a row whose answers or prediction is
        None is not scored; empty answers are a miss). ``answers`` are tuples. Scored within
        :data:`PENDING_ROWS` rows, and before anything reads the sums."""
        self._keep(list(predictions), self._own.ids(answers), self._own, examples)

    def add_replies(self, replies: Sequence[dict], answer_ids: Sequence[int], table: AnswerTable,
                    examples: int) -> None:
        """:meth:`add_rows` for reply messages and answers by id in ``table`` (-1: nothing to score): row
        ``i``'s prediction is ``replies[i].get("text")``."""
        try:  # each reply's text, dict.get mapped in C
            texts = list(map(dict.get, replies, repeat(TEXT, len(replies))))
            # the first reply looked at (an agent adds its metrics to every reply): O(1) on the parley loop
            if not self._told_reply_metrics and replies and REPLY_METRICS in replies[0]:
                self._told_reply_metrics = True  # said once in the process
                _tell_reply_metrics(tuple(sorted({str(k) for r in replies if isinstance(r.get(REPLY_METRICS), dict)
                                                  for k in r[REPLY_METRICS]})))
        except TypeError:  # a reply that is not a dict: read it the slow way
            texts = [r.get(TEXT) for r in replies]
        self._keep(texts, answer_ids, table, examples)

    def _keep(self, predictions: list[str | None], ids: Sequence[int], table: AnswerTable, examples: int) -> None:
        if table is not self._table:
            self.score_pending()
            self._table = table
        self._predictions.extend(predictions)
        self._ids.append(ids)
        self.exs += examples
        if len(self._predictions) >= PENDING_ROWS:
            self.score_pending()

    def score_pending(self) -> None:
        """Score the rows kept: each distinct (answers, prediction) pair once, weighted by its rows."""
        if self._f1_rows or self._bleu_rows:
            self.f1_units += _units_of(self._f1_rows)
            self.bleu_units += _units_of(self._bleu_rows)
            self._f1_rows.clear()
            self._bleu_rows.clear()
        if not self._predictions:
            return
        vocab = self._vocab
        texts = np.fromiter(map(vocab.__getitem__, self._predictions), dtype=np.int64, count=len(self._predictions))
        ids = np.concatenate(self._ids).astype(np.int64, copy=False)
        base = len(vocab) + 1  # every text number is below it, however many this chunk numbered
        keys, counts = np.unique(ids * base + texts, return_counts=True)
        answers, words = self._table.answers, vocab.texts  # type: ignore[union-attr]
        pairs: dict[tuple[str, ...] | None, dict[str | None, int]] = {}
        for key, n in zip(keys.tolist(), counts.tolist()):
            answer, text = divmod(key, base)
            if answer >= 0:
                pairs.setdefault(answers[answer], {})[words[text]] = n
        self._ids.clear()
        self._predictions.clear()
        if len(vocab) > _VOCAB_KEEP:  # replies that never recur (a generator's) are not all kept
            vocab.clear()
        scored, correct, f1_units = score_counted(pairs)
        self.scored += scored
        self.correct += correct
        self.f1_units += f1_units
        if self.bleu:
            self.bleu_units += sum(exact_units(bleu4(pred, golds), n) for golds, preds in pairs.items()
                                   for pred, n in preds.items() if pred is not None)

    @property
    def f1_sum(self) -> float:
        self.score_pending()
        return from_units(self.f1_units)

    def add_batch(self, predictions: Sequence[str | None], answers: Sequence[Sequence[str]]) -> None:
        """Count ``len(predictions)`` examples and score those with a prediction and answers."""
        correct, f1s = _score_rows(predictions, answers)
        if self.bleu:
            self._bleu_rows.update([bleu4(p, a) for p, a in zip(predictions, answers)
                                    if p is not None and a is not None])
        self.exs += len(predictions)
        self.scored += len(f1s)
        self.correct += correct
        self._f1_rows.update(f1s)  # counted in C; made exact when read (few distinct values)

    def add_loss(self, loss: float, count: int = 1) -> None:
        """Record a mean loss that stands for ``count`` updates/rows."""
        self.loss_sum += float(loss) * count
        self.loss_count += count

    def add_loss_parts(self, parts: Sequence[tuple[int, int, float]], counted: Sequence[bool]) -> None:
        """Record a call's loss from its micro-batches' (first row, end row, mean loss over the rows of them
        that ``counted`` marks), as the mean over all the call's counted rows."""
        weights = [sum(counted[start:stop]) for start, stop, _ in parts]
        if sum(weights):
            self.add_loss(sum(w * loss for w, (_, _, loss) in zip(weights, parts)) / sum(weights), sum(weights))

    def add_examples(self, examples: int) -> None:
        """Count ``examples`` examples that are not scored here (an agent's rows, which its loss may leave out)."""
        self.exs += examples

    def add(self, name: str, value: float) -> None:
        self.extra[name] = self.extra.get(name, 0.0) + float(value)

    def merge(self, other: "Metrics") -> None:
        self.merge_state(other.state())

    def state(self) -> dict:
        self.score_pending()
        return {"exs": self.exs, "scored": self.scored, "correct": self.correct, "f1_units": self.f1_units,
                "loss_sum": self.loss_sum, "loss_count": self.loss_count, "extra": dict(self.extra),
                "bleu": self.bleu, "bleu_units": self.bleu_units}

    def merge_state(self, state: dict) -> None:
        self.exs += state["exs"]
        self.scored += state["scored"]
        self.correct += state["correct"]
        self.f1_units += state["f1_units"]
        self.loss_sum += state["loss_sum"]
        self.loss_count += state["loss_count"]
        self.bleu = self.bleu or bool(state.get("bleu", False))
        self.bleu_units += state.get("bleu_units", 0)
        for k, v in state["extra"].items():
            self.extra[k] = self.extra.get(k, 0.0) + v

    def clear(self) -> None:
        self._ids.clear()
        self._predictions.clear()
        self._f1_rows.clear()
        self._bleu_rows.clear()
        self.exs = self.scored = self.loss_count = self.f1_units = self.bleu_units = 0
        self.correct = self.loss_sum = 0.0
        self.extra = {}

    def report(self) -> dict[str, float]:
        self.score_pending()
        out: dict[str, float] = {"exs": self.exs}
        if self.scored:
            out["accuracy"] = self.correct / self.scored
            out["f1"] = from_units(self.f1_units) / self.scored
            if self.bleu:
                out["bleu-4"] = from_units(self.bleu_units) / self.scored
            if self.scored < self.exs:  # the averages' own count, so that reports merge exactly (report_merge)
                out[SCORED] = self.scored
        if self.loss_count:
            out["loss"] = self.loss_sum / self.loss_count
            if self.loss_count != self.exs and "token_nll" not in self.extra:  # rows left out of the loss: its
                out[LOSS_COUNT] = self.loss_count  # own count, which weighs it where reports merge (report_merge)
        out.update(self.extra)
        return token_report(out)


# sums a generator adds with Metrics.add (see accelbatch.models.generator); report() turns them into ParlAI's
# token metrics. "tokens" stays in the report: replicas' reports merge exactly with it (report_weights).
TOKEN_SUMS = ("token_nll", "token_correct", "token_batches")


def token_report(out: dict[str, float]) -> dict[str, float]:
    """Replace the token sums in ``out`` by loss (token-weighted mean NLL, over the row-weighted loss), ppl =
    exp(loss), token_acc (targets predicted exactly under teacher forcing) and ltpb (target tokens per batch,
    ParlAI's ltpb; its tpb also counts the context's tokens)."""
    if "token_nll" not in out:
        return out
    nll, correct, batches = (out.pop(key) for key in TOKEN_SUMS)
    tokens = out.get("tokens", 0.0)
    if tokens:
        out["loss"] = nll / tokens
        out["ppl"] = math.exp(out["loss"]) if out["loss"] < 700 else math.inf
        out["token_acc"] = correct / tokens
    if batches:
        out["ltpb"] = tokens / batches
    return out


# what a teacher reports (bleu-4 when --metrics asks for it), and what dynamic batching adds
TEACHER_METRICS = frozenset({"exs", "accuracy", "f1"})
BATCHING_METRICS = frozenset({"pad_fraction", "batch_tokens", "dropped_exs"})


def unknown_metrics(names: Iterable[str], tasks: Sequence[str], known: Iterable[str],
                    per_task: Iterable[str]) -> list[str]:
    """The ``names`` not in ``known``; a multitask ``TASK/metric`` is known when TASK is one of ``tasks`` and
    metric is in ``per_task`` (what a task's teacher scores: the model's own metrics cover all tasks)."""
    known, per_task = set(known), set(per_task)
    prefixes = tuple(f"{task}/" for task in tasks if len(tasks) > 1)

    def is_known(name: str) -> bool:
        if name in known:
            return True
        task = next((p for p in prefixes if name.startswith(p)), None)
        return task is not None and name[len(task):] in per_task

    return [name for name in names if not is_known(name)]
