"""The evaluations inside a training run (its validations and final --eval-splits): their options, and their
teachers made before the first step so that missing data fails then."""

from __future__ import annotations

from accelbatch.opts import Opts
from accelbatch.tasks.files import DataFileError
from accelbatch.teachers import Teacher, create_teacher, eval_datatype


def eval_opts(opts: Opts, split: str) -> Opts:
    """Options of an evaluation inside training: in this process even when training is hogwild (the
    model is shared, so this sees the latest weights without starting processes); a train split in eval
    mode (each example once, in order: the train datatype repeats its data and trains on it)."""
    streamed = "stream" in opts.datatype and "stream" not in split  # as ParlAI's eval worlds: read as trained
    return opts.replace(datatype=eval_datatype(split) + (":stream" if streamed else ""), numthreads=1)


def eval_teachers(opts: Opts, checked: set[str]) -> dict[str, Teacher | None]:
    """The teacher of each --eval-splits split, by its report name (a train split's eval-mode datatype), made
    before training so that missing data fails before the first step, naming the option; None for the splits
    in ``checked`` (a world built already read their data) and for mixed tasks (made when evaluated)."""
    given = [s.strip() for s in opts.eval_splits.split(",") if s.strip()]
    teachers: dict[str, Teacher | None] = {}
    for split in dict.fromkeys(eval_datatype(s) for s in given):
        try:
            teachers[split] = None if split in checked else create_teacher(eval_opts(opts, split))
        except DataFileError as exc:
            rest = ",".join(s for s in given if eval_datatype(s) != split) or "''"
            raise DataFileError(f"--eval-splits {opts.eval_splits}: {split}: {exc}, or leave {split} out "
                                f"(--eval-splits {rest})") from None
    return teachers
