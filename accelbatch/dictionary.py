"""Hashed word ids with caches: what the rankers' ``vectorize`` spends its time on, done once per word.

:func:`tokenize` and :func:`hash_tokens` are the definition (lower case, punctuation to spaces, split; each word
to ``1 + crc32(word) % (vocab_size - 1)``, 0 being padding). :class:`HashDictionary` gives the same ids
faster: a word's id is computed the first time the word is met and read from a dict afterwards, and texts
are kept whole (label candidates recur in every batch; every text recurs each epoch). Both caches are
bounded (``max_words`` words, ``max_ids`` ids held for texts): past the bound, new entries are computed every
time and not stored, so an open vocabulary costs time, never unbounded memory. The ids never depend on the
caches.
"""

from __future__ import annotations

import zlib
from typing import Sequence

_WORD = str.maketrans({c: " " for c in ".,?!;:\"'()"})

MAX_WORDS = 1 << 18  # cached word ids (~120 bytes each with the word: about 30 MB at the bound)
MAX_IDS = 1 << 22  # ids held by the text caches (8 bytes each, plus the texts)


def tokenize(text: str) -> list[str]:
    """Lower-cased words, with ``.,?!;:"'()`` taken as spaces."""
    return text.lower().translate(_WORD).split()


def word_id(word: str, modulus: int) -> int:
    """A word's id: ``1 + crc32(word) % modulus`` (``modulus`` = vocab_size - 1; 0 is padding)."""
    return 1 + zlib.crc32(word.encode()) % modulus


def hash_tokens(tokens: Sequence[str], vocab_size: int) -> list[int]:
    """Stable feature hashing of words into [1, vocab_size) (0 is padding)."""
    return [word_id(t, vocab_size - 1) for t in tokens]


class _WordIds(dict):
    """word -> id; a missing word's id is computed, and stored while fewer than ``limit`` are."""

    def __init__(self, vocab_size: int, limit: int):
        super().__init__()
        self.modulus = vocab_size - 1
        self.limit = limit

    def __missing__(self, word: str) -> int:
        found = word_id(word, self.modulus)
        if len(self) < self.limit:
            self[word] = found
        return found


class HashDictionary:
    """Word ids of :func:`hash_tokens` over :func:`tokenize`, with bounded caches (see the module docstring).

    One is held per agent and shared with its clones (``share()``); data workers get a copy each."""

    def __init__(self, vocab_size: int, max_words: int = MAX_WORDS, max_ids: int = MAX_IDS):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2 (0 is padding), got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_ids = max_ids
        self.held_ids = 0  # ids held by the text caches (a text counts its ids + 1)
        self._words = _WordIds(vocab_size, max_words)
        self._texts: dict[int, dict[str, tuple[int, ...]]] = {}  # keep (+last words, -first words) -> cache

    def text_ids(self, text: str, keep_last: int = 0) -> list[int]:
        """Ids of ``tokenize(text)``, only its last ``keep_last`` words when ``keep_last > 0``; cached per
        text (a text met again, as in every epoch after the first, is not tokenized again)."""
        cache = self._cache(max(0, keep_last))
        found = cache.get(text)
        if found is None:
            tokens = text.lower().translate(_WORD).split()
            if 0 < keep_last < len(tokens):
                tokens = tokens[-keep_last:]
            found = self._store(cache, text, tokens)
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
                found = self._store(cache, text, text.lower().translate(_WORD).split()[:keep_first])
            out.append(list(found))
        return out

    def _cache(self, key: int) -> dict[str, tuple[int, ...]]:
        cache = self._texts.get(key)
        if cache is None:
            cache = self._texts[key] = {}
        return cache

    def _store(self, cache: dict[str, tuple[int, ...]], text: str, tokens: list[str]) -> tuple[int, ...]:
        found = tuple(map(self._words.__getitem__, tokens))
        if self.held_ids + len(found) < self.max_ids:
            cache[text] = found
            self.held_ids += len(found) + 1
        return found

    def cached(self) -> tuple[int, int]:
        """(words, texts) held in the caches."""
        return len(self._words), sum(map(len, self._texts.values()))

    def __getstate__(self) -> dict:
        """Pickled (to data workers, hogwild processes) without the caches: each process fills its own."""
        state = dict(self.__dict__)
        state.update(_words=_WordIds(self.vocab_size, self._words.limit), _texts={}, held_ids=0)
        return state
