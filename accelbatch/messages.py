"""Message: the dict that teachers and agents trade, with ParlAI's keys."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Set
from typing import Any

TEXT = "text"
LABELS = "labels"
EVAL_LABELS = "eval_labels"
EPISODE_DONE = "episode_done"
ID = "id"
LABEL_CANDIDATES = "label_candidates"
TEXT_CANDIDATES = "text_candidates"
REWARD = "reward"


class Message(dict):
    """A ParlAI-style message: a plain dict, so agents may read it as one.

    ``text`` is the utterance, ``labels`` the answers in training, ``eval_labels`` in evaluation,
    ``episode_done`` closes an episode, ``id`` names the speaker; ``label_candidates`` lists the
    answers a ranking model may choose from.
    """

    def copy(self) -> "Message":
        return Message(self)

    def targets(self) -> list[str]:
        """The answers this message is judged against (labels, else eval_labels)."""
        found = self.get(LABELS, self.get(EVAL_LABELS)) or []
        return list(found)


class FrozenMessage(Message):
    """A Message that cannot be changed: what a teacher serves (one prepared object per example, handed to
    every epoch and every row that reads that example, with no copy per act).

    An agent that wants to add or change keys of an observation copies it first, ``Message(obs)``, as
    :meth:`accelbatch.agents.TorchAgent.observe` does. ``copy()`` gives a plain, changeable Message.
    """

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise TypeError("this message is shared and read-only (a teacher serves the same object every epoch): "
                        "copy it first with Message(observation), then change the copy")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    pop = popitem = setdefault = update = clear = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:  # pickles (hogwild, data workers) as a plain, changeable Message
        return (Message, (dict(self),))


def is_padding(message: dict | None) -> bool:
    """True for a row with no example in it (None, or no text and no labels: past the end of the data)."""
    return not message or (TEXT not in message and LABELS not in message and EVAL_LABELS not in message)


def freeze(message: dict) -> FrozenMessage:
    """A read-only copy of ``message``."""
    return FrozenMessage(message)


def as_message(obj: Any, where: str = "message") -> Message:
    """Turn a dict into a Message, normalising labels to a list of strings; raise on wrong types."""
    if isinstance(obj, Message):
        return obj
    if not isinstance(obj, dict):
        raise TypeError(f"{where}: expected a dict, got {type(obj).__name__}")
    msg = Message(obj)
    for key in (LABELS, EVAL_LABELS, LABEL_CANDIDATES, TEXT_CANDIDATES):
        if key in msg and msg[key] is not None:
            msg[key] = _str_list(msg[key], key, where)
    if TEXT in msg and msg[TEXT] is not None and not isinstance(msg[TEXT], str):
        raise TypeError(f"{where}: 'text' must be a string, got {type(msg[TEXT]).__name__}")
    if EPISODE_DONE in msg:
        msg[EPISODE_DONE] = _bool(msg[EPISODE_DONE], where)
    return msg


# a code point that only exists as half of a UTF-16 pair: JSON's "\ud83d" escape alone decodes to one, and
# no such string can be encoded as UTF-8 (tokenizing, printing or saving it raises UnicodeEncodeError)
_SURROGATE = re.compile("[\ud800-\udfff]")


def lone_surrogate(value: Any, field: str = "") -> tuple[str, int, str] | None:
    """The first lone surrogate in ``value``'s strings, keys included (dicts, lists and tuples walked):
    (where it is, e.g. ``'labels'[1]``, the character's index in that string, the character); None if none."""
    if isinstance(value, str):
        found = _SURROGATE.search(value)
        return None if found is None else (field or "the value", found.start(), found.group())
    if isinstance(value, dict):
        for key, item in value.items():
            inner = f"{field}[{key!r}]" if field else repr(key)
            bad = lone_surrogate(key, f"the key {inner}") or lone_surrogate(item, inner)
            if bad is not None:
                return bad
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            bad = lone_surrogate(item, f"{field}[{i}]")
            if bad is not None:
                return bad
    return None


def _str_list(value: Any, key: str, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, Iterable) and not isinstance(value, (Mapping, Set)):  # keys or no order: not a list
        out = list(value)
        if all(isinstance(v, str) for v in out):
            return out
    raise TypeError(f"{where}: '{key}' must be a string or a list of strings, got {value!r}")


def _bool(value: Any, where: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise TypeError(f"{where}: 'episode_done' must be true or false, got {value!r}")
