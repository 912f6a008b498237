"""The options that make the model in ``-mf PATH``, kept beside it in ``PATH.opt`` (as ParlAI's MODEL.opt): which
agent, its sizes, the history it reads, its learning rate and optimizer. eval, display-model, interactive and a
training that continues PATH take them from there (the learning rate and optimizer only a training), so ``-mf``
alone names the model; a training from ``--init-model FILE`` takes FILE.opt's agent and sizes; ``--resume``
continues with the interrupted run's learning rate and the options its resume compares (the model's among them),
from its checkpoint. An option given on the command line still wins, but a resume refuses a model option other
than its checkpoint's."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import Any, Sequence

from accelbatch.checkpoint import (
    MANIFEST,
    RESUME_OPTS,
    SHAPING,
    STATE,
    Checkpoint,
    CheckpointError,
    check_resumable,
    checkpoint_dir,
    find_checkpoint,
    has_saved_position,
    load_checkpoint,
    read_json_file,
    sha256_of,
    unreadable_sidecar,
    write_json_file,
)
from accelbatch.names import resolve_agent_class
from accelbatch.opts import OptionError, Opts
from accelbatch.teachers import given_file, is_training, portable_task, task_files, task_metric_spelled

# the history a model reads (as ParlAI's -histsz in MODEL.opt): not its weights' shapes, but what it was trained
# to answer from, so a verb given only -mf feeds it the same (a resume compares them with RESUME_OPTS)
HISTORY = ("context_length", "include_labels")
# PATH.opt: a continued training keeps its optimizer and -mtw too; every verb given only -mf works on the
# model's task, with its seed (the data of the generated tasks dialogues and reverse is drawn by --seed), and a
# torch: task's --collate (the batches the model was trained on)
KEPT = SHAPING + HISTORY + ("collate", "learning_rate", "optimizer", "task", "multitask_weights", "seed",
                            "agent_args")
# what a text model reads and a -m torch:... module does not (it builds itself and takes its dataset's tensors):
# neither kept for it nor compared on its --resume
TEXT_ONLY = ("embedding_size", "text_truncate", "label_truncate", *HISTORY)
# what eval -mf takes (an evaluation draws no tasks)
EVALUATING = tuple(name for name in KEPT if name not in ("learning_rate", "optimizer", "multitask_weights"))
# the run's limits, validation and logs: a resume goes on to the same end unless the command line says
# otherwise; the limits go together: one given (e.g. a larger -ne) sets the end alone, the others lifted (-1)
LIMITS = ("num_epochs", "max_train_steps", "max_train_time")
RUN_COURSE = (*LIMITS, "validation_every_n_epochs", "validation_every_n_secs", "validation_patience",
              "validation_metric", "validation_metric_mode", "validation_max_exs", "validation_cutoff",
              "eval_splits", "save_every_n_secs", "log_every_n_secs", "metrics_log", "report_json",
              "tensorboard_logdir")
# the feed a checkpoint's data position belongs to (batched loader or per-row clones): a resume keeps it
FRONT_END = ("num_workers", "dataloader_mode")
# where and how the steps ran: the device and its precision, compilation and outputs, the batching budget, the
# NaN policy, the collate and how validations generate (a resume of an IPU run goes on on the IPU, with the
# optimizer state the device kept: on another device it would start afresh)
PLACE = (*(f.name for f in dataclasses.fields(Opts) if f.metadata.get("group") == "plan" and f.name not in RESUME_OPTS),
         "max_batch_tokens", "num_buckets", "batch_sort_cache_size", "skip_nan", "collate", "inference", "beam_size",
         "beam_min_length", "beam_block_ngram", "skip_generation", "metrics")
# what --resume takes from the checkpoint
RESUMED = ("learning_rate", "agent_args", *RESUME_OPTS, *RUN_COURSE, *FRONT_END, *PLACE)


def opt_path(model_file: str) -> str:
    return f"{model_file}.opt"


def agent_name(agent: Any, opts: Opts) -> str | None:
    """What ``-m`` rebuilds ``agent`` from: ``opts.model`` when it names the agent's class, else the class's
    ``module:Class`` when it can be imported, else None (a class of ``__main__`` or defined in a function)."""
    cls = type(agent)
    try:
        if resolve_agent_class(opts.model) is cls:
            return opts.model
    except (OptionError, ImportError):
        pass
    if cls.__module__ == "__main__" or cls.__qualname__ != cls.__name__:
        return None
    return f"{cls.__module__}:{cls.__name__}"


def recorded_model(agent: Any, opts: Opts) -> str:
    """-m as a checkpoint records it: :func:`agent_name` of the agent trained, else ``opts.model``."""
    try:
        return agent_name(agent, opts) or opts.model
    except ValueError:  # opts.model names nothing (the agent was given as a class): only for the record
        return opts.model


def same_model(name: str, saved: Any) -> bool:
    """Whether -m ``name`` builds the agent that a checkpoint's -m ``saved`` names: the same text, or two names of
    one class (``torch:`` names only by their text: each builds the one TorchModelAgent class)."""
    if name == saved:
        return True
    if not isinstance(saved, str) or name.startswith("torch:") or saved.startswith("torch:"):
        return False
    try:
        return resolve_agent_class(name) is resolve_agent_class(saved)
    except (ValueError, ImportError):
        return False


def check_resumed_opts(checkpoint: Checkpoint, opts: Opts, model: str,
                       keys: Sequence[str] = RESUME_OPTS) -> None:
    """Refuse (a one-line CheckpointError) to resume ``checkpoint`` with options ``keys`` other than its own;
    ``model`` names the agent trained now, which matches the checkpoint's -m when it names the same class."""
    saved = checkpoint.opts.get("model")
    then = checkpoint.opts
    if model.startswith("torch:"):
        keys = [key for key in keys if key not in TEXT_ONLY]
    if isinstance(then.get("task"), str):  # a file task given relative to the folder it ran in, or under -dp
        checkpoint = dataclasses.replace(checkpoint, opts={**then, "task": portable_task(then["task"],
                                                                                          then.get("datapath"))})
    check_resumable(checkpoint, opts.replace(model=saved if same_model(model, saved) else model,
                                             task=portable_task(opts.task, opts.datapath)), keys)


def with_agent_shape(opts: Opts, world: Any) -> Opts:
    """``opts`` with the shaping options (-esz, -tr, --label-truncate) ``world``'s model agent was built with,
    where they differ: an agent made from other options than the run's is saved, checkpointed and resumed as
    what it is."""
    try:
        built = getattr(world.get_model_agent(), "opts", None)
    except (AttributeError, IndexError):  # not a world, or one without agents: run() says what is wrong
        return opts
    if not isinstance(built, Opts):
        return opts
    differ = {k: getattr(built, k) for k in (*SHAPING, "agent_args") if k != "model" and getattr(built, k) !=
              getattr(opts, k)}  # the agent's own options with their defaults: what PATH.opt keeps
    return opts.replace(**differ) if differ else opts


def recorded_task(opts: Opts) -> str | None:
    """-t as PATH.opt and a checkpoint keep it: file paths absolute (:func:`portable_task`); None when a task's
    teacher is a class of ``__main__``, which another process cannot import."""
    if any(part.strip().startswith("__main__:") for part in opts.task.split(",")):
        return None
    return portable_task(opts.task, opts.datapath)


def write_model_opts(model_file: str, opts: Opts, model: str | None) -> None:
    """Write ``opts``' :data:`KEPT` options beside the model just saved to ``model_file``, with ``model`` the
    name that rebuilds its agent (either left out when None: nothing can import it, which the first save of a
    run says)."""
    task, unread = recorded_task(opts), TEXT_ONLY if opts.model.startswith("torch:") else ()
    kept = {**({} if model is None else {"model": model}),
            **{name: getattr(opts, name) for name in KEPT
               if name not in ("model", "task", "agent_args", "collate", *unread)},
            **({"agent_args": opts.agent_args} if opts.agent_args else {}),
            **({"collate": opts.collate} if opts.collate else {}),
            **({} if task is None else {"task": task})}
    if read_json_file(opt_path(model_file)) != kept:  # said at a run's first save only
        if model is None:
            print(f"accelbatch: -mf {model_file}: the agent's class (in __main__ or a function) cannot be recorded "
                  f"in {opt_path(model_file)}; load the model with -m module:Class naming an importable copy of it",
                  file=sys.stderr)
        if task is None:
            print(f"accelbatch: -mf {model_file}: -t {opts.task} names a class in __main__, which cannot be recorded "
                  f"in {opt_path(model_file)}; evaluate the model with -t naming an importable copy of it",
                  file=sys.stderr)
    write_json_file(opt_path(model_file), kept)


def read_model_opts(model_file: str) -> dict[str, Any]:
    """The options kept with ``model_file`` (empty when there are none; an error naming the file when it holds
    something else than the JSON object accelbatch writes)."""
    saved = read_json_file(opt_path(model_file))
    if saved is not None and not isinstance(saved, dict):
        raise unreadable_sidecar(opt_path(model_file), f"a JSON {type(saved).__name__}, not an object of options")
    if saved is not None and "task" in saved and not (isinstance(saved["task"], str) and saved["task"].strip()):
        raise unreadable_sidecar(opt_path(model_file), f"its task is {saved['task']!r}, not a task's name")
    if saved is not None and not isinstance(saved.get("agent_args", {}), dict):
        raise unreadable_sidecar(opt_path(model_file), f"its agent_args are {saved['agent_args']!r}, not an object")
    return {k: v for k, v in saved.items() if k in KEPT} if saved is not None else {}


def given_on_command_line(argv: Sequence[str]) -> set[str]:
    """The option fields whose flags ``argv`` holds (abbreviations are refused, so a flag is written whole; a
    switch's ``--no-`` form counts)."""
    given = set()
    for f in dataclasses.fields(Opts):
        flags = f.metadata.get("flags", ())
        if any(arg in flags or arg.split("=", 1)[0] in flags or arg.startswith("--no-") and f"--{arg[5:]}" in flags
               for arg in argv if arg.startswith("-")):
            given.add(f.name)
    return given


def run_opts(model_file: str, strict: bool = False) -> dict[str, Any]:
    """The options of the run whose checkpoint ``-mf model_file`` holds; when they cannot be read, empty, or
    with ``strict`` (a resume, which builds its world from them) the CheckpointError naming the damaged file."""
    found = find_checkpoint(model_file) or checkpoint_dir(model_file)
    try:
        manifest = read_json_file(os.path.join(found, MANIFEST))
        state = os.path.join(found, manifest["directory"], STATE)
        if sha256_of(state) != manifest["files"][STATE]["sha256"]:  # no option read from a changed file
            raise CheckpointError(f"{state}: changed since it was saved")
        saved = read_json_file(state)["opts"]
    except (CheckpointError, KeyError, TypeError, OSError) as exc:
        if not strict:
            return {}
        load_checkpoint(found)  # its own words for what is damaged (the error the resume would give)
        if isinstance(exc, CheckpointError):
            raise
        raise CheckpointError(f"{found}: its {MANIFEST} or {STATE} lacks what a checkpoint holds (damaged or "
                              f"edited); delete {found} to start afresh, or restore it from a backup") from None
    return saved if isinstance(saved, dict) else {}


def _untold(saved: dict[str, Any], names: Sequence[str], given: set[str], opts: Opts) -> dict[str, Any]:
    """The options of ``saved`` among ``names`` that the command line does not give and ``opts`` lacks (the
    agent's own options one by one: those the command line gives win)."""
    if isinstance(saved.get("agent_args"), dict):
        saved = {**saved, "agent_args": {**saved["agent_args"], **opts.agent_args}}
    return {k: v for k, v in saved.items() if k in names and k not in given and getattr(opts, k) != v}


def opts_from_model_file(model_file: str, **changes: Any) -> Opts:
    """The options of the model saved at ``model_file`` for Python, as ``-mf`` alone gives them on the command
    line: its agent, sizes, history, task and seed from ``PATH.opt`` (a ``resume=True`` training's from its
    checkpoint), ``changes`` (Opts' fields) winning. What was taken is said on stderr, as the command line says it.

        opts = ab.opts_from_model_file("/tmp/m.pt", datatype="valid")
    """
    opts = Opts(model_file=model_file, **changes)
    if not (os.path.isfile(model_file) or opts.resume and has_saved_position(model_file)):
        raise OptionError(f"opts_from_model_file: no model file {model_file} (nor, with resume=True, a checkpoint "
                          "of it); give the -mf path a training saved to")
    opts, taken = with_model_opts(opts, set(changes) - {"agent_args"})  # the agent's options merge one by one
    if taken:
        print(taken, file=sys.stderr)
    return opts


def with_model_opts(opts: Opts, given: set[str], reads_task: bool = True) -> tuple[Opts, str | None]:
    """``opts`` with the saved options that are not ``given`` (Opts' field names): a ``--resume``'s from its checkpoint
    (:data:`RESUMED`, unsaid: the run continues as it was, as ParlAI's resume does; every option given
    otherwise is refused in one line), else those of an existing ``-mf`` (the learning rate only when ``opts``
    trains), else the shaping ones of its ``--init-model``; and a line saying which of these were taken (None
    when none). A bad value in the file they come from is an OptionError naming that file, and so is a task
    taken from ``PATH.opt`` whose data is gone, when the verb ``reads_task`` (interactive may not)."""
    training, path = is_training(opts.datatype), opts.model_file
    if opts.resume and path and training and has_saved_position(path):  # the checkpoint's options win
        saved, found = run_opts(path, strict=True), find_checkpoint(path)
        if os.path.isfile(path):
            read_model_opts(path)  # a damaged PATH.opt beside it is said now, not by the next eval of the model
        taken = RESUMED if given.isdisjoint(LIMITS) else tuple(k for k in RESUMED if k not in LIMITS)
        opts = _taking(opts, _untold(saved, taken, given, opts), f"{found}: the checkpoint's options",
                       "start afresh without --resume")
        if not given.isdisjoint(LIMITS):  # the limit given ends the run alone: the others are lifted
            opts = opts.replace(**{k: -1 for k in LIMITS if k not in given})
        if "task" not in given:
            check_task_files(opts, f"{found}: the checkpoint's task", "put the data back there to resume, or "
                             "start afresh without --resume")
        # a -bs above the checkpoint's may be lowered to the data again: the built world's check judges it
        keys = [k for k in RESUME_OPTS if k != "batchsize" or opts.batchsize < saved.get("batchsize", 0)]
        check_resumed_opts(Checkpoint(path=found, model_state={}, opts=saved), opts, opts.model, keys)
        return _metric_spelled(opts), None  # said by the resume (-lr) or not at all: the run goes on as it was
    if path and os.path.isfile(path):
        source, flag, names = path, "-mf", KEPT if training else EVALUATING
    elif opts.init_model and os.path.isfile(opts.init_model):
        source, flag, names = opts.init_model, "--init-model", (*SHAPING, "agent_args")
    else:
        return opts, None
    saved = read_model_opts(source)
    taken = _untold(saved, names, given, opts)
    older = flag == "-mf" and saved and "task" not in saved and "task" not in given  # an older PATH.opt
    untold_task = None if not older else (
        f"accelbatch: -mf {source}: {opt_path(source)} does not record the task the model was trained on (written "
        f"by an older accelbatch); working on -t {opts.task}, the default: give -t to name the task")
    unread = _unread_keys(source)
    if unread:
        untold_task = "\n".join(filter(None, (untold_task, (
            f"accelbatch: {flag} {source}: {opt_path(source)} holds keys accelbatch does not read: "
            f"{', '.join(unread[:5])}{f' and {len(unread) - 5} more' if len(unread) > 5 else ''} (misspelled, or "
            "another program's names: give those options on the command line)"))))
    if not taken:
        return opts, untold_task
    flags = {f.name: f.metadata["flags"][0] for f in dataclasses.fields(Opts) if f.metadata["flags"]}
    said = " ".join(_said(flags[k], v) if k in flags else "and the agent's " + ", ".join(
        f"{name}={value!r}" for name, value in v.items() if name not in opts.agent_args)
        for k, v in taken.items())
    if "task" in taken and reads_task:
        check_task_files(opts.replace(task=taken["task"]), f"{opt_path(source)}: the model's task",
                         "give -t naming the data to use")
    return _metric_spelled(_taking(opts, taken, opt_path(source), "fix or delete that file")), "\n".join(filter(None, (
        f"accelbatch: {flag} {source} was trained with {said} ({opt_path(source)}); using them (give them to "
        "override)", untold_task)))


def _unread_keys(model_file: str) -> list[str]:
    """The keys of ``model_file``'s ``PATH.opt`` that name no option of accelbatch's (read as they are)."""
    raw = read_json_file(opt_path(model_file))
    known = {f.name for f in dataclasses.fields(Opts)}
    return sorted(k for k in raw if k not in known) if isinstance(raw, dict) else []


def _metric_spelled(opts: Opts) -> Opts:
    """``opts`` with a ``-vmt TASK/metric`` of a file task given relative spelled as the kept task spells it."""
    return opts.replace(validation_metric=task_metric_spelled(opts.validation_metric, opts.task, opts.datapath))


def _said(flag: str, value: Any) -> str:
    """An option as the command line gives it: ``-esz 16``, a switch ``--include-labels`` or ``--no-...``."""
    if isinstance(value, bool):
        return flag if value else f"--no-{flag[2:]}"
    return f"{flag} {value}"


def check_task_files(opts: Opts, where: str, what_to_do: str) -> None:
    """A task taken from a file whose data is gone: one line naming that file, not a -t the user never gave."""
    for path in task_files(opts.task):
        if not os.path.exists(given_file(path, opts.datapath)):
            raise OptionError(f"{where} -t {opts.task} reads {path}, which does not exist (moved or deleted?); "
                              f"{what_to_do}")


def _taking(opts: Opts, taken: dict[str, Any], where: str, what_to_do: str) -> Opts:
    """``opts`` with the saved options ``taken`` from ``where``; a bad value there is that file's fault."""
    try:
        return opts.replace(**taken)
    except OptionError as exc:
        raise OptionError(f"{where}: {exc}; {what_to_do}") from None
