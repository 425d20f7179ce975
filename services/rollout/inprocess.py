"""The agent loop's EnvClient and Scorer over the env gateway and reward cores, in process.

No transport: the same core objects the gRPC servicers wrap, called directly, with their
results turned into the rollout's records and their expected failures into BackendError /
RetryableError with the status names the servicers would send. Tests drive the real loop on
real environments and verifiers through these; a single-process tool can too.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from arlo.config import EnvGatewayConfig
from arlo.jsonfields import parse_json_object
from services.env_gateway.envs.base import EnvUnavailableError, EpisodeOverError
from services.env_gateway.envs.base import Message as EnvMessage
from services.env_gateway.gateway import Gateway, InvalidConfigError, UnknownEnvError
from services.env_gateway.registry import default_registry as env_registry
from services.env_gateway.sessions import (
    SessionBusyError,
    SessionLimitError,
    SessionNotFoundError,
    SessionStore,
)
from services.env_gateway.spec import EnvContext
from services.reward.registry import RewardRegistry
from services.reward.registry import default_registry as reward_registry
from services.reward.scoring import Scorer as RewardScorer
from services.rollout.types import BackendError, Message, ResetResult, RetryableError, ScoreResult, StepResult

# The gateway core's expected failures, as the servicer maps them (env_gateway/server.py).
_ENV_ERRORS: tuple[tuple[type[Exception], str, type[BackendError]], ...] = (
    (UnknownEnvError, "NOT_FOUND", BackendError),
    (SessionNotFoundError, "NOT_FOUND", BackendError),
    (InvalidConfigError, "INVALID_ARGUMENT", BackendError),
    (EpisodeOverError, "FAILED_PRECONDITION", BackendError),
    (SessionBusyError, "ABORTED", BackendError),
    (SessionLimitError, "RESOURCE_EXHAUSTED", RetryableError),
    (EnvUnavailableError, "UNAVAILABLE", RetryableError),
)


def _env_error(e: Exception) -> Exception:
    for kind, code, error in _ENV_ERRORS:
        if isinstance(e, kind):
            return error("env_gateway", code, str(e))
    return e  # a bug in an environment: not a backend condition, let it show as itself


def _messages(observation: Sequence[EnvMessage]) -> tuple[Message, ...]:
    return tuple(Message(role=m.role, content=m.content, name=m.name) for m in observation)


class GatewayEnv:
    """EnvClient over a Gateway core (by default the built-in environments, under `config`: e.g.
    its dataset_roots)."""

    def __init__(self, gateway: Gateway | None = None, *, config: EnvGatewayConfig | None = None) -> None:
        self.gw = gateway or Gateway(env_registry(EnvContext(config)),
                                     SessionStore(idle_timeout_s=60, max_sessions=10000))
        self.closed: list[str] = []
        self._info = json.JSONEncoder(default=str)  # as the servicer encodes info

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        try:
            started = await self.gw.reset_async(env_name, config_json, seed)
        except Exception as e:
            raise _env_error(e) from e
        r = started.result
        return ResetResult(session_id=started.session_id, task_id=r.task_id, observation=_messages(r.observation),
                           tools_json=r.tools_json, metadata_json=json.dumps(r.metadata) if r.metadata else "")

    async def step(self, session_id: str, action: str) -> StepResult:
        try:
            r = await self.gw.step_async(session_id, action)
        except Exception as e:
            raise _env_error(e) from e
        return StepResult(observation=_messages(r.observation), reward=r.reward, done=r.done, answer=r.answer or "",
                          reference=r.reference or "", info_json=self._info.encode(r.info))

    async def close(self, session_id: str) -> None:
        self.closed.append(session_id)
        self.gw.close(session_id)

    def shutdown(self) -> None:
        self.gw.shutdown()


class CoreScorer:
    """Scorer over the reward core (the built-in reward functions by default)."""

    def __init__(self, registry: RewardRegistry | None = None, *, timeout_s: float = 5.0) -> None:
        self.scorer = RewardScorer(timeout_s=timeout_s)
        self.registry = registry or reward_registry()

    async def score(self, reward_fn: str, response: str, reference: str, metadata_json: str = "") -> ScoreResult:
        spec = self.registry.get(reward_fn)
        if spec is None:
            raise BackendError("reward", "NOT_FOUND", f"unknown reward function {reward_fn!r}")
        try:
            metadata = parse_json_object(metadata_json, "metadata_json")
        except ValueError as e:
            raise BackendError("reward", "INVALID_ARGUMENT", str(e)) from e
        out = await self.scorer.score(spec.fn, response, reference, metadata)
        return ScoreResult(status=out.status.value, reward=out.reward, components=dict(out.components),
                           error=out.error)
