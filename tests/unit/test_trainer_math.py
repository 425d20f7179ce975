"""Advantages and losses against straightforward NumPy references, masks included."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from services.trainer.advantages import grpo_advantages
from services.trainer.losses import ClipConfig, clipped_surrogate_loss, masked_mean


def np_grpo(rewards: np.ndarray, scale: bool, eps: float = 1e-6) -> np.ndarray:
    out = np.zeros_like(rewards)
    for g in range(rewards.shape[0]):
        r = rewards[g]
        out[g] = (r - r.mean()) / ((r.std() + eps) if scale else 1.0)
    return out


def np_clipped_loss(lp, old, adv, mask, lo, hi):
    num, den = 0.0, 0.0
    for b in range(lp.shape[0]):
        for t in range(lp.shape[1]):
            if mask[b, t] == 0:
                continue
            ratio = np.exp(lp[b, t] - old[b, t])
            term = max(-adv[b] * ratio, -adv[b] * min(max(ratio, 1 - lo), 1 + hi))
            num += term
            den += 1
    return num / max(den, 1)


@pytest.mark.parametrize("scale", [True, False])
def test_grpo_advantages_match_reference(scale: bool) -> None:
    rewards = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    got = np.asarray(grpo_advantages(jnp.asarray(rewards), scale_by_std=scale))
    np.testing.assert_allclose(got, np_grpo(rewards, scale), rtol=1e-5, atol=1e-5)


def test_equal_rewards_give_zero_advantage() -> None:
    assert np.all(np.asarray(grpo_advantages(jnp.ones((2, 4)))) == 0.0)


@pytest.mark.parametrize(("lo", "hi"), [(0.2, 0.2), (0.2, 0.28)])
def test_clipped_surrogate_matches_reference(lo: float, hi: float) -> None:
    rng = np.random.default_rng(1)
    lp = rng.normal(-2, 0.5, size=(6, 9)).astype(np.float32)
    old = (lp + rng.normal(0, 0.3, size=lp.shape)).astype(np.float32)
    adv = rng.normal(size=6).astype(np.float32)
    mask = (rng.random(size=lp.shape) > 0.4).astype(np.float32)
    loss, metrics = clipped_surrogate_loss(jnp.asarray(lp), jnp.asarray(old), jnp.asarray(adv), jnp.asarray(mask),
                                           ClipConfig(eps_low=lo, eps_high=hi))
    np.testing.assert_allclose(float(loss), np_clipped_loss(lp, old, adv, mask, lo, hi), rtol=1e-5)
    assert 0.0 <= float(metrics["clip_fraction"]) <= 1.0
    assert float(metrics["approx_kl"]) >= 0.0


def test_padding_never_leaks_into_the_mean() -> None:
    x = jnp.asarray([[1.0, 2.0, 1e9], [3.0, 1e9, 1e9]])
    mask = jnp.asarray([[1, 1, 0], [1, 0, 0]])
    assert float(masked_mean(x, mask)) == pytest.approx(2.0)
    assert float(masked_mean(x, jnp.zeros_like(mask))) == 0.0


def test_on_policy_gradient_direction() -> None:
    """At ratio 1 the loss is -mean(adv) over tokens: positive advantage lowers the loss."""
    lp = jnp.zeros((2, 3))
    loss, _ = clipped_surrogate_loss(lp, lp, jnp.asarray([1.0, -1.0]), jnp.asarray([[1, 1, 1], [1, 0, 0]]),
                                     ClipConfig())
    assert float(loss) == pytest.approx(-(3 * 1.0 + 1 * -1.0) / 4)
