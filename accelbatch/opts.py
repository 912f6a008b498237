"""Opts: the one place every option is defined, as a dataclass that is also the command line.

Each field carries its flags and help text in ``metadata``; :func:`build_parser` turns the fields into an
argparse parser, so the library call (``Opts(task=..., batchsize=...)``) and the CLI (``-t ... -bs ...``) can
never drift apart. Option names follow ParlAI where ParlAI has one. Opts also reads like ParlAI's ``opt`` dict
(``opts["batchsize"]``, ``opts.get("task")``) so ParlAI-style agents work unchanged.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator, Sequence

from accelbatch.agent_parser import Reserved, add_agent_arguments, given_agent_args
from accelbatch.datatypes import DATATYPES, canonical_datatype, eval_datatype, is_training, split_of  # noqa: F401 (re-exported)
from accelbatch.help_texts import show_default
from accelbatch.ipu_opts import IPU_ONLY, validate_ipu_options  # noqa: F401 - IPU_ONLY: examples read it here
from accelbatch.option_error import OptionError
from accelbatch.parlai_flags import refuse_parlai_flags
from accelbatch.strict_args import OnOff, StrictParser, refuse_glued_values
from accelbatch.task_weights import parse_task_weights

DEVICES = ("cpu", "cuda", "ipu")
DYNAMIC_BATCHING = ("none", "batchsort", "full", "buckets")
DATALOADER_MODES = ("sync", "async", "async-rebatched")
OUTPUT_MODES = ("default", "all", "final", "sum", "everyn")
REDUCTIONS = ("mean", "sum")
LOSS_NORMALIZATIONS = ("micro", "token")
MIXED_PRECISION = ("no", "bf16", "fp16")
INFERENCE = ("greedy", "beam")
IPU_STRATEGIES = ("pipelined", "sharded", "phased")
INPUT_GROUP_TYPES = ("consecutive", "orthogonal")
MAX_WAIT_S = (2 ** 31 - 1) // 1000  # the longest timeout: poll(2) waits a C int of milliseconds


def _opt(default: Any, *flags: str, help: str, choices: Sequence[Any] | None = None,
         group: str = "main", train_only: bool = False) -> Any:
    """A dataclass field that also describes its command-line flags; ``train_only`` options are read by
    training alone (``accelbatch eval`` neither lists nor accepts them)."""
    meta = {"flags": flags, "help": help, "choices": choices, "group": group, "train_only": train_only}
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
    collate: str | None = _opt(None, "--collate",
                               help="with -m torch:...: pkg.mod:fn, the collate function that batches the dataset's "
                                    "items (default: torch's default_collate)")
    model_file: str | None = _opt(None, "-mf", "--model-file",
                                  help="save the model here after training; loaded when it exists")
    datatype: str = _opt("train", "-dt", "--datatype", choices=DATATYPES,
                         help="split and mode: train (shuffled; evaluated: in order, once), valid, test; ':stream' "
                              "reads lazily from disk, ':ordered' in data order, each pass whole (no cycling), "
                              "':evalmode' scores the train split as an evaluation")
    multitask_weights: str = _opt("1", "-mtw", "--multitask-weights", train_only=True,
                                  help="multitask training: comma-separated weights of drawing each task for a new "
                                       "episode (missing ones 1), or 'stochastic' (by the tasks' episodes)")
    datapath: str | None = _opt(None, "-dp", "--datapath", help="where file tasks are looked up")
    seed: int = _opt(0, "--seed", help="seed for data order, model init and the data of dialogues and reverse")

    # --- training loop -----------------------------------------------------------------------
    batchsize: int = _opt(32, "-bs", "--batchsize",
                          help="micro batch b; a world step has b x D x R x G rows (the combined batch)")
    num_epochs: float = _opt(5.0, "-ne", "-eps", "--num-epochs", train_only=True,
                             help="passes over the training data (-1: no limit)")
    max_train_steps: int = _opt(-1, "-tstep", "--max-train-steps", train_only=True,
                                help="stop after this many world steps (-1: no limit)")
    max_train_time: float = _opt(-1.0, "-ttim", "--max-train-time", train_only=True,
                                 help="stop training after this many seconds (-1: no limit), then save and "
                                      "evaluate as at the other limits (ParlAI's -ttim)")
    validation_every_n_epochs: float = _opt(1.0, "-veps", "--validation-every-n-epochs", train_only=True,
                                            help="validate after this many epochs (-1: only at the end)")
    validation_every_n_secs: float = _opt(-1.0, "-vtim", "--validation-every-n-secs", train_only=True,
                                          help="also validate every this many seconds of training (-1: never)")
    validation_patience: int = _opt(-1, "-vp", "--validation-patience", train_only=True,
                                    help="stop after this many validations without improvement (-1: never)")
    validation_metric: str = _opt("accuracy", "-vmt", "--validation-metric", train_only=True,
                                  help="metric of the valid report that decides the best model (accuracy, f1, "
                                       "loss or an agent's own)")
    # its default names the metrics best_valid.metric_mode minimises (tests/test_help_texts.py keeps them equal)
    validation_metric_mode: str | None = _opt(None, "-vmm", "--validation-metric-mode", choices=("max", "min"),
                                              train_only=True,
                                              help="max or min: whether a larger or a smaller -vmt is better "
                                                   "(default: min for loss, ppl or mean_rank; max otherwise)")
    validation_max_exs: int = _opt(-1, "-vme", "--validation-max-exs", train_only=True,
                                   help="validations during training stop after the step that reaches this "
                                        "many examples, several tasks' whole episodes interleaved (each next "
                                        "one from the task that has served the fewest, so a task of long "
                                        "episodes can fill a small cap); the final evaluation scores all; "
                                        "-1: all")
    validation_cutoff: float = _opt(-1.0, "-vcut", "--validation-cutoff", train_only=True,
                                    help="stop training once the validation metric reaches this (-1: never)")
    eval_splits: str = _opt("valid,test", "--eval-splits", train_only=True,
                            help="comma-separated splits evaluated at the end of training (a train split: "
                                 "each example once, in order, as train:evalmode)")
    metrics: str = _opt("default", "-mcs", "--metrics",
                        help="metrics the report shows: 'default' (the default) or 'all' (every metric, bleu-4 of "
                             "the replies included), or a comma-separated list such as accuracy,loss,bleu-4 (exs "
                             "is always shown)")
    numthreads: int = _opt(1, "-nt", "--numthreads", help="hogwild processes sharing one model (cpu)")
    host_allocator: str = _opt("reuse", "--host-allocator", choices=("reuse", "system"),
                               help="reuse: glibc keeps up to 256 MiB of freed host memory for the next step "
                                    "instead of giving it back to the OS and faulting it in again (same results; "
                                    "see accelbatch/host_memory.py); system: leave malloc as it is")
    learning_rate: float = _opt(0.01, "-lr", "--learning-rate", train_only=True, help="optimizer learning rate")
    optimizer: str = _opt("adam", "-opt", "--optimizer", choices=("sgd", "adam", "adamw"), train_only=True,
                          help="optimizer")
    init_model: str | None = _opt(None, "-im", "--init-model", train_only=True,
                                  help="start from the weights of this model file (a fresh optimizer); ignored "
                                       "when --model-file exists, which is continued instead")
    embedding_size: int = _opt(64, "-esz", "--embedding-size", help="embedding size of reference models")
    text_truncate: int = _opt(256, "-tr", "--text-truncate",
                              help="keep at most this many tokens of input text, its end (memnn: of each line; "
                                   "-1: all of it, a generator then keeping the last 1024, its positions); the "
                                   "text only, where ParlAI's -tr truncates labels too")
    label_truncate: int = _opt(-1, "--label-truncate",
                               help="label truncation length, a label's first tokens (-1: the model's own: "
                                    "generators keep and generate 32; rankers keep each candidate's first 8 "
                                    "words, memnn 16); with --text-truncate it sets the default "
                                    "--max-batch-tokens (-1 counted there as --text-truncate, ParlAI's default)")
    inference: str = _opt("greedy", "--inference", choices=INFERENCE,
                          help="generators: decoding at evaluation, greedy or beam; it runs a fixed number of "
                               "steps, --label-truncate (32 when it is -1)")
    beam_size: int = _opt(1, "--beam-size", help="generators: hypotheses kept by --inference beam")
    beam_min_length: int = _opt(1, "--beam-min-length",
                                help="generators: tokens generated before the end token may come (greedy too)")
    beam_block_ngram: int = _opt(-1, "--beam-block-ngram",
                                 help="generators: never repeat an n-gram of this size in a reply (-1: allow)")
    skip_generation: bool = _opt(False, "--skip-generation",
                                 help="generators: evaluate the token loss only, no replies (no accuracy)")

    # --- output ------------------------------------------------------------------------------
    metrics_log: str | None = _opt(None, "--metrics-log", help="append one JSON line of metrics per log event")
    report_json: str | None = _opt(None, "--report-json", help="write the final report to this JSON file")
    log_every_n_secs: float = _opt(2.0, "-ltim", "--log-every-n-secs", train_only=True,
                                   help="seconds between metric logs (0: every step; -1: only at the end)")
    progress: bool | None = _opt(None, "--progress",
                                 help="train's progress bar (other verbs show none): by default when stderr is "
                                      "a terminal (--progress: also into a file or pipe; --no-progress: never)")
    tensorboard_logdir: str | None = _opt(None, "--tensorboard-logdir",
                                          help="also write the logged metrics as TensorBoard scalars here "
                                               "(needs `pip install tensorboard`)")
    display_examples: bool = _opt(False, "--display-examples", help="print each parley (debugging)")

    # --- data pipeline -----------------------------------------------------------------------
    context_length: int = _opt(-1, "-histsz", "--history-size", "--context-length", group="data",
                               help="utterances of the dialogue history the model reads, the current text "
                                    "included: 1 keeps it alone, 2 adds the utterance before it (the previous "
                                    "label; the previous text with --no-include-labels) (-1: all)")
    include_labels: bool = _opt(True, "--include-labels", group="data",
                                help="earlier labels (in a conversation, the model's own replies) are utterances "
                                     "of the history; --no-include-labels: the texts alone")
    dynamic_batching: str = _opt("none", "-dynb", "--dynamic-batching", choices=DYNAMIC_BATCHING, group="data",
                                 help="none, batchsort (sort by length), full (token budget), "
                                      "buckets (few static shapes)")
    max_batch_tokens: int = _opt(-1, "--max-batch-tokens", group="data",
                                 help="token budget per batch for 'full' and 'buckets', counted as rows x longest "
                                      "text (-1: ParlAI's (text-truncate + label-truncate) x batchsize)")
    num_buckets: int = _opt(8, "--num-buckets", group="data", help="most static shapes for 'buckets'")
    batch_sort_cache_size: int = _opt(1000, "--batch-sort-cache-size", group="data",
                                      help="examples buffered for sorting by length")
    dataloader_mode: str = _opt("sync", "--dataloader-mode", choices=DATALOADER_MODES, group="data",
                                help="sync, async (a background process keeps batches ready) or async-rebatched "
                                     "(the same: planned batches lose no tail); never changes results")
    num_workers: int = _opt(0, "--num-workers", group="data", help="data worker processes")
    buffer_size: int = _opt(3, "--buffer-size", group="data", help="batches the async accessor keeps ready")
    drop_last: bool = _opt(True, "--drop-last", group="data", train_only=True,
                           help="with --dynamic-batching: leave out each pass's partial training batches (counted "
                                "as dropped_exs); --no-drop-last trains them, as tails where their rows are not a "
                                "multiple of D x R x G (micro-batches of -bs rows, more in a tail longer than the "
                                "combined batch; at most D updates; -rf processes leave out one of fewer rows "
                                "than R). Without --dynamic-batching rows run on into "
                                "the next pass, no batch is partial and this option changes nothing, but -dt "
                                "train:ordered ends a pass with partial steps where its episodes do not fill them: "
                                "--no-drop-last runs them as tails; --drop-last runs one whose rows are a multiple "
                                "of D x R x G and refuses the others before training (hogwild -nt processes train "
                                "them either way; on the IPU and with -rf processes, refused either way: use -dt "
                                "train)")
    data_timeout_s: float = _opt(60.0, "--data-timeout-s", group="data",
                                 help="seconds to wait for one batch from the data workers before failing")

    # --- execution plan ----------------------------------------------------------------------
    device: str = _opt("cpu", "--device", choices=DEVICES, group="plan", help="cpu, cuda or ipu")
    device_iterations: int = _opt(1, "-di", "--device-iterations", group="plan",
                                  help="weight updates (or inference steps) per host call (D)")
    replication_factor: int = _opt(1, "-rf", "--replication-factor", group="plan",
                                   help="data-parallel replicas (R)")
    gradient_accumulation: int = _opt(1, "-ga", "--gradient-accumulation", group="plan",
                                      help="micro batches accumulated per weight update (G)", train_only=True)
    output_mode: str = _opt("default", "--output-mode", choices=OUTPUT_MODES, group="plan",
                            help="outputs returned per call: all, final, sum, everyn (default: final when "
                                 "training, all in inference)", train_only=True)
    output_return_period: int = _opt(1, "--output-return-period", group="plan",
                                     help="N for --output-mode everyn", train_only=True)
    reduction: str = _opt("mean", "--reduction", choices=REDUCTIONS, group="plan",
                          help="how accumulated and replicated gradients combine", train_only=True)
    loss_normalization: str = _opt("micro", "--loss-normalization", choices=LOSS_NORMALIZATIONS, group="plan",
                                   help="micro: each micro-batch's mean loss counts alike (PopTorch's Mean); "
                                        "token: each counts by its tokens, so an update with -ga/-rf is the "
                                        "per-token mean of one big batch (needs --reduction mean)",
                                   train_only=True)
    mixed_precision: str = _opt("no", "--mixed-precision", choices=MIXED_PRECISION, group="plan",
                                help="autocast precision (cpu and cuda); fp16 also scales the loss "
                                     "(GradScaler, its state in checkpoints); on ipu fp16 is "
                                     "model.half() with a static loss scaling")
    compile: bool = _opt(False, "--compile", group="plan",
                         help="cpu, cuda: the forward through torch.compile (fewer kernel launches; the first steps "
                              "and new shapes compile); it sums floats in another order: weights differ in last bits")
    ddp_static_graph: bool = _opt(False, "--ddp-static-graph", group="plan", train_only=True,
                                  help="cuda with replicas: DDP's static_graph (for a model whose forward "
                                       "uses the same parameters every step; DDP then skips its per-step "
                                       "bookkeeping of which gradients are ready)")
    ipu_emulator: bool | None = _opt(None, "--ipu-emulator", group="plan",
                                     help="run --device ipu on the CPU emulator of poptorch (default: as "
                                          "ACCELBATCH_IPU_EMULATOR=1 says; --no-ipu-emulator: never)")
    ipu_loss_scaling: float | None = _opt(None, "--ipu-loss-scaling", group="plan", train_only=True,
                                          help="ipu with --mixed-precision fp16: the optimizer's static "
                                               "loss_scaling (default 128; 1 turns it off)")
    ipu_cache_dir: str | None = _opt(None, "--ipu-cache-dir", group="plan",
                                     help="ipu: keep compiled executables in this directory and load them "
                                          "in later runs (Options.enableExecutableCaching)")
    ipu_available_memory_proportion: float | None = _opt(
        None, "--ipu-available-memory-proportion", group="plan",
        help="ipu: share of each IPU's memory that matmuls, convolutions and embeddings may use for temporaries, "
             "in (0, 1] (Options.setAvailableMemoryProportion; lower it when a graph runs out of memory)")
    ipu_synthetic_data: bool = _opt(False, "--ipu-synthetic-data", group="plan",
                                    help="ipu: no host I/O, the device makes its own inputs "
                                         "(Options.enableSyntheticData): measures the model alone")
    ipu_input_replica_grouping: int = _opt(
        1, "--ipu-input-replica-grouping", group="plan",
        help="ipu: replicas in groups of N that read the same inputs (Options.inputReplicaGrouping; N divides -rf): "
             "a call feeds b x D x (R / N) x G rows")
    ipu_input_replica_grouping_type: str = _opt(
        "consecutive", "--ipu-input-replica-grouping-type", choices=INPUT_GROUP_TYPES, group="plan",
        help="ipu: which replicas share inputs: consecutive (0..N-1, N..2N-1, ...) or orthogonal (replica r reads "
             "input group r mod (R / N))")
    pipeline: str | None = _opt(None, "--pipeline", group="plan",
                                help="ipu: split the model over IPUs where these submodules start (comma-separated "
                                     "dotted names from model.named_modules(); K names give K+1 stages)")
    ipu_execution_strategy: str = _opt("pipelined", "--ipu-execution-strategy", choices=IPU_STRATEGIES, group="plan",
                                       help="ipu with --pipeline: pipelined (training needs gradient accumulation of "
                                            "2 x stages - 1 or more, evaluation device iterations of stages or "
                                            "more), sharded, or phased (1 IPU a replica)")

    # --- fault tolerance ---------------------------------------------------------------------
    resume: bool = _opt(False, "--resume", group="faults", train_only=True,
                        help="continue from the checkpoint in --model-file")
    save_every_n_secs: float = _opt(-1.0, "-stim", "--save-every-n-secs", group="faults",
                                    help="save a checkpoint this often (-1: only at the end)", train_only=True)
    skip_nan: bool = _opt(False, "--skip-nan", group="faults",
                          help="skip a step whose loss is NaN instead of stopping", train_only=True)
    replica_timeout_s: float = _opt(300.0, "--replica-timeout-s", group="faults",
                                    help="seconds a replica (-rf) waits in a collective for the others, or a "
                                         "hogwild process (-nt) may take for a parley, before the run fails "
                                         "naming the stuck one")

    # --- the agent's own options (its add_cmdline_args: accelbatch/agent_args.py) -------------------
    agent_args: dict = _opt({}, group="agent",
                            help="the -m agent's own options by name, as its add_cmdline_args declares them")

    # ParlAI-style dict access (an agent's own options too) -------------------------------------
    def __getitem__(self, key: str) -> Any:
        if key in self.__dataclass_fields__:
            return getattr(self, key)
        try:
            return self.agent_args[key]
        except KeyError:
            raise KeyError(key) from None

    def __setitem__(self, key: str, value: Any) -> None:
        """ParlAI's ``opt[key] = value`` (a ported teacher's ``opt['datafile'] = path``): an option, checked as
        when constructed, or else one of the agent's own options (of this Opts only)."""
        if key in self.__dataclass_fields__:
            setattr(self, key, getattr(self.replace(**{key: value}), key))
        else:
            self.agent_args = {**self.agent_args, key: value}

    def get(self, key: str, default: Any = None) -> Any:
        return self[key] if key in self else default

    def __contains__(self, key: str) -> bool:
        return key in self.__dataclass_fields__ or key in self.agent_args

    def keys(self) -> Iterator[str]:
        return iter(f.name for f in dataclasses.fields(self))

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> "Opts":
        """A copy with some options changed (the original is never mutated)."""
        return dataclasses.replace(self, **changes)

    def __post_init__(self) -> None:
        # ParlAI's spellings of a datatype, its modes in any order, as the one accelbatch names it (as -dt does)
        if isinstance(self.datatype, str):
            self.datatype = canonical_datatype(self.datatype)
        if isinstance(self.eval_splits, str):
            self.eval_splits = ",".join(canonical_datatype(s.strip()) for s in self.eval_splits.split(","))
        if isinstance(self.model_file, str) and os.path.islink(self.model_file):  # the file a save writes: its
            self.model_file = os.path.realpath(self.model_file)  # .opt, .trainstats, .ckpt and lock go beside it
        validate(self)

    @classmethod
    def from_args(cls, argv: Sequence[str] | None = None, agent: type | None = None, **defaults: Any) -> "Opts":
        """Options read from a command line (``sys.argv[1:]`` when ``argv`` is None), ``defaults`` in place of
        accelbatch's; with ``agent`` (an agent class), its own ``add_cmdline_args`` options too, kept in
        ``agent_args`` and listed by ``--help``, as ``accelbatch train -m`` takes them."""
        unknown = sorted(set(defaults) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise OptionError(f"Opts.from_args: no option named {', '.join(unknown)} (the names are Opts' fields)")
        parser = build_parser(prog=os.path.basename(sys.argv[0]) or "accelbatch")  # the script's name in its errors
        parser.set_defaults(**defaults)
        if agent is not None:
            add_agent_arguments(parser, agent, reserved_options())
        namespace = parser.parse_args(argv)
        given, opts = given_agent_args(namespace), cls.from_namespace(namespace)
        return opts.replace(agent_args={**opts.agent_args, **given}) if given else opts

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> "Opts":
        return cls(**{k: v for k, v in vars(ns).items() if k in {f.name for f in dataclasses.fields(cls)}})


def validate(opts: Opts) -> None:
    """Check types and ranges; raise :class:`OptionError` naming the option at fault."""
    for f in dataclasses.fields(opts):
        value = getattr(opts, f.name)
        flag = "/".join(f.metadata["flags"])
        choices = f.metadata.get("choices")
        if choices and value is not None and value not in choices:
            raise OptionError(f"{flag}: {value!r} is not one of {', '.join(map(str, choices))}")
        expected = _field_type(f)
        if value is None and (f.default is None or "None" in str(f.type)):  # else refused below: not a ...
            continue
        if expected is bool and not isinstance(value, bool):
            raise OptionError(f"{flag}: expected true/false, got {value!r}")
        if expected is int and (isinstance(value, bool) or not isinstance(value, int)):
            raise OptionError(f"{flag}: expected an integer, got {value!r}")
        if expected is float and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise OptionError(f"{flag}: expected a number, got {value!r}")
        if expected is float and not math.isfinite(value):  # nan passes every range test below
            hint = " (see --help for what -1 means)" if "-1:" in f.metadata.get("help", "") else ""
            raise OptionError(f"{flag}: expected a finite number, got {value!r}{hint}")
        if expected is str and not isinstance(value, str):
            raise OptionError(f"{flag}: expected a string, got {value!r}")
    if not isinstance(opts.agent_args, dict) or not all(isinstance(k, str) for k in opts.agent_args):
        raise OptionError(f"agent_args: expected a dict of the agent's options by name, got {opts.agent_args!r}")
    for key, value in opts.agent_args.items():  # PATH.opt and checkpoints keep them as JSON
        try:
            json.dumps(value)
        except (TypeError, ValueError):
            raise OptionError(f"agent_args: {key} = {value!r} is not JSON data (str, number, bool, list, dict), "
                              "which PATH.opt keeps: declare it with type=str") from None
    for name in ("batchsize", "device_iterations", "replication_factor", "gradient_accumulation",
                 "ipu_input_replica_grouping", "numthreads", "output_return_period", "buffer_size", "num_buckets",
                 "embedding_size", "beam_size", "batch_sort_cache_size"):
        if getattr(opts, name) < 1:
            raise OptionError(f"{_flag(name)}: must be at least 1, got {getattr(opts, name)}")
    if not 0 <= opts.seed < 2**64:  # what torch.manual_seed and numpy's generators both take
        raise OptionError(f"--seed: must be between 0 and 2**64 - 1, got {opts.seed}")
    if opts.num_workers < 0:
        raise OptionError(f"--num-workers: must be 0 or more, got {opts.num_workers}")
    if not opts.learning_rate > 0:
        raise OptionError(f"-lr/--learning-rate: must be a positive number, got {opts.learning_rate}")
    for name, minus_one in (("text_truncate", "all of the text"), ("label_truncate", "the model's own"),
                            ("max_batch_tokens", "ParlAI's budget"), ("context_length", "all of the history")):
        if getattr(opts, name) < 1 and getattr(opts, name) != -1:
            raise OptionError(f"{_flag(name)}: must be at least 1, or -1 ({minus_one}), got {getattr(opts, name)}")
    if opts.numthreads > 1 and opts.replication_factor > 1:
        raise OptionError(f"-nt/--numthreads {opts.numthreads} with -rf/--replication-factor "
                          f"{opts.replication_factor}: hogwild processes and replicas do not combine; choose one "
                          "(-rf for synchronous data parallelism, -nt for hogwild)")
    for name in ("data_timeout_s", "replica_timeout_s"):
        if not 0 < getattr(opts, name) <= MAX_WAIT_S:
            raise OptionError(f"{_flag(name)}: must be a positive number of seconds, at most {MAX_WAIT_S:,} (24.8 "
                              f"days: the longest wait poll(2) takes), got {getattr(opts, name)}")
    for name in ("num_epochs", "max_train_steps", "max_train_time", "validation_max_exs",
                 "validation_every_n_epochs", "validation_every_n_secs", "validation_patience",
                 "save_every_n_secs"):
        value = getattr(opts, name)
        if value <= 0 and value != -1:
            meaning = {"validation_every_n_epochs": "only at the end", "validation_every_n_secs": "never",
                       "validation_patience": "never", "save_every_n_secs": "only at the end"}
            raise OptionError(f"{_flag(name)}: must be positive, or -1 for {meaning.get(name, 'no limit')}, "
                              f"got {value}")
    if opts.log_every_n_secs < 0 and opts.log_every_n_secs != -1:
        raise OptionError(f"-ltim/--log-every-n-secs: must be 0 (every step) or more, or -1 (only at the end), "
                          f"got {opts.log_every_n_secs}")
    for name, given in (("resume", opts.resume), ("save_every_n_secs", opts.save_every_n_secs > 0)):
        if given and not opts.model_file:
            raise OptionError(f"{_flag(name)}: checkpoints live next to --model-file PATH (PATH.ckpt); give "
                              "-mf/--model-file too")
    if opts.ddp_static_graph and opts.device != "cuda":
        raise OptionError(f"--ddp-static-graph: applies to --device cuda (DDP through accelerate); "
                          f"--device {opts.device} does not use DDP: leave it out")
    validate_ipu_options(opts)
    parse_task_weights(opts.multitask_weights)
    wrong = [s.strip() for s in opts.eval_splits.split(",") if s.strip() and s.strip() not in DATATYPES]
    if wrong:
        raise OptionError(f"--eval-splits: {wrong[0]!r} is not a split; give comma-separated ones of "
                          f"{', '.join(DATATYPES)} (a train split is scored once, in order, as train:evalmode)")
    if not [m for m in opts.metrics.split(",") if m.strip()]:
        raise OptionError("--metrics: give 'default', 'all' or comma-separated metric names such as accuracy,loss")


def _field_type(f: dataclasses.Field) -> type:
    text = str(f.type)
    for name, typ in (("bool", bool), ("int", int), ("float", float), ("str", str)):
        if text.startswith(name):
            return typ
    return object


def _flag(name: str) -> str:
    return "/".join(next((f.metadata["flags"] for f in dataclasses.fields(Opts) if f.name == name), (name,)))


def build_parser(prog: str = "accelbatch") -> argparse.ArgumentParser:
    """An argparse parser with one argument per Opts field, in groups (no abbreviated option names)."""
    add_arguments(parser := StrictParser(prog=prog, add_help=True))
    return parser


def train_only_flags() -> dict[str, str]:
    """Field name -> flags of the options only training reads."""
    return {f.name: "/".join(_flags(f)) for f in dataclasses.fields(Opts) if f.metadata["train_only"]}


def reserved_options() -> Reserved:
    """The flags and names of accelbatch's options, which an agent's own options may not take."""
    return Reserved(frozenset(command_line_flags()), frozenset(f.name for f in dataclasses.fields(Opts)))


def command_line_flags() -> set[str]:
    """Every flag the options of accelbatch take on the command line (a switch's ``--no-`` form too)."""
    return {flag for f in dataclasses.fields(Opts) for flag in _flags(f)}


def _flags(f: dataclasses.Field) -> list[str]:
    """The flags of an option as the command line takes them: a switch's ``--no-`` form too."""
    flags = list(f.metadata["flags"])
    if _field_type(f) is bool:
        flags += ["--no-" + fl[2:] for fl in flags if fl.startswith("--")]
    return flags


# file and folder options: a `~` the shell left (quoted, or in --model-file=~/m.pt) is the home folder
PATHS = ("model_file", "datapath", "init_model", "metrics_log", "report_json", "tensorboard_logdir", "ipu_cache_dir")
LOADED_MODEL_HELP = "the model to load (its PATH.opt gives the model's options); nothing is written to it"


def add_arguments(parser: argparse.ArgumentParser, training: bool = True, hide: Sequence[str] = ()) -> None:
    """One argument per Opts field; the training-only ones with ``training=False`` and those named in ``hide``
    hidden from --help and absent from the namespace unless given (the caller refuses them)."""
    groups: dict[str, argparse._ArgumentGroup] = {}
    titles = {"main": "task and model", "data": "data pipeline", "plan": "device and execution plan",
              "faults": "checkpoints and faults"}
    for f in dataclasses.fields(Opts):
        meta = f.metadata
        if not meta["flags"]:  # set in code or by the agent's own options, not a flag of accelbatch's
            continue
        group = groups.setdefault(meta["group"], parser.add_argument_group(titles[meta["group"]]))
        typ = _field_type(f)
        hidden = meta["train_only"] and not training or f.name in hide
        text = meta["help"] if training or f.name != "model_file" else LOADED_MODEL_HELP
        kwargs: dict[str, Any] = {"dest": f.name, "default": argparse.SUPPRESS if hidden else f.default,
                                  "help": argparse.SUPPRESS if hidden else text}
        if typ is bool:
            kwargs["action"] = getattr(argparse, "BooleanOptionalAction", OnOff)
        else:
            kwargs["type"] = os.path.expanduser if f.name in PATHS else canonical_datatype \
                if f.name == "datatype" else typ if typ is not object else str
            if meta.get("choices"):
                kwargs["choices"] = meta["choices"]
                kwargs["metavar"] = "{" + ",".join(meta["choices"]) + "}"
        if typ is bool:
            action = group.add_argument(*[fl for fl in meta["flags"] if fl.startswith("--")], **kwargs)
            action.help = kwargs["help"]  # Python 3.9-3.10's switch adds "(default: True)": shown as on/off
        else:
            action = refuse_glued_values(group.add_argument(*meta["flags"], **kwargs))
        if not hidden:
            show_default(action)  # the default the parser holds when --help prints (a verb's own too)
    refuse_parlai_flags(parser)
