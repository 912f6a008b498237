"""Hashed word ids with caches: what the rankers' ``vectorize`` spends its time on, done once per word.

:func:`tokenize` and :func:`hash_tokens` are the definition (lower case, punctuation to spaces, split; each word
to ``1 + crc32(word) % (vocab_size - 1)``, 0 being padding). :class:`HashDictionary` gives the same ids
faster: an ASCII text is lower-cased, split and hashed as bytes with every step in C (``map`` over
``zlib.crc32``: no Python code and no lookup per word), another text's words go through a word -> id
cache, and texts are kept whole (label candidates recur in every batch; every text recurs each epoch). Both
caches are bounded (``max_words`` words; texts up to ``max_ids`` ids, each text also counting its own cost
as :data:`TEXT_COST_IDS` ids and its characters as one id per :data:`CHARS_PER_ID`, so the bound is one of
memory however short the texts, or long ones truncated to few ids): past it, new entries are
computed every time and not stored, so an open vocabulary costs time, never unbounded memory. The ids never
depend on the caches.
"""

from __future__ import annotations

import zlib
from typing import Any, Sequence

_WORD = str.maketrans({c: " " for c in ".,?!;:\"'()"})
# the same on ASCII bytes, plus the separators str.split() takes as spaces and bytes.split() does not
_ASCII_WORD = bytes.maketrans(b".,?!;:\"'()\x1c\x1d\x1e\x1f", b" " * 14)

MAX_WORDS = 1 << 18  # cached word ids (~120 bytes each with the word: about 30 MB at the bound)
MAX_IDS = 1 << 22  # what the text caches hold, in ids (~13 bytes each): about 55 MB at the bound
TEXT_COST_IDS = 10  # a cached text's own cost (its key and tuple, ~135 bytes) counted in ids
CHARS_PER_ID = 13  # the key's characters (a byte each for ASCII) counted as ids: a conversation's history of
# 100,000 characters truncated to 256 ids holds 100 KB, not the 3.5 KB of its ids


def tokenize(text: str) -> list[str]:
    """Lower-cased words, with ``.,?!;:"'()`` taken as spaces."""
    return text.lower().translate(_WORD).split()


def word_id(word: str, modulus: int) -> int:
    """A word's id: ``1 + crc32(word) % modulus`` (``modulus`` = vocab_size - 1; 0 is padding)."""
    return 1 + zlib.crc32(word.encode()) % modulus


def hash_tokens(tokens: Sequence[str], vocab_size: int) -> list[int]:
    """Stable feature hashing of words into [1, vocab_size) (0 is padding)."""
    return [word_id(t, vocab_size - 1) for t in tokens]


class HashDictionary:
    """Word ids of :func:`hash_tokens` over :func:`tokenize`, with bounded caches (see the module docstring).

    One is held per agent and shared with its clones (``share()``); data workers get a copy each."""

    def __init__(self, vocab_size: int, max_words: int = MAX_WORDS, max_ids: int = MAX_IDS):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2 (0 is padding), got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_words = max_words
        self.max_ids = max_ids
        self.held_ids = 0  # held by the text caches, in ids (a text counts its ids + TEXT_COST_IDS)
        self._words: dict[str, int] = {}  # words of non-ASCII texts
        self._texts: dict[int, dict[str, tuple[int, ...]]] = {}  # keep (+last words, -first words) -> cache
        # id - 1 -> id: the cached tuples share one int object per id (8 bytes a word held, not 36)
        self._id_objects = list(range(1, vocab_size))

    def text_ids(self, text: str, keep_last: int = 0) -> list[int]:
        """Ids of ``tokenize(text)``, only its last ``keep_last`` words when ``keep_last > 0``; cached per
        text (a text met again, as in every epoch after the first, is not tokenized again)."""
        cache = self._cache(max(0, keep_last))
        found = cache.get(text)
        if found is None:
            found = self._lines_ids(text) if "\n" in text else self._ids(text)
            if 0 < keep_last < len(found):
                found = found[-keep_last:]
            self._store(cache, text, found)
        return list(found)

    def text_length(self, text: str, keep_last: int = 0) -> int:
        """``len(self.text_ids(text, keep_last))``, from the same cache (no list made)."""
        found = self._cache(max(0, keep_last)).get(text)
        return len(found) if found is not None else len(self.text_ids(text, keep_last))

    def short_texts_ids(self, texts: Sequence[str], keep_first: int) -> list[list[int]]:
        """Ids of the first ``keep_first`` words of ``tokenize(text)`` for each of ``texts`` (texts that recur,
        such as label candidates), cached per text."""
        cache = self._cache(-1 - max(0, keep_first))
        get, out = cache.get, []
        for text in texts:
            found = get(text)
            if found is None:
                found = self._ids(text)[:keep_first]
                self._store(cache, text, found)
            out.append(list(found))
        return out

    def _cache(self, key: int) -> dict[str, tuple[int, ...]]:
        cache = self._texts.get(key)
        if cache is None:
            cache = self._texts[key] = {}
        return cache

    def _ids(self, text: str) -> tuple[int, ...]:
        """The id of each word of ``tokenize(text)``."""
        if text.isascii():  # bytes.lower, translate and split give each word's UTF-8 bytes: what word_id hashes
            words = text.encode().lower().translate(_ASCII_WORD).split()
            return tuple(map(self._id_objects.__getitem__, map((self.vocab_size - 1).__rmod__, map(zlib.crc32, words))))
        return tuple(map(self._word_id, tokenize(text)))

    def _lines_ids(self, text: str) -> tuple[int, ...]:
        """``_ids`` of a text of several lines (a conversation's history, one turn a line): each line's ids
        from the cache of whole texts, joined (no word spans a line break), so a turn already met is not
        hashed again as the history grows."""
        lines, out = self._cache(0), []
        for line in text.split("\n"):
            ids = lines.get(line)
            if ids is None:
                ids = self._ids(line)
                self._store(lines, line, ids)
            out += ids
        return tuple(out)

    def _store(self, cache: dict[str, tuple[int, ...]], text: str, ids: tuple[int, ...]) -> None:
        cost = len(ids) + TEXT_COST_IDS + len(text) // CHARS_PER_ID
        if self.held_ids + cost <= self.max_ids:
            cache[text] = ids
            self.held_ids += cost

    def _word_id(self, word: str) -> int:
        """A word's id, stored while fewer than ``max_words`` are."""
        found = self._words.get(word)
        if found is None:
            found = self._id_objects[word_id(word, self.vocab_size - 1) - 1]
            if len(self._words) < self.max_words:
                self._words[word] = found
        return found

    def cached(self) -> tuple[int, int]:
        """(words, texts) held in the caches."""
        return len(self._words), sum(map(len, self._texts.values()))

    def __getstate__(self) -> dict:
        """Pickled (to data workers, hogwild processes) without the caches: each process fills its own."""
        state = dict(self.__dict__)
        state.update(_words={}, _texts={}, held_ids=0)
        return state


class SharedDictionary:
    """Mixin for an agent whose clones (the rows of a batch) look words up in one :class:`HashDictionary`,
    so its caches fill once for all of them: ``self.dictionary`` of ``dictionary_size`` ids, made by the
    first agent and handed to its clones by ``share()``. Put it before the agent class in the bases."""

    dictionary_size = 8192

    def __init__(self, opts: Any, shared: dict[str, Any] | None = None):
        super().__init__(opts, shared)  # type: ignore[call-arg]
        found = shared.get("dictionary") if shared else None
        self.dictionary: HashDictionary = found if found is not None else HashDictionary(self.dictionary_size)

    def share(self) -> dict[str, Any]:
        shared = super().share()  # type: ignore[misc]
        shared["dictionary"] = self.dictionary
        return shared
