"""The command line: ``accelbatch train|eval|display-data|display-model|interactive|report|tasks [options]``
(also ``python -m accelbatch``)."""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields
from typing import Any

import accelbatch
from accelbatch.agent_args import add_agent_arguments, agent_named_in, given_agent_args
from accelbatch.checkpoint import CheckpointError
from accelbatch.cores import check_processes
from accelbatch.names import AGENT_PATHS, UnknownNameError
from accelbatch.opts import DATATYPES, PATHS, OptionError, Opts, add_arguments, is_training, train_only_flags
from accelbatch.plan import PlanError
from accelbatch.procs import ProcessFailure
from accelbatch.strict_args import OnOff, StrictParser
from accelbatch.tasks.files import DataFileError
from accelbatch.teachers import FILE_TASKS, FileTeacher, comma_in_path, eval_datatype, list_tasks

USAGE_ERRORS: tuple[type[BaseException], ...] = (OptionError, UnknownNameError, DataFileError,
                                                  CheckpointError)


_PRINTS = "prints to the terminal and writes no report or log; leave it out (accelbatch eval writes them)"
_ONE_PROCESS = "does not take it: it runs in this process"
_TYPED = "does not take it: it answers one typed message at a time"
_SHOWS_ALL = "does not take it: it shows every example"
# what a printing verb decides itself: hidden from its --help, and refused, saying why, when given
SET_BY_VERB: dict[str, dict[str, str]] = {
    "display-data": {**dict.fromkeys(("report_json", "metrics_log", "tensorboard_logdir"), _PRINTS),
                     "display_examples": _SHOWS_ALL},
    "display-model": {"report_json": _PRINTS, "metrics_log": _PRINTS, "tensorboard_logdir": _PRINTS,
                      "numthreads": _ONE_PROCESS, "display_examples": _SHOWS_ALL,
                      "skip_generation": "shows the generated replies; leave it out (eval --skip-generation scores "
                                         "the loss alone)"},
    "interactive": {"report_json": _PRINTS, "metrics_log": _PRINTS, "tensorboard_logdir": _PRINTS,
                    "numthreads": _ONE_PROCESS, "display_examples": _TYPED, "datatype": _TYPED,
                    "batchsize": _TYPED, "num_workers": _ONE_PROCESS, "dataloader_mode": _TYPED,
                    "dynamic_batching": _TYPED, "max_batch_tokens": _TYPED, "num_buckets": _TYPED,
                    "batch_sort_cache_size": _TYPED, "buffer_size": _TYPED, "data_timeout_s": _TYPED,
                    "device_iterations": _TYPED, "ipu_synthetic_data": _TYPED, "replication_factor": _ONE_PROCESS,
                    "replica_timeout_s": _ONE_PROCESS, "ipu_input_replica_grouping": _ONE_PROCESS,
                    "ipu_input_replica_grouping_type": _ONE_PROCESS, "metrics": _PRINTS,
                    "skip_generation": "answers with generated replies; leave it out",
                    "collate": "does not take it: it types text to the model, and a batch of dataset items "
                               "needs --collate"},
}


# a switch given the way the verb runs anyway (interactive --no-skip-generation) is taken, not refused
AS_THE_VERB_DOES = {("interactive", "skip_generation"): False, ("display-data", "display_examples"): True,
                    ("display-model", "display_examples"): True, ("display-model", "skip_generation"): False}


def build_cli() -> argparse.ArgumentParser:
    parser = StrictParser(prog="accelbatch", description="ParlAI-style worlds on cpu, cuda and ipu.")
    parser.add_argument("-V", "--version", action="version", version=f"accelbatch {accelbatch.__version__}")
    verbs = parser.add_subparsers(dest="verb", metavar="{train,eval,display-data,display-model,interactive,report,"
                                  "tasks}", parser_class=StrictParser)
    train = verbs.add_parser("train", help="train a model (defaults: the bundled babi:1 task, memnn model)",
                             allow_abbrev=False)
    add_arguments(train)
    evaluate = verbs.add_parser("eval", allow_abbrev=False,
                                help="evaluate a model on a split (default -dt valid; -dt train scores the "
                                     "training data once, training nothing)")
    add_arguments(evaluate, training=False)
    evaluate.set_defaults(datatype="valid")
    from accelbatch.verbs import add_verb_arguments

    for verb, text, datatype in (("display-data", "print a task's examples (-n of them)", "train:ordered"),
                                 ("display-model", "print examples with a model's replies (-mf or -m)", "valid"),
                                 ("interactive", "type messages, read a model's replies (-mf or -m)", "valid")):
        sub = verbs.add_parser(verb, help=text, allow_abbrev=False)
        unread = [f.name for f in fields(Opts) if f.name not in DISPLAY_DATA_READS] if verb == "display-data" else []
        add_arguments(sub, training=False, hide=(*SET_BY_VERB[verb], *unread))
        add_verb_arguments(sub, verb)
        if "datatype" not in SET_BY_VERB[verb]:
            sub.set_defaults(datatype=datatype)
    from accelbatch.plots import add_report_arguments

    report = verbs.add_parser("report", help="plot a run's loss and throughput to a PNG", allow_abbrev=False)
    add_report_arguments(report)
    tasks = verbs.add_parser("tasks", help="list the registered tasks and models", allow_abbrev=False)
    for quick in (report, tasks):  # scripts pass --progress to every verb; these show no progress
        quick.add_argument("--progress", action=OnOff, default=None, help="taken, as every verb takes it (no effect)")
    parser.set_defaults(verb_parsers=verbs.choices)  # an unknown option is refused by its verb's parser
    return parser


def _usage_errors() -> tuple[type[BaseException], ...]:
    from accelbatch.backends.base import BackendUnavailable
    from accelbatch.worlds import ReplyError  # the user's agent broke act()'s contract

    return USAGE_ERRORS + (BackendUnavailable, PlanError, ReplyError)


def run_script(main: Callable[[list[str]], Any], argv: Sequence[str] | None = None) -> int:
    """A script's ``main(argv)`` (default: its command line) as ``accelbatch train`` runs: bad input (an
    option, a file, an unusable --device) is one line naming the script, exit 2; a bug keeps its traceback."""
    try:
        main(list(sys.argv[1:] if argv is None else argv))
    except Exception as exc:
        known = error_message(exc)
        if known is None:
            raise
        print(f"{os.path.basename(sys.argv[0])}: error: {known[1]}", file=sys.stderr)
        return known[0]
    return 0


def error_message(exc: BaseException) -> tuple[int, str] | None:
    """(exit code, message) for an error the user can act on, told by its type: 2 and the error's own one
    line for bad input wherever it was met (this process, a data worker, a replica, a hogwild process); 1 for
    another process's failure (:class:`~accelbatch.procs.ProcessFailure`, its traceback once), a NaN loss or a
    torchrun replica's lost peer; None for anything else (a bug, which keeps its traceback)."""
    from accelbatch.backends.base import NonFiniteLoss
    from accelbatch.backends.distributed import lost_peer

    bad_input = bad_input_message(exc)
    if bad_input is not None:
        return 2, bad_input
    # a child's failure, or a child's exception re-raised with its own type (the failure is its cause)
    failure = next((e for e in (exc, exc.__cause__) if isinstance(e, ProcessFailure)), None)
    nonfinite = f"{NonFiniteLoss.__module__}.{NonFiniteLoss.__qualname__}"
    if failure is not None and nonfinite in failure.error_types and failure.error_message:
        return 1, failure.error_message  # a replica's NaN loss: its one line, as in a single process
    if failure is not None:
        return 1, str(failure)
    return (1, str(exc)) if isinstance(exc, NonFiniteLoss) else (1, lost) if (lost := lost_peer(exc)) else None


def bad_input_message(exc: BaseException) -> str | None:
    """The one-line message of a usage error (bad option, file, plan, checkpoint, device), also when another
    process raised it (a ProcessFailure whose ``error_types`` hold a usage error); None for other errors."""
    usage = _usage_errors()
    if isinstance(exc, usage) or _marked_usage_error(exc):
        return str(exc)
    child = getattr(exc, "child_exception", None)  # another process's, when it survived pickling
    if isinstance(exc, ProcessFailure) and child is not None and _marked_usage_error(child):
        return exc.error_message or str(child)
    names = {f"{t.__module__}.{t.__qualname__}" for t in usage}
    if isinstance(exc, ProcessFailure) and names & set(exc.error_types):
        return exc.error_message or str(exc)
    return None


def _marked_usage_error(exc: BaseException) -> bool:
    """Whether ``exc``'s class says it is bad input (a class attribute ``usage_error = True``): a contract the
    user's code broke (an agent missing batchify), told in one line as the other usage errors are."""
    return getattr(type(exc), "usage_error", False) is True


def main(argv: Sequence[str] | None = None) -> int:
    """``accelbatch VERB ...``: the exit code (0, 2 for bad input, 1 for a failure, 130 when interrupted)."""
    from accelbatch.stdout_guard import guarded_stdout

    with guarded_stdout():
        return _main(argv)


def _main(argv: Sequence[str] | None) -> int:
    parser = build_cli()
    unresolved = _add_agent_options(parser, sys.argv[1:] if argv is None else list(argv))
    args, unknown = parser.parse_known_args(argv)
    agent_args = given_agent_args(args)
    if agent_args:
        args.agent_args = agent_args
    verb_parser, given = args.verb_parsers.get(args.verb, parser), sys.argv[1:] if argv is None else argv
    if unknown and unresolved is not None:  # perhaps the agent's own options: why it was not found comes first
        said = bad_input_message(unresolved)
        print(f"accelbatch: error: {said or f'{type(unresolved).__name__}: {unresolved}'}", file=sys.stderr)
        return 2
    if unknown:  # named with the verb's own --help, as argparse names the verb's other errors
        verb_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.verb is None:  # `accelbatch $VERB` with VERB unset must fail, as argparse fails a missing argument
        parser.print_usage(sys.stderr)
        parser.error(f"no verb given: give one of {', '.join(args.verb_parsers)}")
    bad_path = _bad_path(args)
    if bad_path is not None:
        verb_parser.error(bad_path)
    del args.verb_parsers
    if args.verb == "report":
        from accelbatch.plots import report_command

        return report_command(args)
    if args.verb == "tasks":
        tasks, models = list(list_tasks()), list(AGENT_PATHS.items())
        width = max(len(name) for name, _ in tasks + models)
        for title, rows in (("tasks:", tasks), ("models:", models)):
            print(title)
            for name, text in rows:
                print(f"  {name:<{width}}  {text}")
        return 0
    try:
        _refuse_options_not_read(args)
        if args.verb == "display-data":
            _refuse_unused_by_display_data(args)
        opts = eval_opts(args) if args.verb == "eval" else Opts.from_namespace(args)
        if args.verb == "train" and not is_training(opts.datatype):
            trained = ", ".join(d for d in DATATYPES if is_training(d))
            raise OptionError(f"-dt/--datatype {opts.datatype}: train trains on a training datatype ({trained}); "
                              f"to evaluate, use accelbatch eval -dt {opts.datatype}")
        if args.verb in ("display-model", "interactive"):  # they evaluate: a train split in eval mode
            opts = opts.replace(datatype=eval_datatype(opts.datatype))
        from accelbatch.model_opts import given_on_command_line, with_model_opts
        from accelbatch.unused_options import unused_option_notes

        given_fields = given_on_command_line(given)
        # -mf names its model; interactive reads the task only for the candidates of a ranker, if at all
        opts, taken = with_model_opts(opts, given_fields, reads_task=args.verb != "interactive")

        verb = f"{args.verb} --candidates" if getattr(args, "candidates", None) is not None else args.verb
        if _first_replica():  # said once: torchrun starts this in every replica
            for note in filter(None, [taken, *unused_option_notes(opts, given_fields, verb)]):
                print(note, file=sys.stderr)
        from accelbatch.run_control import check_output_paths

        to_stdout = opts.report_json == REPORT_TO_STDOUT  # the JSON is printed here, not written by the run
        opts = opts.replace(report_json=None) if to_stdout else opts
        check_output_paths(opts)  # a path the run could not write fails now, not after the training
        if not (args.verb == "interactive" and args.candidates is not None):  # else -t is not read
            check_datapath_files(opts)
        if args.verb in ("display-model", "interactive"):
            check_model_file_exists(opts, f"{args.verb} answers with")
        untrained = None
        if args.verb in ("eval", "display-model", "interactive") and getattr(args, "num_examples", 1) >= 1 \
                and not opts.model_file and _is_torch_agent(opts.model):
            what = "scored" if args.verb == "eval" else "answers with"
            untrained = (f"accelbatch: no -mf/--model-file: {args.verb} {what} an untrained -m {opts.model} "
                         "(give -mf PATH of a model trained with `accelbatch train -mf PATH`)")
        if args.verb in ("display-data", "display-model", "interactive"):
            if untrained:
                print(untrained, file=sys.stderr)
            return _run_verb(args, opts)
        from accelbatch.report_json import ReportNotWritten

        unwritten = None
        try:
            report = run_replicas(opts) if _spawns_replicas(opts) else train_or_eval(opts)
        except ReportNotWritten as exc:  # the run finished: its report is printed, then the file's failure
            report, unwritten = exc.report, exc
        if untrained and _first_replica():  # said with the scores (an eval that fails has its own one line)
            print(untrained, file=sys.stderr)
        if report is not None:
            print_report(report, to_stdout)
        if unwritten is not None:
            raise unwritten
    except Exception as exc:
        known = error_message(exc)
        if known is None:
            raise  # a bug: its traceback is what helps
        code, message = known
        print(f"accelbatch: error: {message}", file=sys.stderr)
        return code
    except KeyboardInterrupt as exc:
        print(f"accelbatch: interrupted{': ' + str(exc) if str(exc) else ''}", file=sys.stderr)
        return 130
    return 0


REPORT_TO_STDOUT = "-"  # --report-json -: the report's JSON on stdout (for jq), its table on stderr


def print_report(report: dict[str, Any], as_json: bool = False) -> None:
    """The report as a table on stdout; ``as_json`` (--report-json -): as JSON on stdout, alone there (a
    script reads it whole), and the table on stderr for a person watching."""
    from accelbatch.report_table import format_report, json_ready

    if as_json:
        print(json.dumps(json_ready(report), indent=2, sort_keys=True, allow_nan=False), flush=True)
    print(format_report(report), file=sys.stderr if as_json else sys.stdout)


AGENT_VERBS = ("train", "eval", "display-model", "interactive")  # the verbs that build the -m agent


def _add_agent_options(parser: argparse.ArgumentParser, argv: list[str]) -> BaseException | None:
    """The options the agent named by ``argv`` (-m, or the model -mf or --init-model recorded) declares with its
    add_cmdline_args, on its verb's parser; a declaration that fails is refused in one line. Returns why the
    agent could not be found (said if options are left unrecognized; else the run says it itself)."""
    verb = next((arg for arg in argv if arg in parser.get_default("verb_parsers")), None)
    if verb not in AGENT_VERBS:
        return None
    from accelbatch.agents import Agent
    from accelbatch.names import resolve_agent_class

    try:
        name = agent_named_in(argv[argv.index(verb) + 1:], _saved_model)
        found = resolve_agent_class(name) if name else None
    except Exception as exc:  # noqa: BLE001 - a bad -m or PATH.opt is refused later, in one line naming it
        return exc
    verb_parser = parser.get_default("verb_parsers")[verb]
    if isinstance(found, type) and issubclass(found, Agent) and \
            inspect.getattr_static(found, "add_cmdline_args") is not vars(Agent)["add_cmdline_args"]:
        try:
            add_agent_arguments(verb_parser, found)
        except Exception as exc:  # noqa: BLE001 - the agent's own code: said in one line, naming it
            verb_parser.error(f"-m {name}: {found.__name__}.add_cmdline_args failed: {type(exc).__name__}: {exc}")
    return None


def _saved_model(path: str) -> str | None:
    """The -m that ``path`` (a model file's PATH.opt, or its checkpoint before the file is written) records."""
    from accelbatch.model_opts import read_model_opts, run_opts

    model = read_model_opts(path).get("model") if os.path.isfile(path) else run_opts(path).get("model")
    return model if isinstance(model, str) else None


def _bad_path(args: argparse.Namespace) -> str | None:
    """The line refusing the first path option given an empty value (`-mf "$MODEL"` with MODEL unset: taken as
    no -mf, nothing would be saved) or ``-`` where only --report-json writes to stdout (`-mf -` would write a
    file named '-'); None when the paths are fine."""
    paths = {f.name: "/".join(f.metadata["flags"]) for f in fields(Opts) if f.name in PATHS}
    if args.verb == "report":
        paths = {"run_dir": "RUN_DIR", "out": "-o/--out"}
    for name, flag in paths.items():
        value = vars(args).get(name)
        if value == "":
            return f"argument {flag}: an empty path (an unset shell variable?); give a path, or leave the option out"
        if value == REPORT_TO_STDOUT and name != "report_json":
            return (f"argument {flag}: '-' (standard input or output) is not a path this option can use; give a "
                    "file's path (./- for a file named '-')")
    return None


# what display-data reads: the task's teacher and how the examples are shown (a user's teacher may read more);
# not --context-length or --include-labels: it shows each turn as the teacher serves it, no history added
DISPLAY_DATA_READS = ("task", "datatype", "datapath", "seed", "progress", "host_allocator", "display_examples")


def _refuse_unused_by_display_data(args: argparse.Namespace) -> None:
    """display-data prints a task's examples: a model, batching, device or plan option given to it (hidden from
    its --help) is refused in one line rather than ignored."""
    given = [f for f in fields(Opts) if f.name not in DISPLAY_DATA_READS and f.name in vars(args)]
    if given:
        flags = ", ".join("/".join(f.metadata["flags"]) for f in given)
        raise OptionError(f"{flags}: display-data prints a task's examples as its teacher serves them and uses no "
                          "model, history, batching, device or plan option; leave it out (display-model shows a "
                          "model's replies)")


def _run_verb(args: argparse.Namespace, opts: Opts) -> int:
    """display-data, display-model or interactive, in this process."""
    from accelbatch import verbs

    if args.verb == "display-data":
        verbs.display_data(opts, args.num_examples)
    elif args.verb == "display-model":
        from accelbatch.report_table import format_report

        report = verbs.display_model(opts, args.num_examples)
        print(format_report({opts.datatype.split(":")[0]: report}))
    else:
        verbs.interactive(opts, args.candidates, single_turn=args.single_turn)
    return 0


def _first_replica() -> bool:
    """Whether this process says what the run says once: not one of torchrun's other replicas."""
    from accelbatch.backends.distributed import env_info

    try:
        info = env_info()
    except ValueError:  # a malformed RANK / WORLD_SIZE: the backend's setup says so
        return True
    return info is None or info.rank == 0


def _refuse_options_not_read(args: argparse.Namespace) -> None:
    """A verb other than train given a training-only option, or an option the verb sets itself: one line."""
    if args.verb == "train":
        return
    flags = {f.name: "/".join(f.metadata["flags"]) for f in fields(Opts)}
    given = [flag for name, flag in train_only_flags().items() if name in vars(args)]
    if given:
        count = " (ParlAI's -ne of eval and display is its count of examples: accelbatch eval scores the whole " \
            "split, display-data and display-model take -n N)" if given[0] == flags["num_epochs"] else ""
        raise OptionError(f"{given[0]}: a training option; `accelbatch {args.verb}` trains nothing (it never "
                          f"accumulates gradients, changes weights or saves) and does not take it: drop it{count}")
    set_here = [name for name in SET_BY_VERB.get(args.verb, {})
                if name in vars(args) and vars(args)[name] is not AS_THE_VERB_DOES.get((args.verb, name))]
    if set_here:
        raise OptionError(f"{flags[set_here[0]]}: {args.verb} {SET_BY_VERB[args.verb][set_here[0]]}")


def eval_opts(args: argparse.Namespace) -> Opts:
    """The options of ``accelbatch eval``: a train datatype in eval mode (it scores the training data, never
    trains), and the model file, when one is named, must exist."""
    opts = Opts.from_namespace(args)
    opts = opts.replace(datatype=eval_datatype(opts.datatype))
    check_model_file_exists(opts, "eval scores")
    return opts


def _is_torch_agent(model: str) -> bool:
    """Whether -m names a model with weights to train (not one such as repeat_label)."""
    from accelbatch.agents import TorchAgent
    from accelbatch.names import resolve_agent_class

    try:
        found = resolve_agent_class(model)
    except UnknownNameError:
        return False  # the build says what is wrong with the name
    return isinstance(found, type) and issubclass(found, TorchAgent)


def check_model_file_exists(opts: Opts, what: str) -> None:
    """A verb that reads the model saved at -mf (eval, display-model, interactive) and must not start a
    fresh one when the path is wrong."""
    path = opts.model_file
    if path and not os.path.isfile(path):
        problem = "a directory, not a model file" if os.path.isdir(path) else "no such file"
        todo = "check the path, or train one with `accelbatch train -mf PATH`"
        if os.path.isdir(f"{path}.ckpt"):  # a training run (going on or stopped) that has not validated yet
            todo = (f"a training run has a checkpoint at {path}.ckpt but has not saved its model yet (it saves "
                    f"it at its first validation, or at its end; a stopped one goes on with `accelbatch train "
                    f"-mf {path} --resume`)")
        raise OptionError(f"-mf/--model-file {path}: {problem}; {what} the model saved there ({todo})")


def check_datapath_files(opts: Opts) -> None:
    """A relative ``jsonl:``/``parlai:`` path of -t is read under -dp: when no file is there, one line saying
    so (the data's own message names only the joined path, which -t never wrote)."""
    for part in opts.task.split(",") if opts.datapath else ():
        kind, _, path = part.strip().partition(":")
        if kind not in FILE_TASKS or not path or os.path.isabs(os.path.expanduser(path)):
            continue
        found = FileTeacher.resolve_path(opts.replace(task=f"{kind}:{path}"))
        if not os.path.exists(found) and comma_in_path(opts, part.strip()) is None:  # else the teacher says it
            raise DataFileError(f"{found}: no such file; it is -dp/--datapath {opts.datapath} joined with -t's "
                                f"relative path {path}: check both, or give -t an absolute path")


def train_or_eval(opts: Opts) -> dict | None:
    """Build the world for ``opts`` and run it here (one process, or one replica: the backend's setup joins
    the replicas' process group when torchrun or accelbatch started this process as one)."""
    from accelbatch.build import create_world
    from accelbatch.run import run

    world = create_world(opts)
    main = world.runtime.topology.rank == 0
    try:
        report = run(world, opts)
    finally:  # run() shuts it down once it runs; a refused run leaves it open (a library user may run it again)
        world.shutdown()
    return report if main else None


def _spawns_replicas(opts: Opts) -> bool:
    """``--replication-factor R`` outside torchrun on cpu or cuda: accelbatch starts the R processes."""
    from accelbatch.backends import distributed

    return opts.device in ("cpu", "cuda") and opts.replication_factor > 1 and distributed.env_info() is None


def _replica(rank: int, opts: Opts) -> dict | BaseException | None:
    from accelbatch.report_json import ReportNotWritten

    try:
        report = train_or_eval(opts)
    except ReportNotWritten as exc:  # rank 0's report reaches the parent with the file's failure, to print
        return exc
    return report if rank == 0 else None


def run_replicas(opts: Opts) -> dict | None:
    """Start one process per replica (forkserver, gloo) and return rank 0's report; a script calling :func:`main`
    with unguarded top-level code is refused first (each replica would run it again to start)."""
    from accelbatch.main_guard import check_main_guard

    check_processes(opts)
    check_main_guard(f"-rf/--replication-factor {opts.replication_factor}")
    if opts.device == "cuda":
        from accelbatch.backends.cuda import spawn_cuda_replicas

        first = spawn_cuda_replicas(_replica, opts.replication_factor, opts, group_timeout_s=opts.replica_timeout_s)[0]
    else:
        from accelbatch.backends.distributed import spawn_replicas

        first = spawn_replicas(_replica, opts.replication_factor, opts, group_timeout_s=opts.replica_timeout_s)[0]
    if isinstance(first, BaseException):  # --report-json not written: raised here, with the report
        raise first
    return first


if __name__ == "__main__":
    sys.exit(main())
