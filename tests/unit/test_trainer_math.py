"""Advantages and losses against straightforward NumPy references, masks included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from arlo.config import AlgorithmConfig
from services.trainer.advantages import (
    batch_normalized_advantages,
    gae_advantages,
    grpo_advantages,
    overlong_penalty,
    rloo_advantages,
    zero_variance_groups,
)
from services.trainer.losses import (
    aggregate,
    kl_estimate,
    masked_mean,
    policy_loss,
    token_entropy,
)

RNG = np.random.default_rng(0)


def np_grpo(rewards: np.ndarray, scale: bool, eps: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(rewards)
    for g in range(rewards.shape[0]):
        r = rewards[g]
        out[g] = (r - r.mean()) / ((r.std(ddof=1) + eps) if scale else 1.0)
    return out


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages_match_reference(scale: bool) -> None:
    rewards = RNG.normal(size=(5, 4)).astype(np.float32)
    got = np.asarray(grpo_advantages(jnp.asarray(rewards), scale_by_std=scale))
    np.testing.assert_allclose(got, np_grpo(rewards, scale), rtol=1e-5, atol=1e-5)


def test_equal_rewards_give_zero_advantage() -> None:
    assert np.all(np.asarray(grpo_advantages(jnp.ones((2, 4)))) == 0.0)


def test_rloo_matches_reference() -> None:
    r = RNG.normal(size=(3, 5)).astype(np.float32)
    ref = np.array([[r[g, i] - np.delete(r[g], i).mean() for i in range(5)] for g in range(3)])
    np.testing.assert_allclose(np.asarray(rloo_advantages(jnp.asarray(r))), ref, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError):
        rloo_advantages(jnp.ones((2, 1)))


def test_batch_normalisation_ignores_masked_rows() -> None:
    s = RNG.normal(size=8).astype(np.float32)
    valid = np.array([1, 1, 1, 0, 1, 1, 0, 1], np.float32)
    v = s[valid == 1]
    ref = np.where(valid == 1, (s - v.mean()) / (v.std() + 1e-6), 0.0)
    got = batch_normalized_advantages(jnp.asarray(s), valid_b=jnp.asarray(valid))
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-6)


def np_gae(rewards, values, mask, gamma, lam):
    b, t = rewards.shape
    adv = np.zeros_like(rewards)
    for row in range(b):
        idx = [i for i in range(t) if mask[row, i]]
        next_v, next_a = 0.0, 0.0
        for i in reversed(idx):
            delta = rewards[row, i] + gamma * next_v - values[row, i]
            next_a = delta + gamma * lam * next_a
            adv[row, i] = next_a
            next_v = values[row, i]
    return adv, (adv + values) * mask


def test_gae_skips_masked_tokens_and_matches_reference() -> None:
    rewards = RNG.normal(size=(3, 7)).astype(np.float32)
    values = RNG.normal(size=(3, 7)).astype(np.float32)
    mask = (RNG.random(size=(3, 7)) > 0.3).astype(np.float32)
    adv, ret = gae_advantages(jnp.asarray(rewards), jnp.asarray(values), jnp.asarray(mask), gamma=0.9, lam=0.8)
    ref_adv, ref_ret = np_gae(rewards, values, mask, 0.9, 0.8)
    np.testing.assert_allclose(np.asarray(adv), ref_adv, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ret), ref_ret, rtol=1e-4, atol=1e-5)


def test_dynamic_sampling_and_overlong_penalty() -> None:
    r = jnp.asarray([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [0.0, 0.0, 0.0]])
    assert list(np.asarray(zero_variance_groups(r))) == [0, 1, 0]
    pen = overlong_penalty(jnp.asarray([10, 80, 90, 100, 150]), max_tokens=100, buffer_tokens=20)
    np.testing.assert_allclose(np.asarray(pen), [0.0, 0.0, -0.5, -1.0, -1.0])


def np_policy_loss(lp, prox, behav, adv, mask, cfg: AlgorithmConfig):
    """Straightforward loops: one row, one token at a time."""
    b, t = lp.shape
    log_ratio = (lp - prox) * mask
    if cfg.ratio_level == "sequence":
        per_seq = log_ratio.sum(1) / np.maximum(mask.sum(1), 1)
        log_ratio = np.repeat(per_seq[:, None], t, 1) * mask
    terms = np.zeros_like(lp)
    for i in range(b):
        for j in range(t):
            ratio = np.exp(log_ratio[i, j])
            a = adv[i, j]
            term = max(-a * ratio, -a * np.clip(ratio, 1 - cfg.clip_eps, 1 + (cfg.clip_eps_high or cfg.clip_eps)))
            if cfg.dual_clip and a < 0:
                term = min(term, -cfg.dual_clip * a)
            if cfg.is_cap:
                term *= min(np.exp(prox[i, j] - behav[i, j]), cfg.is_cap)
            terms[i, j] = term
    if cfg.aggregation == "token_mean":
        return (terms * mask).sum() / max(mask.sum(), 1)
    if cfg.aggregation == "seq_mean_token_mean":
        rows = [(terms[i] * mask[i]).sum() / mask[i].sum() for i in range(b) if mask[i].sum() > 0]
        return np.mean(rows)
    return (terms * mask).sum() / (cfg.norm_constant * b)


VARIANTS = {
    "ppo": AlgorithmConfig(),
    "clip_higher": AlgorithmConfig(clip_eps=0.2, clip_eps_high=0.28),
    "dual_clip": AlgorithmConfig(dual_clip=3.0),
    "gspo": AlgorithmConfig(ratio_level="sequence", clip_eps=3e-4, clip_eps_high=4e-4),
    "seq_mean_token_mean": AlgorithmConfig(aggregation="seq_mean_token_mean"),
    "seq_sum_norm": AlgorithmConfig(aggregation="seq_sum_norm", norm_constant=16.0),
    "truncated_is": AlgorithmConfig(is_cap=2.0),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_policy_loss_variants_match_reference(name: str) -> None:
    cfg = VARIANTS[name]
    lp = RNG.normal(-2, 0.5, size=(6, 9)).astype(np.float32)
    prox = (lp + RNG.normal(0, 0.5, size=lp.shape)).astype(np.float32)
    behav = (prox + RNG.normal(0, 0.5, size=lp.shape)).astype(np.float32)
    adv = np.repeat(RNG.normal(size=(6, 1)), 9, 1).astype(np.float32)
    mask = (RNG.random(size=lp.shape) > 0.4).astype(np.float32)
    mask[0] = 0  # a row with no model tokens never counts
    loss, metrics = policy_loss(*(jnp.asarray(x) for x in (lp, prox, behav, adv, mask)), cfg)
    np.testing.assert_allclose(float(loss), np_policy_loss(lp, prox, behav, adv, mask, cfg), rtol=2e-5, atol=1e-6)
    assert 0.0 <= float(metrics["clip_fraction"]) <= 1.0 and float(metrics["approx_kl"]) >= -1e-6
    np.testing.assert_allclose(float(metrics["logprob_mismatch"]),
                               np.abs(prox - behav)[mask == 1].mean(), rtol=1e-5)


def test_padding_never_leaks_into_the_mean() -> None:
    x = jnp.asarray([[1.0, 2.0, 1e9], [3.0, 1e9, 1e9]])
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]])
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)
    assert float(masked_mean(x, jnp.zeros_like(mask))) == 0.0
    assert float(aggregate(x, mask, "seq_mean_token_mean")) == pytest.approx((1.5 + 3.0) / 2)


def test_on_policy_gradient_direction() -> None:
    """At ratio 1 the loss is -mean(adv) over tokens: positive advantage lowers the loss."""
    lp = jnp.zeros((2, 3))
    adv = jnp.asarray([[1.0] * 3, [-1.0] * 3])
    loss, _ = policy_loss(lp, lp, lp, adv, jnp.asarray([[1, 1, 1], [1, 0, 0]]), AlgorithmConfig())
    assert float(loss) == pytest.approx(-(3 * 1.0 + 1 * -1.0) / 4)


def test_kl_estimators_match_definitions() -> None:
    rng = np.random.default_rng(3)
    lp = rng.normal(-2, 0.3, size=(4, 5)).astype(np.float32)
    ref = rng.normal(-2, 0.3, size=(4, 5)).astype(np.float32)
    log_r = ref - lp
    np.testing.assert_allclose(np.asarray(kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k1")), -log_r, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k2")), 0.5 * log_r**2,
                               rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(np.asarray(kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k3")),
                               np.exp(log_r) - 1 - log_r, rtol=1e-4, atol=1e-7)
    with pytest.raises(ValueError):
        kl_estimate(jnp.asarray(lp), jnp.asarray(ref), "k9")


def test_entropy_of_uniform_and_peaked() -> None:
    logits = jnp.asarray([[[0.0] * 4, [100.0, 0.0, 0.0, 0.0]]])
    np.testing.assert_allclose(np.asarray(token_entropy(logits))[0], [np.log(4), 0.0], atol=1e-5)


def test_config_rejects_nonsense() -> None:
    # 0 switches is_cap off in the run config, so the nonsense cap is a negative one.
    for kw in ({"clip_eps": 1.5}, {"dual_clip": 0.5}, {"aggregation": "seq_sum_norm"}, {"is_cap": -1.0}):
        with pytest.raises(ValueError):
            AlgorithmConfig(**kw).validate("trainer.algorithm")
