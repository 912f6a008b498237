"""ParlAI's flags that accelbatch does not take, each refused in one line that says what to give here (argparse
alone would say "unrecognized arguments", leaving a user who ported a ParlAI command to guess)."""

from __future__ import annotations

import argparse

from accelbatch.strict_args import refused_option

# ParlAI's flags (a short and a long form of one option) -> what to give instead (or why there is nothing to give)
PARLAI_ONLY: dict[tuple[str, ...], str] = {
    ("--truncate",): "ParlAI's truncation of text and label together; accelbatch truncates them apart: give "
                     "-tr/--text-truncate N and --label-truncate N",
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
}


def refuse_parlai_flags(parser: argparse.ArgumentParser) -> None:
    """Make ``parser`` refuse each of :data:`PARLAI_ONLY` in one line."""
    for flags, instead in PARLAI_ONLY.items():
        for flag in flags:
            refused_option(parser, flag, instead)
