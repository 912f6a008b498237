"""Message: the dict that teachers and agents trade, with ParlAI's keys."""

from __future__ import annotations

import copy
import os
import re
import sys
from collections.abc import Iterable, Mapping, Set
from typing import Any, Sequence

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

    def is_padding(self) -> bool:
        """ParlAI's test for a batch's padding row (no example: past the end of the data)."""
        return is_padding(self)

    def targets(self) -> list[str]:
        """The answers this message is judged against (labels, else eval_labels); one answer given as a str
        is one answer, not its characters."""
        found = self.get(LABELS) or self.get(EVAL_LABELS) or []
        return [found] if isinstance(found, str) else list(found)


def _caller() -> str:
    """Where the code that called a read-only message's (or list's) changing method stands: "observe() at
    agent.py:12", naming the user's line in a one-line error; past the standard library's frames (a
    ``random.shuffle`` of the candidates names the line calling it)."""
    frame = sys._getframe(2)  # 0: here, 1: _refuse, 2: the caller
    stdlib = os.path.dirname(os.__file__)
    while frame.f_back is not None and os.path.dirname(frame.f_code.co_filename) == stdlib:
        frame = frame.f_back
    return f"{frame.f_code.co_name}() at {os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


class FrozenList(list):
    """A list value of a :class:`FrozenMessage` (its labels, candidates): read-only as the message is, so that
    shuffling an observation's candidates in place cannot change the teacher's data for later epochs."""

    __slots__ = ()

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ReplyError(f"{_caller()}: this list belongs to a shared, read-only message (a teacher serves the same "
                         "object every epoch): copy it first, e.g. list(observation['label_candidates']), then "
                         "change the copy")

    __setitem__ = __delitem__ = __iadd__ = __imul__ = _refuse  # type: ignore[assignment]
    append = extend = insert = pop = remove = clear = sort = reverse = _refuse  # type: ignore[assignment]

    def copy(self) -> list:  # type: ignore[override]
        return list(self)

    def __reduce__(self) -> tuple:  # a plain list alone; within a pickled FrozenMessage, read-only again
        return (list, (list(self),))


class FrozenMessage(Message):
    """A Message that cannot be changed, nor can its lists: what a teacher serves (one prepared object per
    example, handed to every epoch and every row that reads that example, with no copy per act).

    An agent that wants to add or change keys of an observation copies it first, ``Message(obs)``, as
    :meth:`accelbatch.agents.TorchAgent.observe` does, and a list it changes, ``list(obs[key])``. ``copy()``
    gives a plain, changeable Message (whose lists are still the shared ones).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for key, value in dict.items(self):
            if type(value) is list:
                dict.__setitem__(self, key, FrozenList(value))

    def _refuse(self, *args: Any, **kwargs: Any) -> None:
        raise ReplyError(f"{_caller()}: this message is shared and read-only (a teacher serves the same object "
                         "every epoch): copy it first with Message(observation), then change the copy")

    __setitem__ = __delitem__ = __ior__ = _refuse  # type: ignore[assignment]
    pop = popitem = setdefault = update = clear = _refuse  # type: ignore[assignment]

    def __reduce__(self) -> tuple:  # pickled to a data process it stays read-only, as it is served here
        return (FrozenMessage, (dict(self),))

    def __deepcopy__(self, memo: dict) -> Message:  # a deep copy is the agent's own: changeable
        return Message(copy.deepcopy(dict(self), memo))


BATCH_PADDING = "batch_padding"  # ParlAI's mark of a padding row, which accelbatch's padding rows carry


def is_padding(message: dict | None) -> bool:
    """True for a row with no example in it (None, or no text and no labels: past the end of the data; a row
    marked ``batch_padding``, as accelbatch's and ParlAI's padding rows are, has neither)."""
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


def has_surrogate(msg: dict) -> bool:
    """Whether a message's text or answers hold a lone surrogate: one search over them joined, in C. A teacher's
    turns are checked once, at load (2-3 us a turn, 20-24 with 100 candidates), never on the step's path."""
    text = msg.get(TEXT)
    parts = [text] if isinstance(text, str) else []
    for key in (LABELS, EVAL_LABELS, LABEL_CANDIDATES):
        value = msg.get(key)
        if isinstance(value, (list, tuple)):
            parts.extend(v for v in value if isinstance(v, str))
    return _SURROGATE.search("\n".join(parts)) is not None


def not_unicode(found: tuple[str, int, str]) -> str:
    """What :func:`lone_surrogate` found, in words (an error's first part)."""
    field, index, char = found
    return f"{field} is not valid Unicode: a lone surrogate \\u{ord(char):04x} at character {index}"


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


# the fields that list choices: a str there is one choice, never several (ParlAI iterates it letter by letter)
CANDIDATE_FIELDS = (LABEL_CANDIDATES, TEXT_CANDIDATES)


def str_candidates(key: str, value: Any) -> str | None:
    """The one-line refusal of ``value`` given as a bare str for a :data:`CANDIDATE_FIELDS` ``key``; None for
    anything else. A str label is one answer (ParlAI's convenience); a str of candidates is no list of them."""
    if key not in CANDIDATE_FIELDS or not isinstance(value, str):
        return None
    parts = [p for p in value.split("|") if p] if "|" in value else [value]
    return (f"{key!r} is str {value[:40]!r}; give a list of str, e.g. {key!r}: {parts[:3]!r} (one str is one "
            "candidate, which no model can rank)")


def _str_list(value: Any, key: str, where: str) -> list[str]:
    refused = str_candidates(key, value)
    if refused is not None:
        raise TypeError(f"{where}: {refused}")
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


class ReplyError(TypeError, ValueError):
    """An agent broke its contract: act()/batch_act() (a reply that is not a Message, or not one reply per
    observation), or a TorchAgent method returning the wrong kind of value (vectorize, batchify, build_model,
    the model's forward rows): the user's code to fix, told in one line naming the class and method. The
    command line takes it as bad input (exit 2), also when a data worker or another process raised it."""

    usage_error = True


class AgentMethodMissing(ReplyError, NotImplementedError):
    """A method a subclass must define (a TorchAgent's build_model, batchify, replies) is missing: one line
    naming the subclass and the method; still a NotImplementedError for code that catches that."""


def refuse_non_messages(agent: Any, method: str, replies: Sequence[Any]) -> None:
    """A :class:`ReplyError` naming ``agent``'s class and ``method`` when a reply is not a Message (a dict) or
    its ``text`` is not a str, which the teacher would otherwise fail on deep in its scoring (that failure is
    left out of the chain)."""
    for row, reply in enumerate(replies):
        if isinstance(reply, dict):
            text = reply.get("text")
            if text is None or isinstance(text, str):
                continue  # the message is built only for a bad reply: this runs on every reply
        where = f" for row {row}" if method.startswith(("batch_act", "replies")) else ""
        if not isinstance(reply, dict):
            raise ReplyError(f"{type(agent).__name__}.{method} returned {reply_kind(reply)}{where}: it must "
                             "return a Message (a dict such as {'text': ...})"
                             + (", one per observation" if where else "")) from None
        raise ReplyError(f"{type(agent).__name__}.{method} returned a reply{where} whose 'text' is "
                         f"{reply_kind(text)} {text!r:.60}: a reply's text is a str (leave it out to say "
                         "nothing)") from None


def refuse_unobserved(agents: Sequence[Any], observed: Sequence[Any]) -> None:
    """A :class:`ReplyError` when a row's agent's observe() returned None (an older ParlAI style that only
    stores ``self.observation``): batch_act() is given what observe() returns, as in ParlAI's BatchWorld."""
    if None in observed:  # a scan in C: this runs on every batched parley
        row = list(observed).index(None)
        raise ReplyError(f"{type(agents[row]).__name__}.observe() returned None for row {row}: return the "
                         "observation (ParlAI's BatchWorld: agents return what they observed), which batch_act() "
                         "is given")


def checked_batch_act(agent: Any, observations: list[Message]) -> list[Message]:
    """``agent.batch_act(observations)``, refused when it does not return one reply per observation (the
    rows past the shortest would go unscored, silently)."""
    replies = agent.batch_act(observations)  # type: ignore[attr-defined]
    if type(replies) is not list:  # a list is what the world indexes; any other iterable of replies becomes one
        if isinstance(replies, (dict, str)) or not hasattr(replies, "__iter__"):
            raise ReplyError(f"{type(agent).__name__}.batch_act() returned {reply_kind(replies)}: it must "
                             "return a list (or iterable) of replies, one Message (a dict) per observation")
        replies = list(replies)
    if len(replies) != len(observations):
        raise ReplyError(f"{type(agent).__name__}.batch_act returned {len(replies)} replies for "
                         f"{len(observations)} observations: it must return one reply per observation")
    return replies


def reply_kind(value: Any) -> str:
    """How a bad reply is named: None or its type's name."""
    return "None" if value is None else type(value).__name__


def checked_replies(agent: Any, produced: Any, rows: int) -> list:
    """What a TorchAgent's ``replies()`` returned for ``rows`` rows of outputs, as a list, refused in one
    :class:`ReplyError` naming it when it is not one reply dict per row (zip would score a subset silently)."""
    if isinstance(produced, (dict, str)) or not hasattr(produced, "__iter__"):
        raise ReplyError(f"{type(agent).__name__}.replies() returned {reply_kind(produced)}: it must return a "
                         "list of reply dicts, one per row of outputs")
    produced = list(produced)
    if len(produced) != rows:
        raise ReplyError(f"{type(agent).__name__}.replies returned {len(produced)} replies for {rows} rows of "
                         "outputs: it must return one reply dict per row")
    refuse_non_messages(agent, "replies()", produced)
    return produced
