"""ParlAI's flags that accelbatch does not take, each refused in one line that says what to give here (argparse
alone would say "unrecognized arguments", leaving a user who ported a ParlAI command to guess)."""

from __future__ import annotations

import argparse

# ParlAI's flags (a short and a long form of one option) -> what to give instead (or why there is nothing to give)
PARLAI_ONLY: dict[tuple[str, ...], str] = {
    ("--truncate",): "ParlAI's truncation of text and label together (its -tr); accelbatch truncates them "
                     "apart: give -tr/--text-truncate N (the text only) and --label-truncate N",
    ("-clip", "--gradient-clip"): "ParlAI's gradient clipping; accelbatch does not clip gradients (ParlAI's "
                                  "TorchAgent clips at 0.1 by default): leave it out, and lower -lr if training "
                                  "diverges",
    ("--lr-scheduler",): "ParlAI's learning-rate schedulers; accelbatch keeps -lr/--learning-rate constant: leave "
                         "it out",
    ("-sval", "--save-after-valid"): "ParlAI's saving after each validation; accelbatch writes -mf's model whenever "
                                     "a validation improves on the best (and a checkpoint every "
                                     "-stim/--save-every-n-secs): leave it out",
    ("-pyt", "--pytorch-teacher-task"): "ParlAI's PytorchDataTeacher; give the task with -t (a torch Dataset: "
                                        "-t torch:pkg.mod:Dataset)",
    ("-pybsrt",): "ParlAI's PytorchDataTeacher batch sort; give --dynamic-batching batchsort",
    ("-o", "--init-opt"): "ParlAI's JSON file of options; give the options as flags (a model file's own come "
                          "from its PATH.opt with -mf or -im)",
    ("-tblog", "--tensorboard-log"): "ParlAI's switch for TensorBoard logs; give --tensorboard-logdir DIR",
    ("-df", "--dict-file"): "ParlAI's dictionary file; accelbatch's models hash words, with no dictionary to build "
                            "or keep: leave it out",
    ("-vstep", "--validation-every-n-steps"): "give -veps/--validation-every-n-epochs (a fraction of an epoch "
                                              "too) or -vtim/--validation-every-n-secs",
    ("-lstep", "--log-every-n-steps"): "give -ltim/--log-every-n-secs",
    ("-ebs", "--eval-batchsize"): "evaluations run at -bs/--batchsize: leave it out",
    ("-lfc", "--load-from-checkpoint"): "a run with -mf saves checkpoints beside it; give --resume to go on "
                                        "from the last one",
    ("--update-freq",): "ParlAI's gradient accumulation; give -ga/--gradient-accumulation N",
    ("--learningrate",): "ParlAI's spelling; give -lr/--learning-rate",
    ("--fp16",): "ParlAI's half precision; give --mixed-precision fp16 (or bf16)",
    **dict.fromkeys([("--warmup-updates",), ("--warmup-rate",), ("--lr-scheduler-patience",),
                     ("--lr-scheduler-decay",), ("--max-lr-steps",), ("--invsqrt-lr-decay-gamma",)],
                    "ParlAI's learning-rate schedule; accelbatch keeps -lr/--learning-rate constant: leave it out"),
    ("-mom", "--momentum"): "accelbatch's -opt sgd has no momentum (torch's default 0): leave it out, or train "
                            "with -opt adam",
    ("-wdecay", "--weight-decay"): "accelbatch's optimizers keep torch's default weight decay (0 for sgd and "
                                   "adam, 0.01 for adamw): leave it out, or choose -opt adamw",
    ("-beta", "--betas"): "accelbatch's adam and adamw keep torch's default betas (0.9, 0.999): leave it out",
    ("-et", "--evaltask"): "validations and tests score -t's tasks; score another task with "
                           "`accelbatch eval -mf PATH -t TASK`",
}


def refuse_parlai_flags(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` (a :class:`~accelbatch.strict_args.StrictParser`) refuse each flag of :data:`PARLAI_ONLY`
    in one line, unless an agent or a script declares it as its own option."""
    refusals = {flag: instead for flags, instead in PARLAI_ONLY.items() for flag in flags}
    parser.refusals = {**getattr(parser, "refusals", {}), **refusals}  # type: ignore[attr-defined]
