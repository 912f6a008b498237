"""Reading dialogue files: JSONL and ParlAI's text format, line by line, lazily.

Both formats hold one example per line; ``episode_done`` closes an episode. A malformed line raises
:class:`DataFileError` naming the file and line; nothing is skipped silently (blank lines are the only lines
not read as examples; ParlAI's format has no comment lines). Files are UTF-8; a byte-order mark at the start
of a file is not data (read as Python's ``utf-8-sig``), and a line ends in ``\\r\\n``, ``\\n`` or, on the last
line, a lone ``\\r`` (a file whose lines end in lone ``\\r`` is refused, naming the conversion; a ``\\r`` inside a
ParlAI-format value is kept, as ParlAI's reader keeps it).

JSONL: ``{"text": "...", "labels": ["..."], "episode_done": true}`` per line; a line without
``episode_done`` is an episode of its own.
ParlAI: ``text:hello<TAB>labels:hi|hey<TAB>episode_done:True`` per line, read as ParlAI's ``str_to_msg``
reads it: every tab separates fields, ``|`` separates the items of a list field (labels, eval_labels,
label_candidates, text_candidates), and in each value the two characters ``\\t`` are a tab, ``\\n`` a
newline and ``__PIPE__`` a ``|`` (what ParlAI's ``msg_to_str`` writes for them); nothing else is an
escape (a backslash is itself). A line without ``episode_done:True`` continues its episode, as does one with
``episode_done:False`` (ParlAI's reader takes any value, False too, as True: it would end the episode there).
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import re
import stat
from array import array
from dataclasses import dataclass
from typing import BinaryIO, Iterator

import numpy as np

from accelbatch.messages import EPISODE_DONE, Message, as_message, lone_surrogate, not_unicode

LIST_KEYS = ("labels", "eval_labels", "label_candidates", "text_candidates")


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


class DataFileError(ValueError):
    """A data file cannot be read; the message names the file, the line and what to fix."""


def parse_jsonl_line(line: str, path: str, lineno: int) -> Message:
    """One JSONL line -> Message; raises DataFileError naming path:lineno."""
    text = _strip_line_end(line)  # a string left open ends at the line's end, not at its line break
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        where = "column" if exc.msg.endswith(" at") else "at column"  # "Unterminated string starting at" has its at
        raise DataFileError(f"{path}:{lineno}: not valid JSON ({exc.msg} {where} {exc.colno}); "
                            "each line must be one JSON object") from None
    except RecursionError:
        raise DataFileError(f"{path}:{lineno}: JSON nested too deeply for Python's reader (about 1,000 levels of "
                            "[ or {); flatten the line's values") from None
    except ValueError as exc:  # a number past Python's limit of digits (sys.get_int_max_str_digits)
        raise DataFileError(f"{path}:{lineno}: not readable as JSON ({str(exc).split(';')[0]}); write such a "
                            "value as a string") from None
    # more keys written than read: a second one replaced a first (one scan of the line for json.dumps' '": ',
    # a search where a quote is followed by whitespace, which may stand before a colon)
    written = len(_KEY_COLON.findall(text)) if '" ' in text or '"\t' in text else text.count('":')
    if isinstance(obj, dict) and written > len(obj):
        _refuse_repeated_keys(text, path, lineno)
    # a line decoded from UTF-8 holds no surrogate: only a JSON escape \ud800-\udfff makes one, so only a line
    # with such an escape has its strings searched (the search costs more than the parse)
    if _SURROGATE_ESCAPE.search(line):
        bad = lone_surrogate(obj)
        if bad is not None:
            raise DataFileError(f"{path}:{lineno}: {not_unicode(bad)} (half of a UTF-16 pair, e.g. an emoji cut in "
                                "two); write the whole character or remove the escape")
    return _checked(obj, path, lineno, episode_done_default=True)


_KEY_COLON = re.compile(r'"[ \t]*:')


def _refuse_repeated_keys(line: str, path: str, lineno: int) -> None:
    """A DataFileError when an object of the line gives a key twice (json keeps the last silently); the
    parse again with each object's pairs is only for lines that may have one (a key-like '\":' in a value,
    nested objects)."""
    def pairs(items: list[tuple[str, object]]) -> dict[str, object]:
        keys = [key for key, _ in items]
        for key in keys:
            if keys.count(key) > 1:
                raise DataFileError(f"{path}:{lineno}: the key {key!r} is given twice; JSON keeps only the last, so "
                                    "give each key once")
        return dict(items)
    json.loads(line, object_pairs_hook=pairs)


def parse_parlai_line(line: str, path: str, lineno: int) -> Message:
    """One ParlAI text-format line (with or without its line ending) -> Message; raises DataFileError
    naming path:lineno."""
    obj: dict[str, object] = {}
    for field_no, part in enumerate(_strip_line_end(line).split("\t"), start=1):
        if not part:
            continue
        key, sep, value = part.partition(":")
        if not sep or not key:
            raise DataFileError(f"{path}:{lineno}: field {field_no} {part[:40]!r} is not 'key:value'; "
                                "fields are tab-separated, e.g. text:hello<TAB>labels:hi")
        if key in obj:  # a dict keeps one of the two: the other would be dropped silently
            raise DataFileError(f"{path}:{lineno}: field {field_no} gives {key}: a second time; give each field "
                                "once (a tab inside a value is written as the two characters \\t)")
        if key in LIST_KEYS:
            obj[key] = [_unescape(v) for v in value.split("|")]
        elif key == EPISODE_DONE:
            if value not in ("True", "False", "true", "false"):
                raise DataFileError(f"{path}:{lineno}: episode_done must be True or False, got {value!r}")
            obj[key] = value.lower() == "true"
        else:
            obj[key] = _unescape(value)
    # as ParlAI's dialog teacher: every line of the format is an exchange, its text and its answers
    missing = [f"{key}:" for key, present in (("text", "text" in obj),
                                               ("labels", "labels" in obj or "eval_labels" in obj)) if not present]
    if obj and missing:
        raise DataFileError(f"{path}:{lineno}: no {' and no '.join(missing)} field; every line of a ParlAI-format "
                            "file needs both, e.g. text:hello<TAB>labels:hi")
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


# ParlAI's escapes in a field's value (what msg_to_str writes for a tab, a newline and a pipe)
_ESCAPES = {"\\t": "\t", "\\n": "\n", "__PIPE__": "|"}
_ESCAPE = re.compile("|".join(re.escape(e) for e in _ESCAPES))


def _unescape(value: str) -> str:
    """A ParlAI-format value with its escapes replaced, in one left-to-right pass."""
    return _ESCAPE.sub(lambda m: _ESCAPES[m.group()], value)


def _strip_line_end(line: str) -> str:
    """``line`` without its line ending: \\r\\n, \\n or \\r (a CRLF file's last line may lack the \\n)."""
    if line.endswith("\r\n"):
        return line[:-2]
    return line[:-1] if line.endswith(("\n", "\r")) else line


def file_format(path: str) -> str:
    """'jsonl' or 'parlai', from the extension (.jsonl/.json -> jsonl, anything else -> parlai)."""
    return "jsonl" if path.endswith((".jsonl", ".json")) else "parlai"


def _regular(path: str) -> os.stat_result:
    """``path``'s stat (links followed: what is read is the link's target) once it is known to be a regular
    file: a pipe would block the open, and be read once where a streamed file is read on every pass."""
    try:
        info = os.stat(path)
    except OSError as exc:
        raise _refusal(path, exc) from None
    if stat.S_ISDIR(info.st_mode):
        raise _refusal(path, IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR)))
    if not stat.S_ISREG(info.st_mode):
        raise DataFileError(f"{path}: not a regular file (a pipe or device); give a file of the data")
    return info


def _refusal(path: str, exc: OSError) -> DataFileError:
    """The OS's refusal to read ``path`` as one line naming it and the reason."""
    if isinstance(exc, FileNotFoundError):
        return DataFileError(f"{path}: no such file; check the path given to -t")
    if isinstance(exc, IsADirectoryError):
        return DataFileError(f"{path}: is a directory; give a file, or a folder with train/valid/test files")
    return DataFileError(f"{path}: cannot be read ({exc.strerror or exc}); check the file and the path given to -t")


def _open(path: str) -> BinaryIO:
    """``path`` opened to read, a regular file (:func:`_regular`); any refusal is one DataFileError."""
    _regular(path)
    try:
        return open(path, "rb")
    except OSError as exc:  # no permission, a link loop, ...
        raise _refusal(path, exc) from None


def _identity(info: os.stat_result) -> tuple[int, int, int]:
    """What tells a file changed since it was indexed: size, modified time (ns) and inode (a replaced file)."""
    return info.st_size, info.st_mtime_ns, info.st_ino


def _parse(raw: bytes, path: str, lineno: int, fmt: str) -> Message | None:
    """The example on one raw line (None for a blank line); errors name path:lineno."""
    if lineno == 1 and raw.startswith(codecs.BOM_UTF8):  # marks the file as UTF-8: not data
        raw = raw[len(codecs.BOM_UTF8):]
    elif raw.startswith(codecs.BOM_UTF8):
        raise DataFileError(f"{path}:{lineno}: the line starts with a byte-order mark (bytes EF BB BF), which only "
                            "a file's first line may have (files joined together?); remove it")
    stripped = raw.strip()
    if not stripped:
        return None
    try:
        line = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DataFileError(f"{path}:{lineno}: not valid UTF-8 ({exc.reason} at byte {exc.start}); "
                            "save the file as UTF-8") from None
    # a carriage return inside a line: lines ending in a lone \r, or one inside a value (JSON may hold one as
    # whitespace; ParlAI's reader, which splits lines on \n alone, keeps it in the value)
    lone_cr = "\r" in _strip_line_end(line)
    if lone_cr and fmt == "parlai" and _mac_lines(line):
        raise _lone_cr(path, lineno)
    try:
        return (parse_jsonl_line if fmt == "jsonl" else parse_parlai_line)(line, path, lineno)
    except DataFileError as exc:
        if lone_cr and fmt == "jsonl":
            raise _lone_cr(path, lineno) from None
        if fmt == "parlai" and stripped.startswith(b"#"):
            raise DataFileError(f"{exc} (a line starting with '#' is not a comment in the ParlAI format: "
                                "remove it)") from None
        raise


def _mac_lines(line: str) -> bool:
    """Whether a ParlAI-format line holding carriage returns is several lines each ended by a lone \r: two or
    more of its \r-separated parts give a text: field (a \r inside a value leaves one)."""
    return sum(any(f.startswith("text:") for f in part.split("\t")) for part in line.split("\r")) > 1


def _lone_cr(path: str, lineno: int) -> DataFileError:
    return DataFileError(f"{path}:{lineno}: a carriage return (\\r) inside the line: the file's lines end in a lone "
                         "\\r (classic Mac line ends); convert them to \\n (tr '\\r' '\\n' < IN > OUT)")


def iter_examples(path: str, fmt: str | None = None) -> Iterator[tuple[int, int, Message]]:
    """Yield (byte offset, line number, Message) for every example line of ``path``, reading lazily."""
    fmt = fmt or file_format(path)
    with _open(path) as handle:
        offset = 0
        for lineno, raw in enumerate(handle, start=1):
            msg = _parse(raw, path, lineno, fmt)
            if msg is not None:
                yield offset, lineno, msg
            offset += len(raw)


def iter_numbered_episodes(path: str, fmt: str | None = None) -> Iterator[tuple[int, list[Message]]]:
    """Yield (the line its first turn is on, episode) for each episode; an unfinished last episode is closed,
    not dropped."""
    episode: list[Message] = []
    first = 0
    for _, lineno, msg in iter_examples(path, fmt):
        if not episode:
            first = lineno
        episode.append(msg)
        if msg[EPISODE_DONE]:
            yield first, episode
            episode = []
    if episode:
        episode[-1][EPISODE_DONE] = True
        yield first, episode


def iter_episodes(path: str, fmt: str | None = None) -> Iterator[list[Message]]:
    """Yield episodes (lists of Messages); an unfinished last episode is closed, not dropped."""
    return (episode for _, episode in iter_numbered_episodes(path, fmt))


def episode_at(path: str, line: int) -> str:
    """Where an episode of a file is, as a refusal of one of its turns names it."""
    return f"{path}: the episode at line {line}"


def load_numbered_episodes(path: str, fmt: str | None = None) -> list[tuple[int, list[Message]]]:
    """All episodes of a file, each with the line it starts on; an empty file is an error naming it."""
    episodes = list(iter_numbered_episodes(path, fmt))
    if not episodes:
        raise DataFileError(f"{path}: the file holds no examples")
    return episodes


def load_episodes(path: str, fmt: str | None = None) -> list[list[Message]]:
    """All episodes of a file; an empty file is an error naming it."""
    return [episode for _, episode in load_numbered_episodes(path, fmt)]


@dataclass(frozen=True)
class FileIndex:
    """Where each episode of a file starts (byte offset, line number) and its turns: read on demand."""

    path: str
    fmt: str
    offsets: np.ndarray
    lines: np.ndarray
    turns: np.ndarray
    size: int
    identity: tuple[int, int, int] = (-1, -1, -1)  # _identity() of the file indexed; -1s: not checked

    @classmethod
    def build(cls, path: str, fmt: str | None = None) -> "FileIndex":
        """One pass over the file (every line parsed, so a malformed one is named before any training)."""
        fmt = fmt or file_format(path)
        identity = _identity(_regular(path))  # before the pass: a change during it is caught by read()
        offsets, lines, turns = array("q"), array("q"), array("q")
        open_episode = False
        for offset, lineno, msg in iter_examples(path, fmt):
            if not open_episode:
                offsets.append(offset)
                lines.append(lineno)
                turns.append(0)
            turns[-1] += 1
            open_episode = not msg[EPISODE_DONE]
        if not turns:
            raise DataFileError(f"{path}: the file holds no examples")
        as_np = [np.frombuffer(a, dtype=np.int64).copy() for a in (offsets, lines, turns)]
        return cls(path, fmt, as_np[0], as_np[1].astype(np.int32), as_np[2].astype(np.int32), identity[0], identity)

    def read(self, episode: int) -> list[Message]:
        """The turns of one episode (the last one closes it)."""
        out: list[Message] = []
        want, lineno = int(self.turns[episode]), int(self.lines[episode])
        with _open(self.path) as handle:
            self._check_unchanged(os.fstat(handle.fileno()))
            handle.seek(int(self.offsets[episode]))
            for raw in handle:
                msg = _parse(raw, self.path, lineno, self.fmt)
                lineno += 1
                if msg is not None:
                    out.append(msg)
                    if len(out) == want:
                        break
        if len(out) != want:
            raise DataFileError(f"{self.path}: changed while being read (episode at line {self.lines[episode]} "
                                "has fewer turns than when it was indexed); do not edit a file during a run")
        out[-1][EPISODE_DONE] = True
        return out

    def _check_unchanged(self, info: os.stat_result) -> None:
        """Refuse a file that is not the one indexed: its offsets would land on other data, or mid-line."""
        if self.identity != (-1, -1, -1) and _identity(info) != self.identity:
            raise DataFileError(f"{self.path} changed while the run read it (size/modified time differ from when "
                                "it was indexed); keep a run's data file unchanged until the run ends")
