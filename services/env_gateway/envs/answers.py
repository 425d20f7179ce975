"""Reading a final answer out of model text, in the canonical form the reward service compares."""

from __future__ import annotations

import re
import string

_INTEGER = re.compile(r"(?<![\d.])-?\d{1,3}(?:,\d{3})+(?![\d])|-?\d+")
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = str.maketrans("", "", string.punctuation)
MAX_ANSWER_CHARS = 1000


def canonical_integer(text: str) -> str:
    """ "007" -> "7", "-0" -> "0", "1,234" -> "1234"; compared as text so 64 KiB of digits is fine."""
    negative = text.startswith("-")
    digits = text.lstrip("-").replace(",", "").lstrip("0") or "0"
    return "-" + digits if negative and digits != "0" else digits


def last_integer(text: str) -> str | None:
    """The last integer written in `text` (the usual place for a final answer), canonical, or None."""
    found = _INTEGER.findall(text)
    return canonical_integer(found[-1]) if found else None


def normalize_text(text: str) -> str:
    """SQuAD-style: lower case, no punctuation or articles, single spaces.

    The environment returns answer and reference in this form, so the reward service's
    exact_match agrees with the environment's own reward.
    """
    text = text.lower().translate(_PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())[:MAX_ANSWER_CHARS]
