"""Episode squashing: turn a multi-turn episode into single-turn examples that can be batched freely.

Every turn of an episode becomes one example whose ``text`` is the recent dialogue history joined with
``"\\n"``, ending with the turn's own text; each squashed example closes its own episode, so examples of one
conversation may land in different batches (which batch sorting needs).

``context_length`` counts utterances, the current text included: -1 keeps the whole history, 1 keeps the
current text alone. With ``include_labels`` the earlier turns' answers are part of the history (what a dialogue
model wants; a question-answering model usually does not). For an episode ``x1 y1 / x2 y2 / x3 y3 / x4 y4``:

=====================  ==========================================================
settings               texts of the four examples
=====================  ==========================================================
-1, labels off         ``x1``, ``x1 x2``, ``x1 x2 x3``, ``x1 x2 x3 x4``
3, labels on           ``x1``, ``x1 y1 x2``, ``x2 y2 x3``, ``x3 y3 x4``
=====================  ==========================================================

The label put in the history is the turn's first label (``labels``, else ``eval_labels``), so squashing is
deterministic; an empty text or label ``""`` is an utterance too (an empty line, counted by ``context_length``),
as in ParlAI and in an agent's :class:`History`. A turn without text (none, or None) adds
none to the history (its label still does).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

from accelbatch.messages import EPISODE_DONE, EVAL_LABELS, LABELS, TEXT, Message

DELIMITER = "\n"


def check_context_length(context_length: int) -> None:
    """Raise ValueError unless ``context_length`` is -1 (everything) or at least 1."""
    if isinstance(context_length, bool) or not isinstance(context_length, int) or (
            context_length < 1 and context_length != -1):
        raise ValueError(f"--context-length: must be -1 (all of the history) or at least 1, "
                         f"got {context_length!r}")


def keeps_answers(context_length: int, include_labels: bool) -> bool:
    """Whether a history with these settings holds the answer to the turn before the current one (its label,
    or an agent's own reply to a turn without one)."""
    return include_labels and context_length != 1


class AwaitsReply(ValueError):
    """A turn that awaits the model's reply (see :func:`awaits_reply`) met where histories are built ahead of
    the model: its front end says which options to change."""


def awaits_reply(turn: Message) -> bool:
    """Whether ``turn`` has no label and more turns of its episode follow: an agent's history then holds the
    model's reply to it, which squashing ahead of the model cannot know."""
    return not turn.get(EPISODE_DONE) and not (turn.get(LABELS) or turn.get(EVAL_LABELS))


def replies_not_returned(opts: Any) -> str:
    """The line refusing a turn that awaits the model's reply in a row whose outputs the output mode drops."""
    mode = "final" if opts.output_mode == "default" else opts.output_mode
    return (f"-t {opts.task}: a turn without a label is followed by more turns of its episode, whose history holds "
            f"the model's reply to it; --output-mode {mode} returns the outputs of some of a training call's "
            f"micro-batches only (-ga {opts.gradient_accumulation}, -di {opts.device_iterations}), so the others' "
            "replies are unknown: train with --output-mode all, or with --context-length 1 or --no-include-labels")


def histories(episode: Sequence[Message], context_length: int = -1, include_labels: bool = True,
              delimiter: str = DELIMITER) -> list[str]:
    """The squashed text of each turn of ``episode``: the recent history ending with the turn's own text."""
    return list(each_history(episode, context_length, include_labels, delimiter))


def each_history(episode: Sequence[Message], context_length: int = -1, include_labels: bool = True,
                 delimiter: str = DELIMITER) -> Iterator[str]:
    """:func:`histories` one at a time: an episode of T turns holds histories of O(T^2) characters in all."""
    history = _recent(context_length)
    for turn in episode:
        history.extend(_said(turn, False))
        yield delimiter.join(history)
        history.extend(_answered(turn, include_labels))


def history_of(episode: Sequence[Message], turn: int, context_length: int = -1, include_labels: bool = True,
               delimiter: str = DELIMITER) -> str:
    """``histories(episode, ...)[turn]`` without the other turns' (a batch's rows from long episodes)."""
    history = _recent(context_length)
    for earlier in episode[:turn]:
        history.extend(_said(earlier, include_labels))
    history.extend(_said(episode[turn], False))
    return delimiter.join(history)


def _recent(context_length: int) -> deque[str]:
    """The utterances a history keeps: the last ``context_length`` (-1: all)."""
    check_context_length(context_length)
    return deque(maxlen=None if context_length == -1 else context_length)


def _said(turn: Message, include_labels: bool) -> list[str]:
    """What a turn adds to the history: its text (an empty one too, as ParlAI's History; a turn without one adds
    none), then its answer."""
    text = turn.get(TEXT)
    return ([text] if text is not None else []) + _answered(turn, include_labels)


def _answered(turn: Message, include_labels: bool) -> list[str]:
    """The turn's first label (``labels``, else ``eval_labels``; "" included) when labels join the history."""
    answers = (turn.get(LABELS) or turn.get(EVAL_LABELS)) if include_labels else None
    return [answers[0]] if answers else []


@dataclass
class History:
    """One conversation's turns squashed into one text, as squashing does: an agent clone's own history.

    ``context_length`` counts utterances (an empty text or label is one), the current text included (-1: all).
    """

    context_length: int = -1
    include_labels: bool = True
    turns: list[str] = field(default_factory=list)

    def add(self, text: str | None, previous_label: str | None) -> str:
        if self.include_labels and previous_label is not None:  # an empty label "" is an utterance, as ParlAI's
            self.turns.append(previous_label)
        if text is not None:  # "" too: ParlAI's History keeps an empty text as an utterance
            self.turns.append(text)
        kept = self.turns if self.context_length < 0 else self.turns[-self.context_length:]
        return "\n".join(kept)

    def clear(self) -> None:
        self.turns = []


def squash_episode(episode: Sequence[Message], context_length: int = -1, include_labels: bool = True,
                   delimiter: str = DELIMITER) -> list[Message]:
    """One squashed, single-turn Message per turn of ``episode`` (the input is not modified).

    Each output keeps every field of its turn (labels, eval_labels, label_candidates, id, ...), gets the
    joined history as ``text`` and ``episode_done=True``.
    """
    out: list[Message] = []
    for turn, text in zip(episode, histories(episode, context_length, include_labels, delimiter)):
        squashed = Message(turn)
        squashed[TEXT] = text
        squashed[EPISODE_DONE] = True
        out.append(squashed)
    return out


def squash_episodes(episodes: Iterable[Sequence[Message]], context_length: int = -1,
                    include_labels: bool = True, delimiter: str = DELIMITER) -> Iterator[Message]:
    """Lazily squash a stream of episodes into a stream of single-turn examples."""
    check_context_length(context_length)
    for episode in episodes:
        yield from squash_episode(episode, context_length, include_labels, delimiter)
