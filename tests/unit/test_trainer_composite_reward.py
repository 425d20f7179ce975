"""A run whose reward is `composite` trains: the task's metadata (its components) reaches Score,
no group is failed, and the learner takes a finite step on the group, components logged.

Real parts in process: the dataset environment and the reward core through the rollout's
adapters (tests/support/inprocess.py), the real episode loop, the real learner.
"""

from __future__ import annotations

import asyncio
import json

import numpy as np

from arlo.config import EnvGatewayConfig, RewardConfig, TrainerConfig
from arlo.groups import group_failed, trainable_count
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2
from services.reward.registry import build_registry
from services.rollout.agent import EpisodeSpec, Turn, run_episode
from services.trainer.batching import build_batch
from services.trainer.learner import Learner
from tests.support.inprocess import TOK, CoreScorer, GatewayEnv

COMPONENTS = [{"fn": "exact_match", "weight": 0.7}, {"fn": "format_regex", "weight": 0.3}]


class Replies:
    """A policy that answers from a fixed list, one reply per episode."""

    def __init__(self, replies: list[str]) -> None:
        self.replies = list(replies)

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        ids = TOK.encode(self.replies.pop(0)) + [TOK.eos_id]
        return Turn(token_ids=ids, logprobs=[-1.0] * len(ids), policy_versions=[0] * len(ids), finished_by_stop=True)


def test_a_composite_reward_run_trains(tmp_path) -> None:
    data = tmp_path / "tasks.jsonl"
    data.write_text(json.dumps({"prompt": "2+3=", "answer": "5", "components": COMPONENTS,
                                "patterns": {"digits": r"^\d+$"}}) + "\n")
    env_cfg = json.dumps({"path": str(data), "metadata_fields": "components,patterns"})
    policy = Replies(["5", "6", "five", "5"])
    # The reward service's own registry (built-ins, code_tests, composite), as its server builds it.
    env = GatewayEnv(config=EnvGatewayConfig(dataset_roots=(str(tmp_path),)))
    scorer = CoreScorer(build_registry(RewardConfig()))

    async def episodes() -> list[common_pb2.Trajectory]:
        out = []
        for _ in range(4):
            spec = EpisodeSpec(env_name="dataset", env_config_json=env_cfg, reward_fn="composite", seed=0,
                               max_turns=1, max_tokens_per_turn=8, max_episode_tokens=64, run_id="r",
                               group_id="g", group_size=4)
            out.append(await run_episode(spec, TOK, policy, env, scorer))
            assert out[-1].status != common_pb2.TRAJECTORY_STATUS_ERROR, out[-1].error
        return out

    group = asyncio.run(episodes())
    rewards = [t.reward for t in group]
    assert not group_failed(group) and trainable_count(group, filter_zero_variance=True) == 4
    assert rewards[0] == rewards[3] > rewards[1] > rewards[2] >= 0.0, rewards  # 1.0, 0.3 (format only), 0
    assert all(len(t.reward_components) >= 2 for t in group), [dict(t.reward_components) for t in group]
    metrics = Learner(preset_source("tiny"), cfg=TrainerConfig()).step(
        build_batch([group], 256, TOK.pad_id))
    assert not metrics.skipped and np.isfinite(metrics.loss) and metrics.grad_norm > 0
