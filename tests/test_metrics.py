from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from accelbatch.metrics import Metrics, bleu4, clear_score_memos, exact_match, f1_score, merge_reports, normalize_answer

WORDS = st.sampled_from(["the", "a", "cat", "Cat!", "sat", "sat", "on", "mat.", "an", "dog", ",", "red-hat", ""])
TEXTS = st.lists(WORDS, max_size=6).map(" ".join)


def test_normalisation_drops_case_punctuation_and_articles():
    assert normalize_answer("The  Kitchen!") == "kitchen"
    assert exact_match("the kitchen.", ["Kitchen"])


def test_f1_by_hand():
    # pred tokens: red apple pie; gold: apple pie crust -> overlap 2, p=2/3, r=2/3, f1=2/3
    assert abs(f1_score("red apple pie", ["apple pie crust"]) - 2 / 3) < 1e-12
    assert f1_score("nothing", ["apple"]) == 0.0
    assert f1_score("apple", ["pear", "apple"]) == 1.0


def test_batch_scoring_equals_per_reply_reference():
    preds = ["the garden", "hall way", None, "office", "blue sky"]
    golds = [["garden"], ["hallway"], ["kitchen"], ["bedroom", "office"], ["sky"]]
    m = Metrics()
    m.add_batch(preds, golds)
    scored = [(p, g) for p, g in zip(preds, golds) if p is not None]
    acc = sum(exact_match(p, g) for p, g in scored) / len(scored)
    f1 = sum(f1_score(p, g) for p, g in scored) / len(scored)
    rep = m.report()
    assert rep["exs"] == 5 and abs(rep["accuracy"] - acc) < 1e-12 and abs(rep["f1"] - f1) < 1e-12


def test_metrics_merge_by_addition():
    a, b, both = Metrics(), Metrics(), Metrics()
    a.add_batch(["x"], [["x"]])
    a.add_loss(2.0)
    b.add_batch(["y", "z"], [["x"], ["z"]])
    b.add_loss(4.0, 3)
    both.add_batch(["x", "y", "z"], [["x"], ["x"], ["z"]])
    both.add_loss(2.0)
    both.add_loss(4.0, 3)
    a.merge(b)
    assert a.report() == both.report()
    assert a.report()["loss"] == (2.0 + 12.0) / 4


def test_multitask_report_is_macro_average():
    rep = merge_reports([("t1", {"exs": 10, "accuracy": 1.0}), ("t2", {"exs": 30, "accuracy": 0.5})])
    assert rep["exs"] == 40 and rep["accuracy"] == 0.75 and rep["t2/accuracy"] == 0.5


def test_multitask_report_sums_counts_as_parlai_does():
    """ParlAI's aggregate_named_reports sums counts (SumMetric: exs and the like) over the tasks and
    macro-averages averages; each task's own values stay under its prefix."""
    rep = merge_reports([("t1", {"exs": 10, "accuracy": 1.0, "dropped_exs": 3, "rows_replied": 10.0}),
                         ("t2", {"exs": 30, "accuracy": 0.5, "dropped_exs": 5, "rows_replied": 30.0})])
    assert (rep["exs"], rep["dropped_exs"], rep["rows_replied"], rep["accuracy"]) == (40, 8, 40.0, 0.75)
    assert (rep["t1/dropped_exs"], rep["t2/rows_replied"]) == (3, 30.0)


class _Replicas:
    """A backend of 2 replicas for accelbatch.report_merge.reduce_report: ``reduce_metrics`` records this replica's
    sums, or adds them to the other replica's recorded ones."""

    world_size = 2

    def __init__(self, other=None):
        self.other, self.sent = other, None

    def reduce_metrics(self, sums):
        self.sent = dict(sums)
        if self.other is None:
            return self.sent
        return {k: sums.get(k, 0.0) + self.other.get(k, 0.0) for k in {*sums, *self.other}}


def _reduced(first, second):
    from accelbatch.report_merge import reduce_report

    recorder = _Replicas()
    reduce_report(second, recorder)
    return reduce_report(first, _Replicas(recorder.sent))


def test_replica_reports_merge_into_the_report_of_all_their_examples():
    """By hand: counts (exs, Metrics.add's rows_replied, dropped_exs, batch_tokens, tokens) summed; averages
    weighted by examples, token metrics by tokens (ltpb by batches), pad_fraction by tokens fed; a multitask
    report's per-task averages by the task's examples, its top-level averages the mean over the tasks; the
    shared skipped_updates (every replica skips the same update) kept once."""
    first = {"exs": 60, "rows_replied": 60.0, "skipped_updates": 1.0, "accuracy": 0.5, "bleu-4": 0.2,
             "dropped_exs": 2, "batch_tokens": 40, "pad_fraction": 0.25,
             "tokens": 30.0, "loss": 2.0, "ppl": math.exp(2.0), "token_acc": 0.5, "ltpb": 15.0,
             "t1/exs": 50, "t2/exs": 10, "t1/f1": 0.6, "t2/f1": 0.0, "f1": 0.3}
    second = {"exs": 40, "rows_replied": 40.0, "skipped_updates": 1.0, "accuracy": 0.25, "bleu-4": 0.7,
              "dropped_exs": 3, "batch_tokens": 20, "pad_fraction": 0.5,
              "tokens": 10.0, "loss": 1.0, "ppl": math.exp(1.0), "token_acc": 0.1, "ltpb": 10.0,
              "t1/exs": 10, "t2/exs": 30, "t1/f1": 0.0, "t2/f1": 0.5, "f1": 0.25}
    from accelbatch.metrics import SHARED_COUNTS, combine_reports

    merged, gathered = _reduced(first, second), combine_reports(first, second, shared=SHARED_COUNTS)
    expected = {"exs": 100, "rows_replied": 100.0, "skipped_updates": 1.0, "accuracy": 0.4, "bleu-4": 0.4,
                "dropped_exs": 5, "batch_tokens": 60, "pad_fraction": 20 / 60,
                "tokens": 40.0, "loss": 70 / 40, "ppl": math.exp(70 / 40), "token_acc": 16 / 40, "ltpb": 40 / 3,
                "t1/exs": 60, "t2/exs": 40, "t1/f1": 30 / 60, "t2/f1": 15 / 40, "f1": (30 / 60 + 15 / 40) / 2}
    assert set(merged) == set(gathered) == set(expected)
    for key, value in expected.items():
        assert merged[key] == pytest.approx(value, rel=1e-12) == gathered[key], key


def test_replica_reports_merge_as_the_metrics_of_all_their_examples():
    """Two replicas' Metrics (scores, loss, token sums, a Metrics.add count) merged through their reports
    equal one Metrics that saw every row (the single process's report)."""
    first, second = _metrics(7, 1), _metrics(13, 2)
    for m in (first, second):
        m.extra.pop("skipped_updates")  # not a per-replica count (see the test above)
        m.add("rows_replied", m.exs)
    whole = Metrics()
    whole.merge(first)
    whole.merge(second)
    merged = _reduced(first.report(), second.report())
    assert set(merged) == set(whole.report()) and merged["rows_replied"] == 20.0
    for key, value in whole.report().items():
        assert merged[key] == pytest.approx(value, rel=1e-12), key


def test_hogwild_reports_without_metrics_sum_counts():
    """Hogwild processes of an agent that keeps no Metrics (a report only): their counts are summed, their
    averages weighted by examples; each process skips its own updates, so skipped_updates is summed too."""
    from accelbatch.hogwild import merge_metric_states

    def state(exs, acc, rows, skipped):
        report = {"exs": exs, "accuracy": acc, "rows_replied": rows, "skipped_updates": skipped}
        return {"tasks": [(None, ("report", {"exs": exs}))], "model": ("report", report), "model_keeps_exs": True}

    merged = merge_metric_states([state(30, 1.0, 30.0, 1), state(10, 0.0, 10.0, 2)])
    assert (merged["exs"], merged["rows_replied"], merged["skipped_updates"]) == (40, 40.0, 3)
    assert merged["accuracy"] == 0.75


@settings(max_examples=200, deadline=None)
@given(preds=st.lists(TEXTS, min_size=1, max_size=8), golds=st.lists(st.lists(TEXTS, min_size=1, max_size=3),
                                                                      min_size=1, max_size=8))
def test_batch_scores_equal_the_reference_functions_exactly(preds, golds):
    """add_batch (remembered normal forms, counts-based F1) == exact_match / f1_score, bit for bit."""
    clear_score_memos()
    rows = list(zip(preds, golds))
    m = Metrics()
    m.add_batch([p for p, _ in rows], [g for _, g in rows])
    correct = sum(exact_match(p, g) for p, g in rows)
    f1_sum = math.fsum(f1_score(p, g) for p, g in rows)  # the exact sum, rounded once
    assert (m.scored, m.correct, m.f1_sum) == (len(rows), correct, f1_sum)


WORDS = st.lists(st.sampled_from("bcdefghij"), min_size=1, max_size=7).map(" ".join)  # F1s such as 6/11


@settings(max_examples=100, deadline=None)
@given(rows=st.lists(st.tuples(WORDS, WORDS), min_size=2, max_size=60),
       cuts=st.lists(st.integers(min_value=1, max_value=59), max_size=8))
def test_a_report_does_not_depend_on_when_rows_were_scored(rows, cuts):
    """Rows scored in one go, or in chunks with reports asked between them (a timer's logging), give the same
    F1 and BLEU to the last bit, equal to the exactly rounded sums of the rows' scores."""
    preds, golds = [p for p, _ in rows], [(g,) for _, g in rows]
    whole, chunked = Metrics(bleu=True), Metrics(bleu=True)
    whole.add_rows(preds, golds, len(rows))
    bounds = [0, *sorted({c for c in cuts if c < len(rows)}), len(rows)]
    for start, stop in zip(bounds[:-1], bounds[1:]):
        chunked.add_rows(preds[start:stop], golds[start:stop], stop - start)
        chunked.report()
    assert chunked.report() == whole.report()
    assert whole.report()["f1"] == math.fsum(f1_score(p, g) for p, g in zip(preds, golds)) / len(rows)
    assert whole.report()["bleu-4"] == math.fsum(bleu4(p, g) for p, g in zip(preds, golds)) / len(rows)


def _metrics(rows, seed):
    """Metrics of ``rows`` rows: scored replies, a row-weighted loss, generator token sums, a count."""
    import random

    rng = random.Random(seed)
    m = Metrics()
    m.add_rows([rng.choice("ab") for _ in range(rows)], [("a",)] * rows, rows)
    m.add_loss(rng.random(), rows)
    tokens = rng.randint(rows, 5 * rows)
    m.add("tokens", tokens)
    m.add("token_nll", rng.random() * tokens)
    m.add("token_correct", rng.randint(0, tokens))
    m.add("token_batches", 2)
    m.add("skipped_updates", rng.randint(0, 3))
    return m


def test_combined_reports_equal_the_report_of_all_the_examples():
    """Two runs one after the other (a resume), and a cumulative report minus an earlier one (a log
    window), give what the sums of all the examples give."""
    from accelbatch.metrics import combine_reports

    first, second = _metrics(7, 1), _metrics(13, 2)
    whole = Metrics()
    whole.merge(first)
    whole.merge(second)
    expected = whole.report()
    combined = combine_reports(first.report(), second.report())
    window = combine_reports(expected, first.report(), sign=-1)
    assert set(combined) == set(expected)
    for key, value in expected.items():
        assert combined[key] == pytest.approx(value, rel=1e-12), key
    for key, value in second.report().items():
        assert window[key] == pytest.approx(value, rel=1e-9), key


def test_bleu4_by_hand():
    from accelbatch.metrics import bleu4

    assert bleu4("The cat sat on the mat", ["the cat sat on the mat"]) == pytest.approx(1.0)
    # normalised: 5 words against 4; precisions 4/5, 3/4, 2/3, 1/2; longer than the answer: no penalty
    assert bleu4("the cat sat on the mat today", ["a cat sat on mat"]) == pytest.approx(0.2 ** 0.25)
    # one word: no n-gram of order 2-4 matches (epsilon each), brevity penalty exp(1 - 4/1)
    assert bleu4("cat", ["cat sat on mat"]) == pytest.approx(math.exp(-3) * 1e-12 ** 0.75, rel=1e-9)
    assert bleu4("dog", ["cat sat on mat"]) == 0.0
    # clipped by the most any answer has (2 of 4 unigrams, 1 of 3 bigrams); no 3- or 4-gram; the answer
    # closest in length (1 word) sets the penalty: none for 2 words
    assert bleu4("cat cat", ["cat", "cat cat cat cat"]) == pytest.approx(1e-12 ** 0.5, rel=1e-9)
    # words split on single spaces, as ParlAI hands them to nltk: an answer that normalises to nothing ("The.")
    # is one empty word, so it ties at distance 4 with the 9-word answer and, the shorter, sets no penalty
    # (nltk 3.10.3: 1.0; split on any space, it had no length and the penalty was exp(1 - 9/5), 0.449)
    assert bleu4("red cat sat on mat", ["red cat sat on mat big dog runs fast", "The."]) == pytest.approx(1.0)
    assert bleu4("", ["the"]) == pytest.approx(1e-12 ** 0.75, rel=1e-9)  # empty matches empty (nltk: 1e-9)
    assert bleu4("", ["cat"]) == 0.0 and bleu4("cat", ["..."]) == 0.0


def test_bleu4_is_reported_when_asked_and_merges_like_the_other_averages():
    from accelbatch.metrics import bleu4

    preds, answers = ["cat sat on mat today", "dog", "cat sat"], [("cat sat on mat",), ("dog",), ("cat",)]
    first, second = Metrics(bleu=True), Metrics(bleu=True)
    first.add_rows(preds[:2], answers[:2], 2)
    second.add_rows(preds[2:], answers[2:], 1)
    merged = Metrics()
    merged.merge_state(first.state())
    merged.merge_state(second.state())
    expected = sum(bleu4(p, a) for p, a in zip(preds, answers)) / 3
    assert merged.report()["bleu-4"] == pytest.approx(expected)
    plain = Metrics()
    plain.add_rows(preds, answers, 3)
    assert "bleu-4" not in plain.report()


def test_metrics_all_reports_bleu4_of_the_replies(write_jsonl, tmp_path):
    """repeat_label replies with the answer: bleu-4 1.0 for every row of four or more words."""
    import json

    from accelbatch.cli import main

    rows = [{"text": f"q {i}", "labels": [f"answer number {i} is here"], "episode_done": True} for i in range(9)]
    path, report = write_jsonl(rows), tmp_path / "r.json"
    assert main(["eval", "-t", f"jsonl:{path}", "-m", "repeat_label", "--no-progress", "--metrics", "all",
                 "--report-json", str(report)]) == 0
    assert json.loads(report.read_text())["valid"]["bleu-4"] == pytest.approx(1.0)
    assert main(["eval", "-t", f"jsonl:{path}", "-m", "repeat_label", "--no-progress", "--report-json",
                 str(report)]) == 0
    assert "bleu-4" not in json.loads(report.read_text())["valid"]


class _Reply:
    """A reply that is not a dict but reads like one (what a user's agent may return)."""

    def __init__(self, text):
        self.text = text

    def get(self, key, default=None):
        return self.text if key == "text" else default


def test_add_replies_equals_add_batch_with_replies_that_are_not_dicts():
    """A non-dict reply after dict ones: every row's prediction is read once, in order, none twice."""
    from accelbatch.metrics import AnswerTable

    table = AnswerTable()
    golds = [("garden",), ("hallway",), ("kitchen",), ("sky",)]
    ids = [table.id(g) for g in golds]
    replies = [{"text": "the garden"}, _Reply("hall way"), {"id": "x"}, _Reply("sky")]
    m = Metrics()
    m.add_replies(replies[:2], ids[:2], table, 2)
    m.add_replies(replies[2:], ids[2:], table, 2)
    want = Metrics()
    want.add_batch(["the garden", "hall way", None, "sky"], [list(g) for g in golds])
    assert m.report() == want.report() and m.report()["exs"] == 4


def test_punctuation_separates_words_as_in_parlai():
    """ParlAI's normalize_answer turns punctuation into spaces (it does not delete it): 'hello,world' is two
    words, and "don't" is 'don t'."""
    assert normalize_answer("Hello,world! The end.") == "hello world end"
    assert f1_score("hello,world", ["hello world"]) == 1.0
    assert exact_match("hello-world", ["hello world"])
    assert f1_score("don't go", ["don t go"]) == 1.0
    assert f1_score("a,b", ["ab"]) == 0.0  # 'a' is an article: 'b' against 'ab'


@pytest.mark.slow
def test_a_chunk_of_over_a_million_distinct_predictions_is_scored_exactly():
    """One call's rows hold 2**20 + 5 distinct wrong predictions and one right one: the (answer, prediction)
    counting keyed them in a space of 2**20 predictions, and failed (IndexError) past it."""
    wrong = (1 << 20) + 5
    metrics = Metrics()
    metrics.add_rows([f"p{i}" for i in range(wrong)] + ["y"], [("x",)] * wrong + [("y",)], wrong + 1)
    report = metrics.report()
    assert report["exs"] == wrong + 1 and report["accuracy"] == 1 / (wrong + 1)
