"""Opts: the one place every option is defined, as a dataclass that is also the command line.

Each field carries its flags and help text in ``metadata``; :func:`build_parser` turns the fields into an
argparse parser, so the library call (``Opts(task=..., batchsize=...)``) and the CLI
(``-t ... -bs ...``) can never drift apart. Option names follow ParlAI where ParlAI has one.
Opts also reads like ParlAI's ``opt`` dict (``opts["batchsize"]``, ``opts.get("task")``) so
ParlAI-style agents work unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

DEVICES = ("cpu", "cuda", "ipu")
DATATYPES = ("train", "train:ordered", "train:stream", "train:stream:ordered", "valid", "test",
             "valid:stream", "test:stream", "train:evalmode", "train:evalmode:stream")
DYNAMIC_BATCHING = ("none", "batchsort", "full", "buckets")
DATALOADER_MODES = ("sync", "async", "async-rebatched")
OUTPUT_MODES = ("default", "all", "final", "sum", "everyn")
REDUCTIONS = ("mean", "sum")
MIXED_PRECISION = ("no", "bf16", "fp16")


def _opt(default: Any, *flags: str, help: str, choices: Sequence[Any] | None = None,
         group: str = "main") -> Any:
    """A dataclass field that also describes its command-line flags."""
    meta = {"flags": flags, "help": help, "choices": choices, "group": group}
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class Opts:
    """Every option of accelbatch. Construct directly, or parse with :meth:`from_args`."""

    # --- what to run -------------------------------------------------------------------------
    task: str = _opt("babi:1", "-t", "--task",
                     help="task name(s), comma separated for multitask; 'babi:1', 'jsonl:PATH', "
                          "'parlai:PATH' or 'module:Class' (run `accelbatch tasks` for the list)")
    model: str = _opt("memnn", "-m", "--model",
                      help="agent name or 'module:Class' (run `accelbatch tasks` for the list)")
    model_file: str | None = _opt(None, "-mf", "--model-file",
                                  help="save the model here after training; loaded when it exists")
    datatype: str = _opt("train", "-dt", "--datatype", choices=DATATYPES,
                         help="split and mode: train (shuffled), valid, test; ':stream' reads lazily from disk")
    datapath: str | None = _opt(None, "-dp", "--datapath", help="where file tasks are looked up")
    seed: int = _opt(0, "--seed", help="seed for data order, model init and generated tasks")

    # --- training loop -----------------------------------------------------------------------
    batchsize: int = _opt(32, "-bs", "--batchsize",
                          help="micro batch b; a world step has b x D x R x G rows (the combined batch)")
    num_epochs: float = _opt(5.0, "-ne", "--num-epochs", help="passes over the training data (-1: no limit)")
    max_train_steps: int = _opt(-1, "-tstep", "--max-train-steps",
                                help="stop after this many world steps (-1: no limit)")
    validation_every_n_epochs: float = _opt(1.0, "-veps", "--validation-every-n-epochs",
                                            help="validate after this many epochs (-1: only at the end)")
    validation_patience: int = _opt(-1, "-vp", "--validation-patience",
                                    help="stop after this many validations without improvement (-1: never)")
    validation_metric: str = _opt("accuracy", "-vmt", "--validation-metric",
                                  help="metric that decides the best model")
    validation_cutoff: float = _opt(-1.0, "-vcut", "--validation-cutoff",
                                    help="stop training once the validation metric reaches this (-1: never)")
    eval_splits: str = _opt("valid,test", "--eval-splits",
                            help="comma-separated splits evaluated at the end of training")
    numthreads: int = _opt(1, "-nt", "--numthreads", help="hogwild processes sharing one model (cpu)")
    learning_rate: float = _opt(0.01, "-lr", "--learning-rate", help="optimizer learning rate")
    optimizer: str = _opt("adam", "-opt", "--optimizer", choices=("sgd", "adam", "adamw"), help="optimizer")
    embedding_size: int = _opt(64, "-esz", "--embedding-size", help="embedding size of reference models")
    text_truncate: int = _opt(256, "-tr", "--text-truncate", help="keep at most this many tokens of input text")

    # --- output ------------------------------------------------------------------------------
    metrics_log: str | None = _opt(None, "--metrics-log", help="append one JSON line of metrics per log event")
    report_json: str | None = _opt(None, "--report-json", help="write the final report to this JSON file")
    log_every_n_secs: float = _opt(2.0, "-ltim", "--log-every-n-secs", help="seconds between metric logs")
    progress: bool = _opt(True, "--progress", help="show a progress bar (--no-progress to hide)")
    tensorboard_logdir: str | None = _opt(None, "--tensorboard-logdir",
                                          help="also write the logged metrics as TensorBoard scalars here "
                                               "(needs `pip install tensorboard`)")
    display_examples: bool = _opt(False, "--display-examples", help="print each parley (debugging)")

    # --- data pipeline -----------------------------------------------------------------------
    context_length: int = _opt(-1, "--context-length",
                               help="episode squashing: previous turns kept in the text (-1: all)", group="data")
    include_labels: bool = _opt(True, "--include-labels",
                                help="episode squashing: put earlier labels in the context", group="data")
    dynamic_batching: str = _opt("none", "--dynamic-batching", choices=DYNAMIC_BATCHING, group="data",
                                 help="none, batchsort (sort by length), full (token budget), "
                                      "buckets (few static shapes)")
    max_batch_tokens: int = _opt(-1, "--max-batch-tokens", group="data",
                                 help="token budget per batch for 'full' (-1: batchsize x median length)")
    num_buckets: int = _opt(8, "--num-buckets", group="data", help="most static shapes for 'buckets'")
    batch_sort_cache_size: int = _opt(1000, "--batch-sort-cache-size", group="data",
                                      help="examples buffered for sorting by length")
    dataloader_mode: str = _opt("sync", "--dataloader-mode", choices=DATALOADER_MODES, group="data",
                                help="sync, async (a background process keeps batches ready) or async-rebatched "
                                     "(the same: planned batches lose no tail); never changes results")
    num_workers: int = _opt(0, "--num-workers", group="data", help="data worker processes")
    buffer_size: int = _opt(3, "--buffer-size", group="data", help="batches the async accessor keeps ready")
    drop_last: bool = _opt(True, "--drop-last", group="data",
                           help="drop a partial final training batch (said in the log)")
    data_timeout_s: float = _opt(60.0, "--data-timeout-s", group="data",
                                 help="seconds to wait for one batch from the data workers before failing")

    # --- execution plan ----------------------------------------------------------------------
    device: str = _opt("cpu", "--device", choices=DEVICES, group="plan", help="cpu, cuda or ipu")
    device_iterations: int = _opt(1, "-di", "--device-iterations", group="plan",
                                  help="weight updates (or inference steps) per host call (D)")
    replication_factor: int = _opt(1, "-rf", "--replication-factor", group="plan",
                                   help="data-parallel replicas (R)")
    gradient_accumulation: int = _opt(1, "-ga", "--gradient-accumulation", group="plan",
                                      help="micro batches accumulated per weight update (G)")
    output_mode: str = _opt("default", "--output-mode", choices=OUTPUT_MODES, group="plan",
                            help="outputs returned per call: all, final, sum, everyn (default: final when "
                                 "training, all in inference)")
    output_return_period: int = _opt(1, "--output-return-period", group="plan",
                                     help="N for --output-mode everyn")
    reduction: str = _opt("mean", "--reduction", choices=REDUCTIONS, group="plan",
                          help="how accumulated and replicated gradients combine")
    mixed_precision: str = _opt("no", "--mixed-precision", choices=MIXED_PRECISION, group="plan",
                                help="cuda: autocast precision")
    ipu_emulator: bool = _opt(False, "--ipu-emulator", group="plan",
                              help="run --device ipu on the CPU emulator of poptorch "
                                   "(also ACCELBATCH_IPU_EMULATOR=1)")

    # --- fault tolerance ---------------------------------------------------------------------
    resume: bool = _opt(False, "--resume", group="faults", help="continue from the checkpoint in --model-file")
    save_every_n_secs: float = _opt(-1.0, "--save-every-n-secs", group="faults",
                                    help="save a checkpoint this often (-1: only at the end)")
    skip_nan: bool = _opt(False, "--skip-nan", group="faults",
                          help="skip a step whose loss is NaN instead of stopping")
    replica_timeout_s: float = _opt(300.0, "--replica-timeout-s", group="faults",
                                    help="seconds a replica (-rf) waits in a collective for the others before "
                                         "the run fails naming the stuck replica")

    # ParlAI-style dict access -----------------------------------------------------------------
    def __getitem__(self, key: str) -> Any:
        try:
            return getattr(self, key)
        except AttributeError:
            raise KeyError(key) from None

    def get(self, key: str, default: Any = None) -> Any:
        return getattr(self, key, default)

    def __contains__(self, key: str) -> bool:
        return hasattr(self, key)

    def keys(self) -> Iterator[str]:
        return iter(f.name for f in dataclasses.fields(self))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Opts":
        """A copy with some options changed (the original is never mutated)."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        validate(self)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, **defaults: Any) -> "Opts":
        parser = build_parser()
        if defaults:
            parser.set_defaults(**defaults)
        return cls.from_namespace(parser.parse_args(argv))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "Opts":
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


class OptionError(ValueError):
    """An option has a value that cannot work; the message names the option and what to do."""


def validate(opts: Opts) -> None:
    """Check types and ranges; raise :class:`OptionError` naming the option at fault."""
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        flag = "/".join(f.metadata["flags"])
        choices = f.metadata.get("choices")
        if choices and value not in choices:
            raise OptionError(f"{flag}: {value!r} is not one of {', '.join(map(str, choices))}")
        expected = _field_type(f)
        if value is None:
            continue
        if expected is bool and not isinstance(value, bool):
            raise OptionError(f"{flag}: expected true/false, got {value!r}")
        if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise OptionError(f"{flag}: expected an integer, got {value!r}")
        if expected is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise OptionError(f"{flag}: expected a number, got {value!r}")
        if expected is str and not isinstance(value, str):
            raise OptionError(f"{flag}: expected a string, got {value!r}")
    for name in ("batchsize", "device_iterations", "replication_factor", "gradient_accumulation",
                 "numthreads", "output_return_period", "buffer_size", "num_buckets", "embedding_size",
                 "batch_sort_cache_size"):
        if getattr(opts, name) < 1:
            raise OptionError(f"{_flag(name)}: must be at least 1, got {getattr(opts, name)}")
    if opts.num_workers < 0:
        raise OptionError(f"--num-workers: must be 0 or more, got {opts.num_workers}")
    if opts.learning_rate <= 0:
        raise OptionError(f"--learning-rate: must be positive, got {opts.learning_rate}")
    if opts.context_length < 1 and opts.context_length != -1:
        raise OptionError(f"--context-length: must be -1 (all of the history) or at least 1, got "
                          f"{opts.context_length}")
    for name in ("data_timeout_s", "replica_timeout_s"):
        if getattr(opts, name) <= 0:
            raise OptionError(f"{_flag(name)}: must be a positive number of seconds, got {getattr(opts, name)}")


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return typ
    return object


def _flag(name: str) -> str:
    for f in dataclasses.fields(Opts):
        if f.name == name:
            return "/".join(f.metadata["flags"])
    return name


def build_parser(prog: str = "accelbatch") -> argparse.ArgumentParser:
    """An argparse parser with one argument per Opts field, in groups."""
    parser = argparse.ArgumentParser(prog=prog, add_help=True)
    add_arguments(parser)
    return parser


def add_arguments(parser: argparse.ArgumentParser) -> None:
    groups: dict[str, argparse._ArgumentGroup] = {}
    titles = {"main": "task and model", "data": "data pipeline", "plan": "device and execution plan",
              "faults": "checkpoints and faults"}
    for f in dataclasses.fields(Opts):
        meta = f.metadata
        group = groups.setdefault(meta["group"], parser.add_argument_group(titles[meta["group"]]))
        typ = _field_type(f)
        kwargs: dict[str, Any] = {"dest": f.name, "default": f.default, "help": meta["help"]}
        if typ is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = typ if typ is not object else str
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
                kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}"
        if typ is bool:
            group.add_argument(*[fl for fl in meta["flags"] if fl.startswith("--")], **kwargs)
        else:
            group.add_argument(*meta["flags"], **kwargs)
