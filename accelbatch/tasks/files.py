"""Reading dialogue files: JSONL and ParlAI's text format, line by line, lazily.

Both formats hold one example per line; ``episode_done`` closes an episode. A malformed line raises
:class:`DataFileError` naming the file and line; nothing is skipped silently (blank lines and, in the
ParlAI format, lines starting with ``#`` are the only lines not read as examples).

JSONL: ``{"text": "...", "labels": ["..."], "episode_done": true}`` per line; a line without
``episode_done`` is an episode of its own.
ParlAI: ``text:hello<TAB>labels:hi|hey<TAB>episode_done:True`` per line; ``|`` separates list items,
``\\t``, ``\\n`` and ``\\|`` are escapes; a line without ``episode_done:True`` continues its episode.
"""

from __future__ import annotations

import json
import os
from typing import Iterator

from accelbatch.messages import EPISODE_DONE, Message, as_message

LIST_KEYS = ("labels", "eval_labels", "label_candidates", "text_candidates")


class DataFileError(ValueError):
    """A data file cannot be read; the message names the file, the line and what to fix."""


def parse_jsonl_line(line: str, path: str, lineno: int) -> Message:
    """One JSONL line -> Message; raises DataFileError naming path:lineno."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise DataFileError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno}); "
                            "each line must be one JSON object") from None
    return _checked(obj, path, lineno, episode_done_default=True)


def parse_parlai_line(line: str, path: str, lineno: int) -> Message:
    """One ParlAI text-format line -> Message; raises DataFileError naming path:lineno."""
    obj: dict[str, object] = {}
    for field_no, part in enumerate(_split_unescaped(line.rstrip("\n"), "\t"), start=1):
        if not part:
            continue
        key, sep, value = part.partition(":")
        if not sep or not key:
            raise DataFileError(f"{path}:{lineno}: field {field_no} {part[:40]!r} is not 'key:value'; "
                                "fields are tab-separated, e.g. text:hello<TAB>labels:hi")
        if key in LIST_KEYS:
            obj[key] = [_unescape(v) for v in _split_unescaped(value, "|")]
        elif key == EPISODE_DONE:
            if value not in ("True", "False", "true", "false"):
                raise DataFileError(f"{path}:{lineno}: episode_done must be True or False, got {value!r}")
            obj[key] = value.lower() == "true"
        else:
            obj[key] = _unescape(value)
    return _checked(obj, path, lineno, episode_done_default=False)


def _checked(obj: object, path: str, lineno: int, episode_done_default: bool) -> Message:
    if not isinstance(obj, dict):
        raise DataFileError(f"{path}:{lineno}: expected an object with 'text' and 'labels', "
                            f"got {type(obj).__name__}")
    if "text" not in obj and "labels" not in obj and "eval_labels" not in obj:
        raise DataFileError(f"{path}:{lineno}: example has no 'text' and no 'labels'")
    try:
        msg = as_message(obj, where=f"{path}:{lineno}")
    except TypeError as exc:
        raise DataFileError(str(exc)) from None
    msg.setdefault(EPISODE_DONE, episode_done_default)
    return msg


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts, current, escaped = [], [], False
    for ch in text:
        if escaped:
            current.append("\\" + ch)
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == sep:
            parts.append("".join(current))
            current = []
        else:
            current.append(ch)
    if escaped:
        current.append("\\")
    parts.append("".join(current))
    return parts


def _unescape(text: str) -> str:
    return text.replace("\\t", "\t").replace("\\n", "\n").replace("\\|", "|").replace("\\\\", "\\")


def file_format(path: str) -> str:
    """'jsonl' or 'parlai', from the extension (.jsonl/.json -> jsonl, anything else -> parlai)."""
    return "jsonl" if path.endswith((".jsonl", ".json")) else "parlai"


def iter_examples(path: str, fmt: str | None = None, start_line: int = 1) -> Iterator[tuple[int, Message]]:
    """Yield (line number, Message) for every example line of ``path``, reading lazily.

    Memory stays flat whatever the file size. ``start_line`` skips to a line (for resuming).
    """
    fmt = fmt or file_format(path)
    parse = parse_jsonl_line if fmt == "jsonl" else parse_parlai_line
    if not os.path.exists(path):
        raise DataFileError(f"{path}: no such file; check the path given to -t")
    with open(path, encoding="utf-8") as handle:
        for lineno, line in enumerate(handle, start=1):
            if lineno < start_line:
                continue
            stripped = line.strip()
            if not stripped or (fmt == "parlai" and stripped.startswith("#")):
                continue
            yield lineno, parse(line, path, lineno)


def iter_episodes(path: str, fmt: str | None = None) -> Iterator[list[Message]]:
    """Yield episodes (lists of Messages); an unfinished last episode is closed, not dropped."""
    episode: list[Message] = []
    for _, msg in iter_examples(path, fmt):
        episode.append(msg)
        if msg[EPISODE_DONE]:
            yield episode
            episode = []
    if episode:
        episode[-1][EPISODE_DONE] = True
        yield episode


def load_episodes(path: str, fmt: str | None = None) -> list[list[Message]]:
    """All episodes of a file; an empty file is an error naming it."""
    episodes = list(iter_episodes(path, fmt))
    if not episodes:
        raise DataFileError(f"{path}: the file holds no examples")
    return episodes
