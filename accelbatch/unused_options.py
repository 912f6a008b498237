"""Options given on the command line that this run's other options leave unread: one note each, so a user
who tunes ``--num-buckets`` without ``--dynamic-batching buckets`` learns that nothing changed. A note, not a
refusal: scripts keep one set of options and switch a strategy on and off."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import Callable, Collection

from accelbatch.ipu_opts import IPU_ONLY
from accelbatch.opts import Opts


@dataclass(frozen=True)
class Reader:
    """When an option is read (``reads(opts)``), and what reads it, in words."""

    reads: Callable[[Opts], bool]
    what: str


def _periodic_validation(opts: Opts) -> bool:
    return opts.validation_every_n_epochs > 0 or opts.validation_every_n_secs > 0


def _replicated(opts: Opts) -> bool:
    return opts.replication_factor > 1 or int(os.environ.get("WORLD_SIZE", "1") or 1) > 1


def _loads_elsewhere(opts: Opts) -> bool:
    return opts.num_workers > 0 or opts.dataloader_mode != "sync"


def _task_kinds(opts: Opts) -> set[str]:
    """What each task of -t is, by the name before its first ':' (babi, jsonl, torch, pkg.mod for a class)."""
    return {part.strip().partition(":")[0] for part in opts.task.split(",")}


def _agent_class(opts: Opts) -> type | None:
    """The class -m names; None when it does not resolve to a class (refused later, saying why) or is a factory."""
    from accelbatch.names import resolve_agent_class

    try:
        found = resolve_agent_class(opts.model)
    except Exception:  # noqa: BLE001 - an -m that does not resolve is refused later, saying why
        return None
    return found if isinstance(found, type) else None


def _theirs(opts: Opts) -> bool:
    """Whether -m may read any option: an agent from outside accelbatch (or one that does not resolve)."""
    found = _agent_class(opts)
    return found is None or not found.__module__.startswith("accelbatch.")


def _generates(opts: Opts) -> bool:
    """Whether -m may read the generation options: a generator, or an agent from outside accelbatch."""
    from accelbatch.models.generator import GeneratorAgent

    found = _agent_class(opts)
    return _theirs(opts) or found is not None and issubclass(found, GeneratorAgent)


def _decodes(opts: Opts) -> bool:
    """Whether -m may generate replies (read the decoding options): a generator without --skip-generation,
    whose model then scores the token loss alone (generation.GeneratorModel.forward), or an agent of yours."""
    return _generates(opts) and (not opts.skip_generation or _theirs(opts))


def _has_weights(opts: Opts) -> bool:
    """Whether -m may read the model options (-esz, -tr, -lr, ...): a TorchAgent, or an agent of yours; accelbatch's
    other agents (repeat_label, random_candidate) build no model, no optimizer and no batches."""
    from accelbatch.agents import TorchAgent

    found = _agent_class(opts)
    return _theirs(opts) or found is not None and issubclass(found, TorchAgent)


def _reads_text(opts: Opts) -> bool:
    """Whether -m reads text (the text and history options): any model but -m torch:..., a module of yours
    that takes its dataset's tensors and builds itself."""
    return not opts.model.startswith("torch:")


def _has_text_weights(opts: Opts) -> bool:
    return _has_weights(opts) and _reads_text(opts)


def _sums_micro_batches(opts: Opts) -> bool:
    """Whether an update may have several micro-batches (G x R of them), the only place where their weights
    (--reduction, --loss-normalization) differ; with G = R = 1 each update is one micro-batch, weighted 1."""
    return opts.gradient_accumulation > 1 or _replicated(opts)


def _reduces(opts: Opts) -> bool:
    """Whether --reduction changes a weight (layout.compute_layout: MEAN n_j / N_u, SUM n_j / b): with several
    micro-batches an update, or in a partial call of -di > 1 (a tail: --no-drop-last, or a hogwild process's
    pass end), where a short micro-batch has n_j < b; also read against --loss-normalization token (refused with
    sum) and compared with a checkpoint's on --resume."""
    tails = opts.device_iterations > 1 and (not opts.drop_last or opts.numthreads > 1)
    return _sums_micro_batches(opts) or tails or opts.loss_normalization == "token" or opts.resume


def _normalizes(opts: Opts) -> bool:
    """Whether --loss-normalization changes a weight: token weighs micro-batch j by t_j / T_u over its update's
    micro-batches, which is 1 for a lone micro-batch with tokens (0 without: accelbatch's generator then has
    loss 0, an agent of yours may not); also read against --reduction sum and on --resume."""
    return _sums_micro_batches(opts) or opts.reduction == "sum" or opts.resume or _theirs(opts)


def reads_validation_metric(opts: Opts) -> bool:
    """Whether -vmt/-vmm judge anything: validations during training, or -mf (a model there is continued from
    its best validation, checkpoints record the judge, and a resume compares it)."""
    return _periodic_validation(opts) or bool(opts.model_file)


def _caps_evaluations(opts: Opts) -> bool:
    """Whether -vme changes anything: a validation caps its examples; besides, every evaluation of several
    tasks interleaves them when it is above 0 (orders.make_order's balance_tasks)."""
    return reads_validation_metric(opts) or "," in opts.task


def _orders_by_seed(opts: Opts) -> bool:
    """display-data: whether --seed is read: a shuffled datatype's order, or a task that generates its data by
    it (dialogues, reverse) or may read it (a teacher of yours); babi, files and torch datasets in data order
    read none (no model is built)."""
    from accelbatch.teachers import shuffles

    seedless = ("babi", "jsonl", "parlai", "torch")
    return shuffles(opts.datatype) or not _task_kinds(opts) <= set(seedless)


GENERATOR = "a generator (-m transformer/generator, or a GeneratorAgent of yours)"
DECODER = f"{GENERATOR} without --skip-generation"
VALIDATED = "validations during training (-veps or -vtim) or -mf"
MODEL = "a model with weights (a TorchAgent such as -m memnn, or an agent of yours)"
TEXT_MODEL = "a model of text with weights (-m memnn, or an agent of yours; not -m torch:..., which builds itself)"
TEXT = "a model of text (not -m torch:..., which reads its dataset's tensors)"
SEVERAL = "updates of several micro-batches (-ga or -rf above 1)"

def _logs_windows(opts: Opts) -> bool:
    """Whether -ltim paces anything: the progress bar's figures (shown: progress_bar.shows_bar), the train rows of
    --metrics-log or of the TensorBoard log (-ltim -1, no windows, asks for nothing that could go unread)."""
    from accelbatch.progress_bar import shows_bar

    return opts.log_every_n_secs == -1 or shows_bar(opts) or bool(opts.metrics_log or opts.tensorboard_logdir)


def _reads_files(opts: Opts) -> bool:
    """Whether -dp is read: a task that names a file (jsonl:, parlai:, a folder) by a relative path, which -dp
    is joined to, or may read it (a teacher or torch: dataset of yours); accelbatch's generated tasks (babi,
    dialogues, reverse) read no file."""
    from accelbatch.teachers import FILE_TASKS, TASK_PATHS

    generated = set(TASK_PATHS) - set(FILE_TASKS) - {"torch"}
    for part in opts.task.split(","):
        kind, _, path = part.strip().partition(":")
        if kind not in generated and not (kind in FILE_TASKS and os.path.isabs(os.path.expanduser(path))):
            return True
    return False


def _draws_tasks(opts: Opts) -> bool:
    """Whether -mtw is read: multitask training, which draws a task for each new episode (ordered data and
    evaluations serve each task's episodes in turn)."""
    from accelbatch.teachers import shuffles

    return "," in opts.task.strip(", ") and shuffles(opts.datatype)


READERS: dict[str, Reader] = {
    "multitask_weights": Reader(_draws_tasks, "multitask training (-t A,B with -dt train)"),
    "log_every_n_secs": Reader(_logs_windows, "a progress bar (stderr a terminal, or --progress), --metrics-log or "
                                              "--tensorboard-logdir, whose train figures it paces"),
    "datapath": Reader(_reads_files, "a task read from a file by a relative path (jsonl:, parlai:, a folder) or a "
                                     "teacher of yours"),
    "num_buckets": Reader(lambda o: o.dynamic_batching == "buckets", "--dynamic-batching buckets"),
    "max_batch_tokens": Reader(lambda o: o.dynamic_batching in ("full", "buckets"),
                               "--dynamic-batching full or buckets"),
    "batch_sort_cache_size": Reader(lambda o: o.dynamic_batching != "none", "--dynamic-batching"),
    "buffer_size": Reader(lambda o: o.dataloader_mode != "sync", "--dataloader-mode async or async-rebatched"),
    "data_timeout_s": Reader(_loads_elsewhere, "data workers (--num-workers) or --dataloader-mode async"),
    "beam_size": Reader(lambda o: o.inference == "beam" and _decodes(o), f"--inference beam of {DECODER}"),
    **{name: Reader(_decodes, DECODER) for name in ("inference", "beam_min_length", "beam_block_ngram")},
    "skip_generation": Reader(_generates, GENERATOR),
    # given at their defaults on another device (other values are refused: ipu_opts, Opts' checks)
    **{name: Reader(lambda o: o.device == "ipu", "--device ipu") for name in ("ipu_emulator", *IPU_ONLY, "pipeline")},
    "ipu_execution_strategy": Reader(lambda o: o.device == "ipu" and bool(o.pipeline), "--device ipu --pipeline"),
    "ddp_static_graph": Reader(lambda o: o.device == "cuda" and _replicated(o),
                               "--device cuda with replicas (-rf above 1, or torchrun)"),
    "replica_timeout_s": Reader(lambda o: _replicated(o) or o.numthreads > 1,
                                "replicas (-rf/--replication-factor above 1, or torchrun) or hogwild processes (-nt)"),
    "validation_patience": Reader(_periodic_validation, "validations during training (-veps or -vtim)"),
    "validation_cutoff": Reader(_periodic_validation, "validations during training (-veps or -vtim)"),
    "validation_metric": Reader(reads_validation_metric, VALIDATED),
    "validation_metric_mode": Reader(reads_validation_metric, VALIDATED),
    "validation_max_exs": Reader(_caps_evaluations, f"{VALIDATED}, or several tasks (their evaluations "
                                                    "interleave)"),
    "reduction": Reader(_reduces, f"{SEVERAL}, partial calls of -di above 1 (--no-drop-last, or -nt), "
                                  "--loss-normalization token, or --resume"),
    "loss_normalization": Reader(_normalizes, f"{SEVERAL}, --reduction sum, --resume, or an agent of yours"),
    **{name: Reader(_has_text_weights, TEXT_MODEL) for name in ("embedding_size", "text_truncate", "label_truncate")},
    **{name: Reader(_has_weights, MODEL) for name in ("learning_rate", "optimizer", "compile", "mixed_precision",
                                                      "skip_nan")},
    **{name: Reader(_reads_text, TEXT) for name in ("context_length", "include_labels")},
}
# a verb that reads options otherwise than train does: its own readers (the other verbs use READERS)
SEEDED_DATA = "a shuffled -dt (such as train), or -t dialogues, reverse or a teacher of yours"
# eval and display-model with -mf build no weights from --seed: only the data, or an agent of yours, may read it
_SEEDED_EVAL = {"seed": Reader(lambda o: not o.model_file or _orders_by_seed(o) or _theirs(o),
                               f"a model without -mf (its initial weights), {SEEDED_DATA}, or an agent of yours")}


def _offers_task_candidates(opts: Opts) -> bool:
    """Whether interactive reads -t (given no --candidates): for the candidates it offers a model that chooses
    among them, not a generator's (an agent of yours may read it)."""
    from accelbatch.models.generator import GeneratorAgent

    found = _agent_class(opts)
    return _theirs(opts) or found is not None and not issubclass(found, GeneratorAgent)


_OFFERED = ("interactive's offer of the task's candidates to a model that chooses among them (such as -m bag), "
            "made when --candidates is not given")
_INTERACTIVE = {"task": Reader(_offers_task_candidates, _OFFERED),
                "datapath": Reader(lambda o: _offers_task_candidates(o) and _reads_files(o), _OFFERED)}
# interactive given --candidates reads no task (an agent of yours may)
_GIVEN_CANDIDATES = {name: Reader(_theirs, f"{_OFFERED}, or an agent of yours") for name in _INTERACTIVE}
VERB_READERS: dict[str, dict[str, Reader]] = {
    "display-data": {"seed": Reader(_orders_by_seed, SEEDED_DATA), "datapath": READERS["datapath"]},
    "eval": {**READERS, **_SEEDED_EVAL},
    "display-model": {**READERS, **_SEEDED_EVAL},
    "interactive": {**READERS, **_INTERACTIVE},
    "interactive --candidates": {**READERS, **_GIVEN_CANDIDATES},
}


def unused_option_notes(opts: Opts, given: Collection[str], verb: str | None = None) -> list[str]:
    """A line for each option of ``given`` (field names) that ``opts`` never reads, naming what would;
    ``verb``: the command's (display-data reads its own few options: :data:`VERB_READERS`)."""
    flags = {f.name: "/".join(f.metadata["flags"]) for f in fields(Opts)}
    readers = VERB_READERS.get(verb or "", READERS)
    return [f"accelbatch: {flags[name]}: not used by this run: it is read only with {reader.what}"
            for name, reader in readers.items() if name in given and not reader.reads(opts)] + \
        ([_STREAM_UNUSED.format(opts=opts)] if "datatype" in given and _streams_nothing(opts) else [])


_STREAM_UNUSED = ("accelbatch: -dt/--datatype {opts.datatype}: ':stream' not used by this run: -t {opts.task} is held "
                  "in memory (jsonl: and parlai: files stream, and a teacher of yours may)")


def _streams_nothing(opts: Opts) -> bool:
    """Whether ':stream' is given to tasks of which none streams: accelbatch's generated ones and torch: datasets
    (an IterableDataset is read lazily either way)."""
    from accelbatch.teachers import FILE_TASKS, TASK_PATHS

    return ":stream" in opts.datatype and _task_kinds(opts) <= set(TASK_PATHS) - set(FILE_TASKS)
