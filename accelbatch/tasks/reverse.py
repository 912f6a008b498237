"""``-t reverse``: a synthetic generation task, each text a random word whose label is the word reversed.

Words have 3 to 8 letters drawn from :data:`LETTERS` (no h, n or t, so no word normalises to an article and
every reply is scored as written). ``reverse`` serves 20,000 training examples and 1,000 each in valid and
test; ``reverse:N`` serves N training examples and ``max(1, N // 20)`` in valid and test. One example per
episode. The data seed is ``--seed``; each split has its own stream (numpy's PCG64), so the same seed gives
the same data everywhere.
"""

from __future__ import annotations

import numpy as np

from accelbatch.messages import Message
from accelbatch.opts import OptionError
from accelbatch.teachers import FixedTeacher, split_of

LETTERS = "abcdefgijklm"
MIN_LETTERS, MAX_LETTERS = 3, 8
TRAIN_EXAMPLES, EVAL_EXAMPLES = 20_000, 1_000
SPLIT_STREAMS = {"train": 1, "valid": 2, "test": 3}


def generate(count: int, seed: int, split: str = "train") -> list[list[Message]]:
    """``count`` one-turn episodes of the split, deterministic in ``seed``."""
    rng = np.random.default_rng([seed, SPLIT_STREAMS.get(split, 9)])
    lengths = rng.integers(MIN_LETTERS, MAX_LETTERS + 1, count).tolist()
    letters = rng.integers(0, len(LETTERS), sum(lengths)).tolist()
    episodes, pos = [], 0
    for n in lengths:
        word = "".join(LETTERS[i] for i in letters[pos:pos + n])
        pos += n
        episodes.append([Message(text=word, labels=[word[::-1]], episode_done=True)])
    return episodes


def split_sizes(task: str) -> dict[str, int]:
    """Examples per split for ``reverse`` or ``reverse:N``."""
    _, _, arg = task.partition(":")
    if not arg:
        return {"train": TRAIN_EXAMPLES, "valid": EVAL_EXAMPLES, "test": EVAL_EXAMPLES}
    try:
        n = int(arg)
        if n < 1:
            raise ValueError
    except ValueError:
        raise OptionError(f"-t {task}: expected 'reverse' or 'reverse:N' with N >= 1 training examples") from None
    return {"train": n, "valid": max(1, n // 20), "test": max(1, n // 20)}


class ReverseTeacher(FixedTeacher):
    """``-t reverse`` (or ``reverse:N``): reply with the text's word reversed, by ``--seed``."""

    def setup_data(self) -> list[list[Message]]:
        split = split_of(self.opts.datatype)
        return generate(split_sizes(self.opts.task)[split], self.opts.seed, split)
