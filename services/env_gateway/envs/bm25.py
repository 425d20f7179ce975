"""Okapi BM25 over a small document set, in pure Python: a few dozen to a few thousand
documents need no search engine, and the ranking is deterministic and easy to test."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Sequence

_WORD = re.compile(r"[a-z0-9]+")
STOPWORDS = frozenset(
    "a an and are as at be by did do does for from had has have how in is it its of on or the to was "
    "were what when where which who whom why with".split())


def tokenize(text: str) -> list[str]:
    return [w for w in _WORD.findall(text.lower()) if w not in STOPWORDS]


class BM25Index:
    def __init__(self, texts: Sequence[str], *, k1: float = 1.5, b: float = 0.75) -> None:
        self._k1, self._b = k1, b
        self._tfs = [Counter(tokenize(t)) for t in texts]
        self._lengths = [sum(tf.values()) for tf in self._tfs]
        self._avg_length = (sum(self._lengths) / len(texts)) if texts else 0.0
        df = Counter(term for tf in self._tfs for term in tf)
        n = len(texts)
        self._idf = {term: math.log(1 + (n - f + 0.5) / (f + 0.5)) for term, f in df.items()}

    def __len__(self) -> int:
        return len(self._tfs)

    def scores(self, query: str) -> list[float]:
        terms = set(tokenize(query))
        out = []
        for tf, length in zip(self._tfs, self._lengths, strict=True):
            norm = self._k1 * (1 - self._b + self._b * length / (self._avg_length or 1.0))
            out.append(sum(self._idf[t] * tf[t] * (self._k1 + 1) / (tf[t] + norm) for t in terms if t in tf))
        return out

    def search(self, query: str, k: int) -> list[tuple[int, float]]:
        """The best `k` documents as (index, score), best first; documents that share no term are left out."""
        ranked = sorted(((s, -i) for i, s in enumerate(self.scores(query)) if s > 0), reverse=True)[:k]
        return [(-i, s) for s, i in ranked]
