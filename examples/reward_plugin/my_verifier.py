"""Example reward plugin: the share of required keywords a response mentions.

Registered through config, no arlo code changed:

    reward:
      plugins:
        - name: keyword_recall
          target: examples.reward_plugin.my_verifier:keyword_recall

The reference lists the keywords, comma-separated ("photosynthesis, chlorophyll, light").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import Verdict

MAX_KEYWORDS = 64


def keyword_recall(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    """Fraction of the reference's comma-separated keywords found in the response (whole words).

    metadata: {"case_sensitive": bool} (default false). Components: recall, num_keywords.
    A reference without keywords is a broken task: raise, so the item is an ERROR, not a 0.
    """
    keywords = [k.strip() for k in reference.split(",") if k.strip()]
    if not keywords:
        raise ValueError("reference lists no keywords")
    if len(keywords) > MAX_KEYWORDS:
        raise ValueError(f"reference lists {len(keywords)} keywords; at most {MAX_KEYWORDS}")
    case_sensitive = metadata.get("case_sensitive", False)
    if not isinstance(case_sensitive, bool):
        raise ValueError(f"metadata case_sensitive must be true or false, got {case_sensitive!r}")
    flags = 0 if case_sensitive else re.IGNORECASE
    found = sum(1 for k in keywords if re.search(rf"\b{re.escape(k)}\b", response, flags))
    recall = found / len(keywords)
    return Verdict(reward=recall, components={"recall": recall, "num_keywords": float(len(keywords))})
