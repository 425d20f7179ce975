"""The rollout core's own view of its backends: plain frozen records and one error family.

The agent loop, the worker and evaluation speak only these; `clients.py` (gRPC) and
tests/support/inprocess.py (the cores joined in process) translate to and from them, so the core never
sees a protobuf or a gRPC status. Every field a backend returns is carried, used today or not
(tools_json, metadata, info): what drops a field here drops it for every later feature.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal


@dataclass(frozen=True, slots=True)
class Message:
    role: str
    content: str
    name: str = ""
    """Tool name, for role "tool"."""


_EMPTY: Mapping[str, Any] = MappingProxyType({})


@dataclass(frozen=True, kw_only=True, slots=True)
class ResetResult:
    session_id: str
    """Names the episode's session in later step/close calls."""
    task_id: str
    observation: tuple[Message, ...]
    tools_json: str = ""
    """The environment's tools as a JSON list of function schemas ("" when it has none)."""
    metadata_json: str = ""
    """Task metadata as a JSON object (reference, tests, regex, any field an environment or dataset
    supplies), passed on verbatim to the reward service's Score ("" when the task has none)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    observation: tuple[Message, ...]
    reward: float = 0.0
    """The environment's own reward for the step (the scorer decides the trained reward)."""
    done: bool = False
    answer: str = ""
    reference: str = ""
    info_json: str = ""
    """The environment's info dict as JSON, untouched."""


ScoreStatus = Literal["ok", "error", "timeout"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScoreResult:
    status: ScoreStatus
    reward: float = 0.0
    components: Mapping[str, float] = field(default_factory=lambda: _EMPTY)
    error: str = ""


class BackendError(Exception):
    """A backend call failed. `code` names the cause the way the backend did (a gRPC status
    name such as "NOT_FOUND" from the gRPC clients); `service` is the backend's name."""

    def __init__(self, service: str, code: str, message: str) -> None:
        super().__init__(f"{service}: {code}: {message}")
        self.service, self.code, self.message = service, code, message


class RetryableError(BackendError):
    """Worth retrying with backoff: the backend may be restarting, overloaded or slow."""


class EpisodeDoesNotFit(BackendError):
    """The run's limits cannot hold the episode (a first prompt longer than the token budget):
    no retry helps, and every episode like it would train nothing. The worker reports it in
    its heartbeat (`RolloutStatus.refused`), and `arlo train`/`demo` stop with the message."""

    def __init__(self, message: str) -> None:
        super().__init__("rollout", "FAILED_PRECONDITION", message)
