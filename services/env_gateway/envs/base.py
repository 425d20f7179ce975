"""The environment contract: reset(seed, config) -> first observation; step(action) -> result.

Built-ins implement it in-process; remote sandboxes implement the same `arlo.v1.Environment`
proto, so the agent loop cannot tell them apart.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True, slots=True)
class Message:
    role: str
    """"system", "user", "assistant" or "tool"."""
    content: str
    name: str = ""
    """Tool name, for role "tool"."""


@dataclass(frozen=True, kw_only=True, slots=True)
class ResetResult:
    observation: list[Message]
    task_id: str
    """Stable for a (seed, config)."""
    tools_json: str = "[]"


@dataclass(frozen=True, kw_only=True, slots=True)
class StepResult:
    observation: list[Message]
    done: bool
    reward: float = 0.0
    answer: str = ""
    """Set when done: what the reward service scores..."""
    reference: str = ""
    """...against this."""
    info: dict[str, Any] = field(default_factory=dict)
    """JSON-serialisable details."""


class EpisodeOverError(RuntimeError):
    """step() after the episode ended."""


class Environment(Protocol):
    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        """Starts an episode; raises ValueError (naming the key) for a bad config."""
        ...

    def step(self, action: str) -> StepResult:
        """Applies one agent turn; raises EpisodeOverError once done."""
        ...


def read_config(config: Mapping[str, Any], defaults: Mapping[str, Any], env_name: str) -> dict[str, Any]:
    """`defaults` updated from `config`, checking that every key is known and of the default's type."""
    if not isinstance(config, Mapping):
        raise ValueError(f"{env_name} config must be a JSON object, got {type(config).__name__}")
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"{env_name} config: unknown key(s) {unknown}; known: {sorted(defaults)}")
    out = dict(defaults)
    for key, value in config.items():
        expected = type(defaults[key])
        # bool is an int subclass, and JSON has no int/bool confusion to forgive.
        if type(value) is not expected:
            raise ValueError(f"{env_name} config: {key} must be {expected.__name__}, got {value!r}")
        out[key] = value
    return out
