"""Exact match after normalising whitespace."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from services.reward.verifiers.base import Verdict


def normalize(text: str) -> str:
    """Strips and collapses every run of whitespace to one space."""
    return " ".join(text.split())


def exact_match(response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict:
    score = 1.0 if normalize(response) == normalize(reference) else 0.0
    return Verdict(reward=score, components={"exact_match": score})
