"""Hashed word ids with caches: what the rankers' ``vectorize`` spends its time on, done once per word.

:func:`tokenize` and :func:`hash_tokens` are the definition (lower case, punctuation to spaces, split; each word
to ``1 + crc32(word) % (vocab_size - 1)``, 0 being padding). :class:`HashDictionary` gives the same ids
faster: a word's id is computed the first time the word is met and read from a dict afterwards, and short
texts that recur (label candidates: a fixed set in most tasks) are kept whole. Both caches are bounded
(``max_words``, ``max_texts``): past the bound, new entries are computed every time and not stored, so an
open vocabulary costs time, never unbounded memory. The ids never depend on the caches.
"""

from __future__ import annotations

import zlib
from typing import Sequence

_WORD = str.maketrans({c: " " for c in ".,?!;:\"'()"})

MAX_WORDS = 1 << 20  # cached word ids (~100 bytes each with the word: about 100 MB at the bound)
MAX_TEXTS = 1 << 16  # cached short texts


def tokenize(text: str) -> list[str]:
    """Lower-cased words, with ``.,?!;:"'()`` taken as spaces."""
    return text.lower().translate(_WORD).split()


def hash_tokens(tokens: Sequence[str], vocab_size: int) -> list[int]:
    """Stable feature hashing of words into [1, vocab_size) (0 is padding)."""
    return [1 + zlib.crc32(t.encode()) % (vocab_size - 1) for t in tokens]


class _WordIds(dict):
    """word -> id; a missing word's id is computed, and stored while fewer than ``limit`` are."""

    def __init__(self, vocab_size: int, limit: int):
        super().__init__()
        self.modulus = vocab_size - 1
        self.limit = limit

    def __missing__(self, word: str) -> int:
        found = 1 + zlib.crc32(word.encode()) % self.modulus
        if len(self) < self.limit:
            self[word] = found
        return found


class HashDictionary:
    """Word ids of :func:`hash_tokens` over :func:`tokenize`, with bounded caches (see the module docstring).

    One is held per agent and shared with its clones (``share()``); data workers get a copy each."""

    def __init__(self, vocab_size: int, max_words: int = MAX_WORDS, max_texts: int = MAX_TEXTS):
        if vocab_size < 2:
            raise ValueError(f"vocab_size must be at least 2 (0 is padding), got {vocab_size}")
        self.vocab_size = vocab_size
        self.max_texts = max_texts
        self._words = _WordIds(vocab_size, max_words)
        self._texts: dict[tuple[str, int], tuple[int, ...]] = {}

    def ids(self, tokens: Sequence[str]) -> list[int]:
        """``hash_tokens(tokens, vocab_size)``."""
        return list(map(self._words.__getitem__, tokens))

    def text_ids(self, text: str, keep_last: int = 0) -> list[int]:
        """Ids of ``tokenize(text)``, only its last ``keep_last`` words when ``keep_last > 0``."""
        tokens = text.lower().translate(_WORD).split()
        if 0 < keep_last < len(tokens):
            tokens = tokens[-keep_last:]
        return list(map(self._words.__getitem__, tokens))

    def short_text_ids(self, text: str, keep_first: int) -> list[int]:
        """Ids of the first ``keep_first`` words of ``tokenize(text)``, the whole result cached per text
        (for texts that recur, such as label candidates)."""
        key = (text, keep_first)
        found = self._texts.get(key)
        if found is None:
            found = tuple(map(self._words.__getitem__, text.lower().translate(_WORD).split()[:keep_first]))
            if len(self._texts) < self.max_texts:
                self._texts[key] = found
        return list(found)

    def cached(self) -> tuple[int, int]:
        """(words, texts) held in the caches."""
        return len(self._words), len(self._texts)

    def __getstate__(self) -> dict:
        """Pickled (to data workers, hogwild processes) without the caches: each process fills its own."""
        state = dict(self.__dict__)
        state["_words"] = _WordIds(self.vocab_size, self._words.limit)
        state["_texts"] = {}
        return state
