"""The verifier contract: a plain function, so it runs the same in-process and behind gRPC."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True, slots=True)
class Verdict:
    reward: float
    """The scalar reward the trainer uses."""
    components: Mapping[str, float] = field(default_factory=dict)
    """Named parts of the reward (logged, and available to shaped objectives)."""


class RewardFn(Protocol):
    """Scores one response. Raising is fine: the caller reports it as an ERROR, never as 0."""

    def __call__(self, response: str, reference: str, metadata: Mapping[str, Any]) -> Verdict: ...


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardSpec:
    """A verifier under its registered name, with the description ListRewardFunctions shows."""

    name: str
    fn: RewardFn
    description: str
