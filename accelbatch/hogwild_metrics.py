"""Hogwild's metrics: each process's metric sums (:func:`metric_states`, sent to the main process) and their
merge there into the report one process would give (:func:`merge_metric_states`)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from accelbatch.loader_world import LoaderWorld
from accelbatch.metrics import Metrics
from accelbatch.multi_world import MultiWorld
from accelbatch.report_merge import LOSS_COUNT, combine_reports, drop_full_scored, merge_reports, with_loss_count
from accelbatch.teachers import MultiTaskTeacher
from accelbatch.worlds import BatchWorld, World

__all__ = ["merge_metric_states", "metric_states"]


def _part(obj: Any) -> tuple[str, Any]:
    """An agent's metric sums, with the numbers its report() adds beside them (a subclass's own, summed as
    Metrics.add's are); or, without Metrics, its report's numbers (what merges; others fail the pipe)."""
    numbers = {k: v for k, v in obj.report().items() if isinstance(v, (int, float))}
    metrics = getattr(obj, "metrics", None)
    if not isinstance(metrics, Metrics):
        return "report", numbers
    state, own = metrics.state(), metrics.report()
    state["extra"].update((k, v) for k, v in numbers.items() if k not in own and k != LOSS_COUNT)
    return "metrics", state


def metric_states(world: World) -> dict[str, Any]:
    """What :meth:`HogwildWorld.report` needs of one process: each task's and the model's metric sums."""
    base = world.world if isinstance(world, BatchWorld) else world
    if isinstance(base, MultiWorld):
        tasks = [(name, ("report", w.task_report())) for name, w in zip(base.names, base.worlds)]
    else:
        teacher = base.get_task_agent()
        tasks = [(name, ("metrics", m.state())) for name, m in zip(teacher.names, teacher.task_metrics)] \
            if isinstance(teacher, MultiTaskTeacher) else [(None, _part(teacher))]
    model = base.get_model_agent()
    # the batch plan's counts (examples left out; with dynamic batching the padding and the tokens fed)
    batching = base.batching_report() if isinstance(base, LoaderWorld) else {}
    return {"tasks": tasks, "model": _part(model), "model_keeps_exs": not hasattr(model, "slot"),
            "batching": batching}


def _merge(parts: Sequence[tuple[str, Any]]) -> dict[str, float]:
    """One agent's metrics from every process: sums merged; reports (no Metrics) merged as reports of their
    own examples (counts summed, averages weighted: each process applies its own updates)."""
    if all(kind == "metrics" for kind, _ in parts):
        total = Metrics()
        for _, state in parts:
            total.merge_state(state)
        return total.report()
    return combine_reports(*(rep if kind == "report" else Metrics(**{k: v for k, v in rep.items() if k != "extra"},
                                                                 extra=rep["extra"]).report() for kind, rep in parts))


def merge_metric_states(states: Sequence[dict[str, Any]]) -> dict[str, float]:
    """One report from every process's :func:`metric_states`, keyed as World.report keys it."""
    names = [name for name, _ in states[0]["tasks"]]
    tasks = [(name, _merge([s["tasks"][i][1] for s in states])) for i, name in enumerate(names)]
    report = dict(tasks[0][1]) if names == [None] else merge_reports(tasks)
    model = with_loss_count(_merge([s["model"] for s in states]))
    if not states[0]["model_keeps_exs"]:
        model.pop("exs", None)  # TorchAgent.report leaves examples to the teacher
    report.update((name, value) for name, value in model.items() if name not in report)  # the teacher's first
    # counts summed, pad_fraction weighted by each process's batch_tokens
    report.update(combine_reports(*(s.get("batching", {}) for s in states)))
    return drop_full_scored(report)
