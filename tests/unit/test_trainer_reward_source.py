"""One reward per run, the same under every estimator: `trainer.algorithm.reward_weight` x the
reward service's score + `env_reward_weight` x the environment's turn rewards (issue 32, item 3).

The built-in environments report an episode's 0/1 correctness as the final step's reward AND the
reward service scores the same answer 0/1: GAE used to add both (a correct episode returned 2.0
under `gae`, 1.0 under GRPO). Real learners on the tiny model, trajectories as the rollout writes them.
"""

from __future__ import annotations

import numpy as np
import pytest

from arlo.config import AlgorithmConfig, ConfigError, TrainerConfig, load_config
from arlo.model.source import preset_source
from arlo.proto.v1 import common_pb2
from services.trainer.batching import build_batch
from services.trainer.learner import Learner

PROMPT, TURN, OBS = 6, 3, 3  # prompt, two model turns of 3 tokens with a 3-token observation between
FIRST, SECOND = PROMPT - 1, PROMPT + TURN + OBS - 1  # target positions of each turn's first model token


def episode(name: str, reward: float, turn_rewards: tuple[float, float]) -> common_pb2.Trajectory:
    """Two turns; the environment's reward of each step sits at its turn's end, as agent.py records it."""
    rng = np.random.default_rng(len(name))
    ids = [int(x) for x in rng.integers(0, 256, PROMPT + 2 * TURN + OBS)]
    mask = [0] * PROMPT + [1] * TURN + [0] * OBS + [1] * TURN
    ends = (PROMPT + TURN, len(ids))
    return common_pb2.Trajectory(
        id=name, group_id="g", group_size=2, token_ids=ids, logprobs=[-3.0 * m for m in mask], loss_mask=mask,
        policy_versions=[-1 if not m else 0 for m in mask], reward=reward,
        turn_rewards=[common_pb2.TurnReward(token_end=e, reward=r) for e, r in zip(ends, turn_rewards, strict=True)])


def learner(advantage: str, **weights: float) -> Learner:
    # gamma = lambda = 1 and a fresh critic (values 0): a token's GAE return is the sum of the rewards after it.
    algorithm = AlgorithmConfig(advantage=advantage, gae_gamma=1.0, gae_lambda=1.0, whiten_advantages=False,
                                **weights)
    return Learner(preset_source("tiny"), cfg=TrainerConfig(learning_rate=1e-3, algorithm=algorithm))


def test_a_correct_episode_returns_the_same_under_grpo_and_gae_by_default() -> None:
    # Correct: the reward service scores 1 and the environment's final step says 1 as well.
    batch = build_batch([[episode("right", 1.0, (0.0, 1.0)), episode("wrong", 0.0, (0.0, 0.0))]], 256, 256)
    grpo = learner("grpo").step(batch)
    gae = learner("gae").step(batch)
    assert grpo.reward_mean == pytest.approx(0.5)
    # Every model token of the correct episode returns 1 (it returned 2, counted twice), the wrong one 0.
    assert gae.extra["return_mean"] == pytest.approx(grpo.reward_mean, abs=1e-6)
    assert gae.reward_mean == pytest.approx(grpo.reward_mean)


@pytest.mark.parametrize("reward_weight, env_reward_weight", [(1.0, 0.0), (0.0, 1.0), (0.5, 2.0)])
def test_each_reward_source_is_what_grpo_and_gae_both_optimise(reward_weight: float,
                                                             env_reward_weight: float) -> None:
    episodes = [episode("a", 1.0, (0.25, 1.0)), episode("b", 0.0, (0.5, 0.0))]
    batch = build_batch([episodes], 256, 256)
    weights = {"reward_weight": reward_weight, "env_reward_weight": env_reward_weight}
    want = [reward_weight * t.reward + env_reward_weight * sum(r.reward for r in t.turn_rewards) for t in episodes]
    # After the first turn only the second turn's reward (and the score) is still to come.
    want_after_first = [reward_weight * t.reward + env_reward_weight * t.turn_rewards[1].reward for t in episodes]

    grpo = learner("grpo", **weights)
    rewards_gk, _ = grpo.device_inputs(batch, mini_batches=1)
    np.testing.assert_allclose(rewards_gk, [want], rtol=1e-6)
    assert grpo.step(batch).reward_mean == pytest.approx(np.mean(want))

    gae = learner("gae", **weights)
    rewards_gk, rows = gae.device_inputs(batch, mini_batches=1)
    np.testing.assert_allclose(rewards_gk, [want], rtol=1e-6)
    out, _ = gae._prepare_gae(gae.critic, gae.state, gae.ref_state, rows)
    returns = np.asarray(out["returns_bt"])[0]  # [rows, length - 1]
    np.testing.assert_allclose(returns[:, FIRST], want, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(returns[:, SECOND], want_after_first, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("algorithm, field", [
    ({"reward_weight": 0.0}, "trainer.algorithm.reward_weight"),
    ({"reward_weight": 0.0, "env_reward_weight": 1.0, "overlong_max_tokens": 64, "overlong_buffer_tokens": 16},
     "trainer.algorithm.overlong_max_tokens"),
    ({"env_reward_weight": 1.0, "filter_zero_variance": True}, "trainer.algorithm.filter_zero_variance"),
])
def test_reward_settings_that_cannot_work_are_refused_at_load(algorithm: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        load_config(overrides={"trainer": {"algorithm": algorithm}})


def test_the_default_is_the_reward_services_score_alone() -> None:
    cfg = AlgorithmConfig()
    assert (cfg.reward_weight, cfg.env_reward_weight) == (1.0, 0.0)
