"""The environment contract: reset(seed, config) -> first observation; step(action) -> result.

Built-ins implement it in-process; remote sandboxes implement the same `arlo.v1.Environment`
proto, so the agent loop cannot tell them apart.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar


# Message and StepResult are made once per step, on the hot path of StepBatch: not frozen,
# because a frozen dataclass's __init__ (object.__setattr__ per field) cost 2.4x as much and
# was a quarter of a cheap step's cost in the gateway. Treat them as immutable all the same.
@dataclass(kw_only=True, slots=True)
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
    metadata: Mapping[str, Any] = field(default_factory=dict)
    """The task's metadata (JSON-serialisable), sent as ResetResponse.metadata_json for the reward function."""


@dataclass(kw_only=True, slots=True)
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


C = TypeVar("C", bound="EnvConfig")


class EpisodeOverError(RuntimeError):
    """step() after the episode ended."""


class EnvUnavailableError(RuntimeError):
    """Something the environment depends on failed (a sandbox, a backend): not the agent's doing,
    so the step fails (UNAVAILABLE) instead of scoring it."""


class Environment(Protocol):
    def reset(self, seed: int, config: Mapping[str, Any]) -> ResetResult:
        """Starts an episode; raises ValueError (naming the key) for a bad config."""
        ...

    def step(self, action: str) -> StepResult:
        """Applies one agent turn; raises EpisodeOverError once done."""
        ...


class EnvConfig(Protocol):
    """A typed environment config: a frozen dataclass whose fields are JSON scalars."""

    def validate(self) -> None:
        """Raises ValueError naming the field and its allowed range."""
        ...


def config_defaults(cls: type[Any]) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls)}


def parse_config(cls: type[C], config: Mapping[str, Any], env_name: str) -> C:
    """`cls` built from a config JSON object: unknown keys and wrong types are errors naming the key.

    Types are exact (JSON has no int/bool confusion to forgive), except that an int is a fine float.
    """
    if not isinstance(config, Mapping):
        raise ValueError(f"{env_name} config must be a JSON object, got {type(config).__name__}")
    hints = typing.get_type_hints(cls)
    defaults = config_defaults(cls)
    unknown = sorted(set(config) - set(defaults))
    if unknown:
        raise ValueError(f"{env_name} config: unknown key(s) {unknown}; known: {sorted(defaults)}")
    values: dict[str, Any] = {}
    for key, value in config.items():
        expected = hints[key]
        if expected is float and type(value) is int:
            value = float(value)
        if type(value) is not expected:
            raise ValueError(f"{env_name} config: {key} must be {expected.__name__}, got {value!r}")
        values[key] = value
    parsed = cls(**values)
    try:
        parsed.validate()
    except ValueError as e:
        raise ValueError(f"{env_name} config: {e}") from None
    return parsed


def describe_config(cls: type[Any]) -> str:
    """"key (type, default value), ..." for a description, so it never drifts from the dataclass."""
    hints = typing.get_type_hints(cls)
    return ", ".join(f"{name} ({hints[name].__name__}, default {default!r})"
                     for name, default in config_defaults(cls).items())


def check_range(name: str, value: float, low: float, high: float) -> None:
    if not low <= value <= high:
        raise ValueError(f"{name} must be in [{low}, {high}], got {value}")
