"""Real parts joined in process: the inference engine, the env gateway core and the reward
scorer, adapted to the agent loop's Protocols (no gRPC, no mocks)."""

from __future__ import annotations

import json

from arlo.model import get_tokenizer
from arlo.proto.v1 import env_pb2, reward_pb2
from services.env_gateway.gateway import Gateway
from services.env_gateway.registry import default_registry as env_registry
from services.env_gateway.sessions import SessionStore
from services.inference.engine import Engine, SamplingRequest
from services.reward.registry import default_registry as reward_registry
from services.reward.scoring import Scorer as RewardScorer
from services.reward.scoring import ScoreStatus
from services.rollout.agent import Turn

TOK = get_tokenizer("byte")


class EngineGenerator:
    def __init__(self, engine: Engine, temperature: float = 1.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "") -> Turn:
        self.prompts.append(list(prompt))
        (s,) = self.engine.generate(SamplingRequest(prompt=tuple(prompt), max_tokens=max_tokens,
                                                    temperature=self.temperature, stop_token_ids=(TOK.eos_id,)))
        return Turn(token_ids=s.token_ids, logprobs=s.logprobs, policy_versions=s.policy_versions,
                    finished_by_stop=s.finish_reason == "stop")


class GatewayEnv:
    def __init__(self) -> None:
        self.gw = Gateway(env_registry(), SessionStore(idle_timeout_s=60, max_sessions=10000))
        self.closed: list[str] = []

    async def reset(self, env_name: str, config_json: str, seed: int) -> env_pb2.ResetResponse:
        started = self.gw.reset(env_name, config_json, seed)
        r = started.result
        return env_pb2.ResetResponse(session_id=started.session_id, task_id=r.task_id, observation=[
            {"role": m.role, "content": m.content} for m in r.observation],
            metadata_json=json.dumps(r.metadata) if r.metadata else "")

    async def step(self, session_id: str, action: str) -> env_pb2.StepResponse:
        r = self.gw.step(session_id, action)
        return env_pb2.StepResponse(done=r.done, reward=r.reward, answer=r.answer or "", reference=r.reference or "",
                                    observation=[{"role": m.role, "content": m.content} for m in r.observation],
                                    info_json=json.dumps(r.info))

    async def close(self, session_id: str) -> None:
        self.closed.append(session_id)
        self.gw.close(session_id)


class CoreScorer:
    def __init__(self) -> None:
        self.scorer = RewardScorer(timeout_s=5.0)
        self.registry = reward_registry()

    async def score(self, reward_fn: str, response: str, reference: str,
                    metadata_json: str = "") -> reward_pb2.ScoreResponse:
        metadata = json.loads(metadata_json) if metadata_json else {}
        out = await self.scorer.score(self.registry.get(reward_fn).fn, response, reference, metadata)
        status = {ScoreStatus.OK: reward_pb2.SCORE_STATUS_OK, ScoreStatus.ERROR: reward_pb2.SCORE_STATUS_ERROR,
                  ScoreStatus.TIMEOUT: reward_pb2.SCORE_STATUS_TIMEOUT}[out.status]
        return reward_pb2.ScoreResponse(reward=out.reward, components=dict(out.components), status=status,
                                        error=out.error)
