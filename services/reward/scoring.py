"""Scoring one item: run a verifier under a deadline and report an explicit status.

A verifier that raises or hangs yields ERROR or TIMEOUT with the reason, never a silent
0.0: the trainer masks those items instead of learning from a wrong reward.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from arlo.jsonfields import parse_json_object
from services.reward.runner import DeadlineExceeded, DeadlineRunner, RunnerSaturated
from services.reward.verifiers.base import RewardFn, Verdict

MAX_ERROR_CHARS = 2000


class ScoreStatus(enum.Enum):
    OK = "ok"
    ERROR = "error"
    TIMEOUT = "timeout"


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreOutcome:
    status: ScoreStatus
    reward: float = 0.0
    """Meaningful only when status is OK."""
    components: Mapping[str, float] = field(default_factory=dict)
    error: str = ""
    """Why the status is not OK."""


def error(message: str) -> ScoreOutcome:
    return ScoreOutcome(status=ScoreStatus.ERROR, error=message[:MAX_ERROR_CHARS])


def parse_metadata(text: str) -> dict[str, Any]:
    """The verifier's extra arguments: a JSON object, or "" for none. ValueError otherwise."""
    return parse_json_object(text, "metadata_json")


def _finite(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def check_verdict(verdict: Any) -> ScoreOutcome:
    """OK with the verdict's numbers, or ERROR when the verifier returned something unusable."""
    if not isinstance(verdict, Verdict):
        return error(f"verifier returned {type(verdict).__name__}, expected Verdict")
    if not _finite(verdict.reward):
        return error(f"verifier returned a non-finite or non-numeric reward: {verdict.reward!r}")
    bad = [k for k, v in verdict.components.items() if not (isinstance(k, str) and _finite(v))]
    if bad:
        return error(f"verifier returned non-finite or non-numeric components: {bad}")
    return ScoreOutcome(status=ScoreStatus.OK, reward=float(verdict.reward),
                        components={k: float(v) for k, v in verdict.components.items()})


class Scorer:
    """Runs verifiers off the event loop, each with `timeout_s` from the moment it starts."""

    def __init__(self, *, timeout_s: float, runner: DeadlineRunner | None = None) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self.timeout_s = timeout_s
        self.runner = runner if runner is not None else DeadlineRunner()

    async def score(self, fn: RewardFn, response: str, reference: str, metadata: Mapping[str, Any]) -> ScoreOutcome:
        try:
            verdict = await self.runner.run(lambda: fn(response, reference, metadata), self.timeout_s)
        except DeadlineExceeded:
            return ScoreOutcome(status=ScoreStatus.TIMEOUT,
                                error=f"verifier ran past its deadline of {self.timeout_s:g}s")
        except RunnerSaturated as e:
            return error(str(e))
        except Exception as e:
            return error(f"verifier raised {type(e).__name__}: {e}")
        return check_verdict(verdict)
