"""PPO's learned critic (`advantage: gae`): GAE against the paper's definition, the clipped value
loss against a hand computation, the learner's critic on the real tiny model, its checkpoint."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.config import AlgorithmConfig, TrainerConfig
from arlo.model import ModelConfig, create_model
from arlo.model.source import preset_source
from services.trainer.advantages import gae_advantages
from services.trainer.batching import Batch, build_batch, objective_rewards
from services.trainer.checkpoint import Checkpointer, CheckpointMeta
from services.trainer.critic import make_critic, prepare_gae, value_loss
from services.trainer.learner import Learner
from services.trainer.lockstep import restore_learner, save_learner
from tests.unit.test_trainer_learner import random_groups

RNG = np.random.default_rng(7)


def paper_gae(rewards: np.ndarray, values: np.ndarray, mask: np.ndarray, gamma: float, lam: float) -> np.ndarray:
    """Schulman et al. 2016, eq. 16, as a sum (not the recursion): A_t = sum_l (gamma lam)^l delta_{t+l},
    delta_t = r_t + gamma V(s_{t+1}) - V(s_t), over the sequence of model positions only, V = 0
    after the last one."""
    adv = np.zeros_like(rewards, dtype=np.float64)
    for row in range(rewards.shape[0]):
        steps = np.flatnonzero(mask[row])
        r, v = rewards[row, steps].astype(np.float64), values[row, steps].astype(np.float64)
        v_next = np.append(v[1:], 0.0)
        delta = r + gamma * v_next - v
        for i, t in enumerate(steps):
            adv[row, t] = sum((gamma * lam) ** k * delta[i + k] for k in range(len(steps) - i))
    return adv


@pytest.mark.parametrize(("gamma", "lam"), [(1.0, 0.95), (0.9, 0.7), (0.99, 1.0), (1.0, 0.0)])
def test_gae_equals_the_papers_sum_with_masks_and_padding(gamma: float, lam: float) -> None:
    b, t = 5, 11
    rewards = RNG.normal(size=(b, t)).astype(np.float32)
    values = RNG.normal(size=(b, t)).astype(np.float32)
    mask = np.zeros((b, t), np.float32)
    mask[0, 3:] = 1  # prompt, then one turn to the end
    mask[1, 2:5] = mask[1, 7:9] = 1  # two turns with an observation between, right padding after
    mask[2, 4] = 1  # a single model token
    mask[3] = (RNG.random(t) > 0.4).astype(np.float32)
    # row 4: all padding
    adv, ret = gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=gamma, lam=lam)
    want = paper_gae(rewards, values, mask, gamma, lam)
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), (want + values) * mask, rtol=1e-5, atol=1e-5)
    assert not np.asarray(adv)[4].any()


def test_clipped_value_loss_by_hand() -> None:
    new = jnp.asarray([[1.0, 0.5, 2.0, 9.0]])
    old = jnp.asarray([[0.8, 0.5, 1.0, 0.0]])
    ret = jnp.asarray([[0.0, 1.0, 3.0, 0.0]])
    mask = jnp.asarray([[1.0, 1.0, 1.0, 0.0]])  # the last position is padding: never counted
    # clip 0.1: clipped values 0.9, 0.5, 1.1 (the third cannot move past old + 0.1).
    # per token max((V-R)^2, (Vc-R)^2): max(1, 0.81) = 1; max(0.25, 0.25) = 0.25; max(1, 3.61) = 3.61
    loss, metrics = value_loss(new, old, ret, mask, 0.1, jnp.asarray(3.0))
    assert float(loss) == pytest.approx(0.5 * (1.0 + 0.25 + 3.61) / 3, rel=1e-6)
    assert float(metrics["value_clip_fraction"]) == pytest.approx(1 / 3)
    unclipped, _ = value_loss(new, old, ret, mask, 0.0, jnp.asarray(3.0))
    assert float(unclipped) == pytest.approx(0.5 * (1.0 + 0.25 + 1.0) / 3, rel=1e-6)


def test_rewards_reach_gae_at_the_last_model_token_and_per_turn() -> None:
    """prepare_gae with a fresh critic (values 0, no whitening): the advantage of every model
    position is the discounted sum of the rewards after it: the trajectory's at its last model
    token, per-turn rewards where the batch puts them."""
    cfg = TrainerConfig(algorithm=AlgorithmConfig(advantage="gae", gae_gamma=0.9, gae_lambda=1.0,
                                                  whiten_advantages=False, env_reward_weight=1.0))
    graphdef, state = nnx.split(create_model(ModelConfig.named("tiny"), 0))
    critic = make_critic(state, ModelConfig.named("tiny").dim)
    tokens = RNG.integers(0, 256, (1, 2, 8)).astype(np.int32)
    mask = np.zeros((1, 2, 8), np.float32)
    mask[0, 0, [2, 3, 5, 6]] = 1  # two turns: tokens 2-3 and 5-6
    mask[0, 1, 3:5] = 1
    turn = np.zeros((1, 2, 8), np.float32)
    turn[0, 0, 3] = 0.5  # the first turn's reward, at its last token
    batch = Batch(tokens_bt=tokens[0], behaviour_logprobs_bt=np.zeros((2, 8), np.float32), mask_bt=mask[0],
                  rewards_gk=np.asarray([[2.0, -1.0]], np.float32), token_rewards_bt=turn[0], trajectory_ids=(),
                  num_tokens=int(mask.sum()))
    rewards_gk, token_rewards = objective_rewards(batch, cfg.algorithm)  # both sources, weights 1
    np.testing.assert_allclose(rewards_gk, [[2.5, -1.0]])
    mbs = {"tokens_bt": jnp.asarray(tokens), "mask_bt": jnp.asarray(mask),
           "token_rewards_bt": jnp.asarray(token_rewards[None]), "behaviour_logprobs_bt": jnp.zeros((1, 2, 8))}
    out, metrics = prepare_gae(graphdef, cfg, critic, state, None, mbs)
    adv = np.asarray(out["advantages_bt"])[0]  # [rows, length - 1]: position j is token j + 1
    assert not np.asarray(out["old_values_bt"]).any() and float(metrics["value_mean"]) == 0.0
    # Row 0, tokens 2, 3, 5, 6 (positions 1, 2, 4, 5): rewards 0, 0.5, 0, 2.0 over 4 model steps.
    want0 = [0.5 * 0.9 + 2.0 * 0.9**3, 0.5 + 2.0 * 0.9**2, 2.0 * 0.9, 2.0]
    np.testing.assert_allclose(adv[0, [1, 2, 4, 5]], want0, rtol=1e-6)
    np.testing.assert_allclose(adv[1, [2, 3]], [-0.9, -1.0], rtol=1e-6)
    assert not adv[0, [0, 3, 6]].any() and not adv[1, [0, 1, 4, 5, 6]].any()
    np.testing.assert_allclose(np.asarray(out["returns_bt"])[0], adv, rtol=1e-6)  # values are 0


def gae_learner(seed: int = 0, **algorithm) -> Learner:
    cfg = TrainerConfig(learning_rate=1e-3, algorithm=AlgorithmConfig(
        advantage="gae", critic_learning_rate=3e-3, **algorithm))
    return Learner(preset_source("tiny", seed=seed), cfg=cfg)


def test_learner_with_a_critic_lowers_the_value_loss() -> None:
    learner = gae_learner()
    batch = build_batch(random_groups(2, 2), 256, 256)
    losses = []
    for _ in range(6):
        m = learner.step(batch)
        assert np.isfinite(m.loss) and not m.skipped and m.extra["value_skipped"] == 0.0
        losses.append(m.extra["value_loss"])
        assert np.isfinite(m.extra["explained_variance"]) and np.isfinite(m.extra["value_mean"])
    assert losses[-1] < 0.5 * losses[0], losses
    assert m.extra["explained_variance"] > 0.0
    # The critic is a separate model: its backbone moved away from the policy's.
    diff = jax.tree.map(lambda a, b: float(jnp.abs(a - b).max()), learner.critic["backbone"], learner.state)
    assert max(jax.tree.leaves(diff)) > 0


def test_critic_is_checkpointed_and_restored(tmp_path) -> None:
    learner = gae_learner()
    batch = build_batch(random_groups(2, 2), 256, 256)
    learner.step(batch)
    learner.step(batch)
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    save_learner(ckpt, learner, CheckpointMeta(version=2, step=2, params_sha256=_sha(learner)))
    ckpt.wait()
    fresh = gae_learner(seed=1)
    restored = restore_learner(ckpt, fresh)
    assert restored is not None and restored.critic is not None and fresh.step_count == 2
    for a, b in zip(jax.tree.leaves(learner.critic_checkpoint()), jax.tree.leaves(fresh.critic_checkpoint()),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # Both go on identically from there.
    assert learner.step(batch).extra["value_loss"] == pytest.approx(fresh.step(batch).extra["value_loss"], rel=1e-5)
    ckpt.close()


def test_a_checkpoint_without_a_critic_restores_with_a_fresh_one(tmp_path) -> None:
    grpo = Learner(preset_source("tiny"), cfg=TrainerConfig(learning_rate=1e-2))
    grpo.step(build_batch(random_groups(2, 2), 256, 256))
    ckpt = Checkpointer(str(tmp_path / "ckpt"))
    save_learner(ckpt, grpo, CheckpointMeta(version=1, step=1, params_sha256=_sha(grpo)))
    ckpt.wait()
    learner = gae_learner(seed=3)
    restored = restore_learner(ckpt, learner)
    assert restored is not None and restored.critic is None and not restored.skipped
    # The fresh critic's backbone is the restored policy, its head 0, its AdamW at step 0.
    for a, b in zip(jax.tree.leaves(learner.critic["backbone"]), jax.tree.leaves(grpo.state), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not any(np.asarray(x).any() for x in jax.tree.leaves(learner.critic["head"]))
    ckpt.close()


def _sha(learner: Learner) -> str:
    from services.trainer.checkpoint import params_sha256

    return params_sha256(learner.state)
