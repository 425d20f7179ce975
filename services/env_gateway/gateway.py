"""The gateway core: registry + sessions behind reset/step/close. No gRPC here, so the agent
loop's tests can drive it in-process."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from services.env_gateway.envs.base import ResetResult, StepResult
from services.env_gateway.registry import EnvRegistry
from services.env_gateway.sessions import SessionStore


class UnknownEnvError(LookupError):
    pass


class InvalidConfigError(ValueError):
    """config_json is not valid, or the environment rejected it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    session_id: str
    result: ResetResult


def parse_config_json(text: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise InvalidConfigError(f"config_json is not valid JSON: {e}") from e
    if not isinstance(value, dict):
        raise InvalidConfigError(f"config_json must be a JSON object, got {type(value).__name__}")
    return value


class Gateway:
    def __init__(self, registry: EnvRegistry, sessions: SessionStore) -> None:
        self.registry = registry
        self.sessions = sessions

    def reset(self, env_name: str, config_json: str, seed: int) -> Started:
        spec = self.registry.get(env_name)
        if spec is None:
            raise UnknownEnvError(f"unknown environment {env_name!r}; known: {self.registry.names()}")
        config = parse_config_json(config_json)
        env = spec.factory()
        try:
            result = env.reset(seed, config)
        except ValueError as e:
            raise InvalidConfigError(str(e)) from e
        session = self.sessions.create(env_name, env)
        return Started(session_id=session.id, result=result)

    def step(self, session_id: str, action: str) -> StepResult:
        """Raises SessionNotFoundError, EpisodeOverError, or whatever the environment raises."""
        return self.sessions.get(session_id).env.step(action)

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)
