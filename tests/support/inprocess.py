"""Real parts joined in process for the agent loop's tests and benches: the inference engine as a
Generator, and the env gateway and reward cores as its EnvClient and Scorer.

No transport: the same core objects the gRPC servicers wrap, called directly, with their results
turned into the rollout's records and their expected failures into BackendError /
RetryableError with the status the servicer would send (`services/env_gateway/errors.py`).
They live here, not in services/rollout: joining three services' cores in one process is a test
harness's job, and a service imports no other service's package (tests/unit/test_layout.py).
"""

from __future__ import annotations

import json
from collections.abc import Sequence

from arlo.config import EnvGatewayConfig
from arlo.jsonfields import parse_json_object
from arlo.model import get_tokenizer
from services.env_gateway.envs.base import Message as EnvMessage
from services.env_gateway.errors import status_of
from services.env_gateway.gateway import Gateway
from services.env_gateway.registry import default_registry as env_registry
from services.env_gateway.sessions import SessionStore
from services.env_gateway.spec import EnvContext
from services.inference.engine import Engine, SamplingRequest
from services.reward.registry import RewardRegistry
from services.reward.registry import default_registry as reward_registry
from services.reward.scoring import Scorer as RewardScorer
from services.rollout.agent import Turn
from services.rollout.clients import backend_error
from services.rollout.types import BackendError, Message, ResetResult, ScoreResult, StepResult

TOK = get_tokenizer("byte")

__all__ = ["TOK", "CoreScorer", "EngineGenerator", "GatewayEnv"]


def _env_error(e: Exception) -> Exception:
    code = status_of(e)
    if code is None:
        return e  # a bug in an environment: not a backend condition, let it show as itself
    return backend_error("env_gateway", code, str(e))


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


class EngineGenerator:
    def __init__(self, engine: Engine, temperature: float = 1.0, *, return_routing: bool = False) -> None:
        """`return_routing`: each turn carries its routed experts as inference's Completion packs them."""
        self.engine = engine
        self.temperature = temperature
        self.return_routing = return_routing
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        self.prompts.append(list(prompt))
        (s,) = self.engine.generate(SamplingRequest(prompt=tuple(prompt), max_tokens=max_tokens,
                                                    temperature=self.temperature, stop_token_ids=(TOK.eos_id,),
                                                    seed=seed, return_routing=self.return_routing))
        routed = b""
        if s.routed_experts is not None:
            from arlo.routing_replay import pack_experts

            assert self.engine.model_cfg.moe is not None
            routed = pack_experts(s.routed_experts, self.engine.model_cfg.moe.num_experts)
        return Turn(token_ids=s.token_ids, logprobs=s.logprobs, policy_versions=s.policy_versions,
                    finished_by_stop=s.finish_reason == "stop", routed_experts=routed)
