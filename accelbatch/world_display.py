"""How worlds show their parleys, as ParlAI's ``display()`` does: each act's text and labels, its reward and label
candidates under it (cut to a few past ten), a line after an episode's last example, the rows of a batched
step one after another."""

from __future__ import annotations

import sys
from typing import Sequence

from accelbatch.messages import Message, is_padding

EPISODE_END = "- - - - - - - - - - - - - - - - - - - - -"  # after an episode's last example, as ParlAI's display


def show(block: str) -> None:
    """Print ``block`` and its newline in one write, flushed: hogwild processes share the output, and a block
    or its newline written apart lets another process's lines in between."""
    sys.stdout.write(block + "\n")
    sys.stdout.flush()


def display(acts: Sequence[Message | None]) -> str:
    """The acts as ParlAI's display shows them: each one's text and labels, its reward and label candidates under
    it."""
    lines = []
    for act in acts:
        if act:
            key = "labels" if act.get("labels") else "eval_labels"  # named as ParlAI's display names them
            golds = act.get(key)
            lines.append(f"[{act.get('id', '?')}]: {act.get('text') or ''}"  # a null text is none
                         + (f"  ({key}: {'|'.join(golds)})" if golds else ""))
            if act.get("reward") not in (None, 0):  # as ParlAI's display, a zero reward is not shown
                lines.append(f"    [reward: {act['reward']}]")
            if act.get("label_candidates"):
                lines.append(candidates_line(act["label_candidates"]))
    return "\n".join(lines)


SHOWN_CANDIDATES = 10  # more are cut to the first CUT_CANDIDATES and a count, as ParlAI's display does
CUT_CANDIDATES = 5


def candidates_line(candidates: Sequence[str]) -> str:
    """An example's label candidates, as ParlAI's display shows them: ``    [label_candidates: a|b|c]``, or the
    first five and how many more when there are over ten."""
    found = list(candidates)
    if len(found) <= SHOWN_CANDIDATES:
        return f"    [label_candidates: {'|'.join(map(str, found))}]"
    more = len(found) - CUT_CANDIDATES
    return f"    [label_candidates: {'|'.join(map(str, found[:CUT_CANDIDATES]))}| ...and {more} more]"


def display_parley(acts: Sequence[Message | None]) -> str:
    """One parley's acts (the teacher's, then the model's), then :data:`EPISODE_END` when the teacher's ended
    its episode."""
    text = display(acts)
    return f"{text}\n{EPISODE_END}" if text and acts and acts[0] and acts[0].get("episode_done") else text


def display_rows(rows: Sequence[Sequence[Message | None]]) -> str:
    """Each row's parley (:func:`display_parley`), the rows of one batched step one after the other; a
    padding row (no example: past the end of the data) shows nothing."""
    shown = (display_parley(row) for row in rows if row and not is_padding(row[0]))
    return "\n".join(text for text in shown if text)


__all__ = ["EPISODE_END", "candidates_line", "display", "display_parley", "display_rows", "show"]
