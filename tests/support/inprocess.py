"""Real parts joined in process for the agent loop's tests: the inference engine as a Generator;
the env gateway and reward cores through the adapters the rollout ships (services/rollout/inprocess.py)."""

from __future__ import annotations

from arlo.model import get_tokenizer
from services.inference.engine import Engine, SamplingRequest
from services.rollout.agent import Turn
from services.rollout.inprocess import CoreScorer, GatewayEnv

TOK = get_tokenizer("byte")

__all__ = ["TOK", "CoreScorer", "EngineGenerator", "GatewayEnv"]


class EngineGenerator:
    def __init__(self, engine: Engine, temperature: float = 1.0) -> None:
        self.engine = engine
        self.temperature = temperature
        self.prompts: list[list[int]] = []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        self.prompts.append(list(prompt))
        (s,) = self.engine.generate(SamplingRequest(prompt=tuple(prompt), max_tokens=max_tokens,
                                                    temperature=self.temperature, stop_token_ids=(TOK.eos_id,),
                                                    seed=seed))
        return Turn(token_ids=s.token_ids, logprobs=s.logprobs, policy_versions=s.policy_versions,
                    finished_by_stop=s.finish_reason == "stop")
