"""Reports merged exactly: of other examples (processes, runs one after the other), of a window of training
(a cumulative report less an earlier one), of the tasks of a multitask run.

A report holds averages, so each is merged weighted by what it averages over: accuracy, f1 and bleu-4 by the
rows scored (``scored_exs``, said in a report only where some examples were not scored: a reply without text,
as ParlAI's teacher leaves such a row out of its averages; otherwise ``exs``), a row-weighted loss by the rows it
counts (``loss_exs``, said only where they are not the ``exs``: a ranker leaves out a row whose label is not
among its candidates), token metrics by tokens (ltpb by batches), pad_fraction by tokens fed; counts are summed
and stay whole numbers.
"""

from __future__ import annotations

import math
from typing import Any, Iterable

# Report keys that are averages (a multitask report also has them prefixed with the task's name,
# "babi:1/accuracy"); every other key is a count: exs, tokens, batch_tokens, dropped_exs, Metrics.add's sums.
AVERAGED_METRICS = frozenset({"accuracy", "f1", "loss", "ppl", "token_acc", "ltpb", "bleu-4", "pad_fraction"})
SCORED_METRICS = frozenset({"accuracy", "f1", "bleu-4"})  # averages over the rows scored
SCORED = "scored_exs"
LOSS_COUNT = "loss_exs"  # the rows a row-weighted loss (no "tokens" beside it) averages over
TOKEN_WEIGHTED = frozenset({"loss", "token_acc", "ltpb"})  # weighted by tokens (ltpb: batches) with token metrics
# counts every replica holds alike (each applies, or skips, the same shared update): merged once, not summed
SHARED_COUNTS = frozenset({"skipped_updates"})


def _scopes(report: dict[str, Any]) -> list[str]:
    """The prefixes of the report's rows: "" and each task's "TASK/" (a multitask report)."""
    return [""] + [key[:-len("exs")] for key in report if key.endswith("/exs")]


def _row_loss(report: dict[str, Any], scope: str) -> bool:
    """Whether the row ``scope`` of ``report`` has a loss averaged over rows (not over tokens)."""
    return scope + "loss" in report and scope + "tokens" not in report


def _averaged(report: dict[str, Any], scope: str, count: str) -> bool:
    """Whether the row ``scope`` of ``report`` has an average that ``count`` (scored_exs, loss_exs) weighs."""
    return _row_loss(report, scope) if count == LOSS_COUNT else any(scope + name in report for name in SCORED_METRICS)


def with_scored(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` with each row's ``scored_exs`` and ``loss_exs`` said: its exs where it has the average they
    weigh but not the count."""
    out = dict(report)
    for scope in _scopes(report):
        for count in (SCORED, LOSS_COUNT):
            if scope + count not in out and _averaged(out, scope, count):
                out[scope + count] = out.get(scope + "exs", 1)
    return out


def with_loss_count(model_report: dict[str, Any]) -> dict[str, Any]:
    """A model agent's report with the rows its row-weighted loss averages over said (``loss_exs``, which a
    report leaves out where it is its own ``exs``): the teacher's ``exs``, which a world reports in place of the
    model's, also counts rows the model never trained or scored (context turns), and reports merge by it."""
    if "loss" in model_report and "tokens" not in model_report and LOSS_COUNT not in model_report \
            and "exs" in model_report:
        return {**model_report, LOSS_COUNT: model_report["exs"]}
    return model_report


def drop_full_scored(report: dict[str, Any]) -> dict[str, Any]:
    """``report`` without the ``scored_exs`` and ``loss_exs`` that say nothing: every example counted, or none
    (no average)."""
    for scope in _scopes(report):
        for count in (SCORED, LOSS_COUNT):
            rows = report.get(scope + count)
            if rows is not None and (rows == report.get(scope + "exs") or not rows
                                     or not _averaged(report, scope, count)):
                del report[scope + count]
    return report


def report_weights(report: dict[str, float], shared: frozenset[str] = SHARED_COUNTS) -> dict[str, float | None]:
    """How to merge ``report`` exactly with reports of other examples: key -> weight of its average, or None for
    a count, summed (a ``shared`` count, the same in every replica's report, weighs 1: it is kept once); ppl is
    exp of the merged loss (:func:`finish_merged`)."""
    weights = {key: _weight(report, key, shared) for key in report}
    if "tokens" in report:
        weights.pop("ppl", None)
    return weights


def _weight(report: dict[str, float], key: str, shared: frozenset[str]) -> float | None:
    task, _, name = key.rpartition("/")
    if name in shared or name not in AVERAGED_METRICS:
        return 1.0 if name in shared else None
    scope = f"{task}/" if task and f"{task}/exs" in report else ""
    exs = float(report.get(scope + "exs", 1))  # a report that does not say counts as one example
    if name in SCORED_METRICS:
        return float(report.get(scope + SCORED, exs))
    if name == "pad_fraction":
        return float(report.get(scope + "batch_tokens", exs))
    tokens = report.get(scope + "tokens")
    per_batch = report.get(scope + "ltpb") if name == "ltpb" else 1.0
    if tokens is not None and name in TOKEN_WEIGHTED and per_batch:
        return float(tokens) / per_batch
    return float(report.get(scope + LOSS_COUNT, exs)) if name == "loss" else exs


_WEIGHT = "\0weight"  # the suffix of an average's weight among the sums (no report key holds a NUL)


def to_sums(report: dict[str, Any], shared: frozenset[str] = SHARED_COUNTS, sign: int = 1) -> dict[str, Any]:
    """``report`` as sums that add key by key across reports (``sign`` -1: to take away): a count as it is, an
    average times its weight, and the weight. :func:`from_sums` turns a sum of these back into a report."""
    report = with_scored(report)
    sums: dict[str, Any] = {}
    for key, weight in report_weights(report, shared).items():
        value = report[key]
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            total = value if weight is None else value * weight
            if key.rpartition("/")[2] == "accuracy" and abs(total - round(total)) < 1e-6:
                total = round(total)  # the count of exact matches: whole, so a window taken away stays exact
            sums[key] = sign * total
            if weight is not None:
                sums[key + _WEIGHT] = sign * weight
    return sums


def from_sums(total: dict[str, Any]) -> dict[str, Any]:
    """The report of summed :func:`to_sums`: averages with a weight left, counts, then :func:`finish_merged`."""
    merged = {}
    for key, value in total.items():
        weight = total.get(key + _WEIGHT)
        if not key.endswith(_WEIGHT) and (weight is None or weight > 0):
            merged[key] = value if weight is None else value / weight
    return finish_merged(drop_full_scored(merged))


def finish_merged(merged: dict[str, float]) -> dict[str, float]:
    """What a merged report derives: ppl, exp of its merged token loss; a multitask report's averages, the mean of
    its tasks' merged ones (as :func:`merge_reports` makes them)."""
    tasks = [key[:-len("/exs")] for key in merged if key.endswith("/exs")]
    for key in AVERAGED_METRICS & set(merged) if tasks else ():
        values = [merged[f"{task}/{key}"] for task in tasks if f"{task}/{key}" in merged]
        if values:
            merged[key] = math.fsum(values) / len(values)
    if "tokens" in merged and "loss" in merged:
        merged["ppl"] = math.exp(merged["loss"]) if merged["loss"] < 700 else math.inf
    return merged


def merge_reports(reports: Iterable[tuple[str, dict[str, float]]]) -> dict[str, float]:
    """Per-task reports (multitask) merged as ParlAI merges them: each task's keys kept prefixed with its name,
    averages macro-averaged (the mean of the tasks'), counts (exs, Metrics.add's sums) summed."""
    merged: dict[str, float] = {"exs": 0}
    averages: dict[str, list[float]] = {}
    for name, rep in reports:
        for key, value in rep.items():
            merged[f"{name}/{key}"] = value
            if key in AVERAGED_METRICS:
                averages.setdefault(key, []).append(value)
            elif key not in (SCORED, LOSS_COUNT):  # the macro averages do not weigh by them
                merged[key] = merged.get(key, 0) + value
    for key, values in averages.items():
        merged[key] = math.fsum(values) / len(values)
    return merged


def combine_reports(*reports: dict[str, float], sign: int = 1,
                    shared: frozenset[str] = frozenset()) -> dict[str, float]:
    """The report of the examples of all ``reports``, each of its own examples (runs one after the other,
    processes; ``sign=-1``: of the first, cumulative, report's examples less the others'): counts summed, averages
    weighted as :func:`report_weights` says, then :func:`finish_merged`. ``shared`` counts are alike in each."""
    total: dict[str, Any] = {}
    for index, rep in enumerate(reports):
        for key, value in to_sums(rep, shared, sign if index else 1).items():
            total[key] = total.get(key, 0) + value
    return from_sums(total)


def renamed_tasks(report: dict[str, Any], names: dict[str, str]) -> dict[str, Any]:
    """``report`` with each task's rows (``TASK/metric``) named by ``names`` (``TASK`` -> new name), others kept:
    a checkpoint keeps them under the tasks' portable names, and a resume reads them under its own."""
    out = {}
    for key, value in report.items():
        task, sep, metric = key.rpartition("/")  # a metric name has no "/"; a task's path may
        out[f"{names.get(task, task)}/{metric}" if sep else key] = value
    return out


def reduce_report(report: dict[str, float], backend: Any) -> dict[str, float]:
    """Merge one replica's report with the others' (each average weighted by what it averages over, counts
    summed, see :func:`to_sums`); identity alone."""
    if backend is None or backend.world_size == 1:
        return report
    return from_sums(backend.reduce_metrics(to_sums(report)))
