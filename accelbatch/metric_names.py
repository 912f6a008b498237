"""Metric names against a run: ``-vmt`` and ``--metrics`` checked before the run (when every metric comes from
accelbatch's own pieces, each saying which it adds), and the report cut to what ``--metrics`` lists."""

from __future__ import annotations

import dataclasses
import sys
from typing import Any

from accelbatch.agents import Agent
from accelbatch.metrics import BATCHING_METRICS, TEACHER_METRICS, unknown_metrics, wants_bleu
from accelbatch.multi_world import MultiWorld
from accelbatch.opts import Opts
from accelbatch.teachers import Teacher, is_training, task_names
from accelbatch.unused_options import reads_validation_metric
from accelbatch.worlds import World

TEXT_METRICS = frozenset({"accuracy", "f1", "bleu-4"})  # scored on reply text: none without generation
VMT_DEFAULT = next(f.default for f in dataclasses.fields(Opts) if f.name == "validation_metric")
# what a split's report says about the run itself rather than the model: kept whatever --metrics lists
RUN_FIELDS = ("exs", "steps", "epochs", "exs_per_s", "time_s", "stopped_by")


def select_metrics(report: dict[str, Any], metrics: str) -> dict[str, Any]:
    """The report with each split's metrics cut to the comma-separated ``metrics`` ('default' and 'all':
    every one); a listed metric no split has is said once on stderr."""
    wanted = {m.strip() for m in metrics.split(",") if m.strip()}
    if wanted & {"default", "all"}:
        return report
    splits = {name: rep for name, rep in report.items() if isinstance(rep, dict) and "exs" in rep}
    missing = sorted(wanted - {k for rep in splits.values() for k in rep})
    if missing:
        print(f"accelbatch: --metrics: no split reported {', '.join(missing)}", file=sys.stderr)
    keep = wanted | set(RUN_FIELDS)  # a multitask report's TASK/metric too: each task's row
    return {name: {k: v for k, v in rep.items() if k in keep or k.rpartition("/")[2] in keep}
            if name in splits else rep for name, rep in report.items()}


def _agents(world: World) -> list[Agent]:
    """Every agent of ``world``: through the worlds that wrap another, and each task of a multitask world."""
    inner = getattr(world, "world", None)
    if isinstance(inner, World):
        return _agents(inner)
    if isinstance(world, MultiWorld):
        return [agent for w in world.worlds for agent in _agents(w)]
    return list(world.get_agents())


def _vmt_problem(world: World, opts: Opts, known: set[str], mute: bool) -> str:
    """The line refusing ``-vmt`` (a name the valid report of this run will not have), with what to give."""
    vmt = opts.validation_metric
    choose = ", ".join(m for m in ("accuracy", "f1", "loss", "ppl", "token_acc") if m in known)
    name = type(world.get_model_agent()).__name__
    if mute and vmt.rpartition("/")[2] in TEXT_METRICS:
        default = " (the default when -vmt is not given)" if vmt == VMT_DEFAULT else ""
        return (f"-vmt/--validation-metric {vmt}{default}: with --skip-generation {name} generates no text, so "
                f"the valid report has no accuracy, f1 or bleu-4; give -vmt loss (or one of {choose}), or "
                "leave --skip-generation out")
    hint = "; bleu-4 is scored with --metrics bleu-4 (or all)" if vmt.endswith("bleu-4") else \
        "; a task's row (TASK/name) has what its teacher scores (exs, accuracy, f1), the model's own metrics " \
        "(such as loss) only the whole report's" if "/" in vmt else ""
    return (f"-vmt/--validation-metric {vmt}: the valid report of {name} on this task has no such "
            f"metric; choose one of {choose}{hint}")


def metric_names_problem(world: World, opts: Opts) -> str | None:
    """What is wrong with the metric names of ``-vmt`` (training) and ``--metrics``, found before the run
    starts when accelbatch's own teachers and agents make every metric (each agent says which it adds);
    None when nothing is, or when a user's agent or teacher may report any name (``-vmt`` is then checked
    at the first validation, against what it reported)."""
    agents = _agents(world)
    models = [agent for agent in agents if not isinstance(agent, Teacher)]
    if not all(type(agent).__module__.partition(".")[0] == "accelbatch" for agent in agents) or \
            any(agent.reported_metrics is None for agent in models):
        return None
    # a teacher's reported_metrics: what it scores (None: TEACHER_METRICS, as accelbatch's teachers score)
    known = set(BATCHING_METRICS).union(*(TEACHER_METRICS if agent.reported_metrics is None
                                          else agent.reported_metrics for agent in agents))
    teachers = set().union(*(TEACHER_METRICS if agent.reported_metrics is None else agent.reported_metrics
                             for agent in agents if isinstance(agent, Teacher)))  # a task's own row
    if wants_bleu(opts.metrics):
        known.add("bleu-4")
        teachers.add("bleu-4")
    tasks = task_names(opts)
    vmt = opts.validation_metric
    validates = opts.validation_every_n_epochs > 0 or opts.validation_every_n_secs > 0
    mute = not all(agent.replies_text for agent in models)  # nothing scores accuracy, f1 or bleu-4
    valid_known = known - TEXT_METRICS if mute else known
    # without a validation only a name no task could score is refused (the default accuracy of a regression is
    # not); a run that does not read -vmt says so (unused_options) and refuses nothing
    if is_training(opts.datatype) and reads_validation_metric(opts) and \
            unknown_metrics([vmt], tasks, valid_known if validates else known | TEACHER_METRICS,
                            (teachers - TEXT_METRICS if mute else teachers) if validates else
                            teachers | TEACHER_METRICS):
        return _vmt_problem(world, opts, valid_known, mute)
    asked = [m.strip() for m in opts.metrics.split(",") if m.strip() and m.strip() not in ("default", "all")]
    unsaid = TEXT_METRICS if mute else frozenset()  # no text generated: none of the metrics scored on it
    unknown = unknown_metrics(asked, tasks, (known | {"bleu-4"}) - unsaid | set(RUN_FIELDS),
                              (teachers | {"bleu-4"}) - unsaid)
    if unknown:
        why = " (with --skip-generation no text is generated, so no accuracy, f1 or bleu-4)" if mute else ""
        return (f"--metrics: no report of this run has {', '.join(unknown)}{why}; name metrics such as "
                f"{'loss,ppl' if mute else 'accuracy,f1,loss'}, or give 'default' or 'all'")
    return None


def unvalidated_metric_note(opts: Opts, valid: dict[str, Any] | None) -> str | None:
    """The note for a chosen ``-vmt`` that the final valid report lacks, in a training run that validated
    nothing before (a user's agent has its ``-vmt`` checked at validations: this run had none)."""
    vmt = opts.validation_metric
    if valid is None or vmt == VMT_DEFAULT or vmt in valid:
        return None
    known = ", ".join(k for k, v in valid.items() if isinstance(v, (int, float)) and k not in RUN_FIELDS)
    return (f"accelbatch: -vmt/--validation-metric {vmt}: the final valid report has no such metric (it has "
            f"{known}); no validation ran during training to choose a model by it")
