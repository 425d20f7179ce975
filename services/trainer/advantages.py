"""Advantage estimators: pure functions over explicit arrays.

Outcome-reward estimators work on groups, the rows of a [G, K] array (K trajectories
sampled for one prompt); GAE works per token with a value baseline.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from arlo.groups import REWARD_ATOL


def grpo_advantages(rewards_gk: Array, *, scale_by_std: bool = True, eps: float = 1e-6) -> Array:
    """GRPO group normalisation: (r - mean_group) / (std_group + eps).

    The std is the sample std (Bessel-corrected, K - 1), as TRL's and verl's GRPO compute it
    (tests/unit/test_trl_reference.py holds arlo to TRL's); a group of one has advantage 0.
    `scale_by_std=False` is Dr. GRPO's unbiased variant (centre only). A group whose rewards
    are all equal gets advantage 0 everywhere: it carries no learning signal.
    """
    centred = rewards_gk - rewards_gk.mean(axis=1, keepdims=True)
    if not scale_by_std:
        return centred
    ddof = 1 if rewards_gk.shape[1] > 1 else 0
    return centred / (rewards_gk.std(axis=1, keepdims=True, ddof=ddof) + eps)


def rloo_advantages(rewards_gk: Array) -> Array:
    """REINFORCE leave-one-out: each sample's baseline is the mean of the other K-1 samples."""
    k = rewards_gk.shape[1]
    if k < 2:
        raise ValueError("RLOO needs groups of at least 2 samples")
    others_mean = (rewards_gk.sum(axis=1, keepdims=True) - rewards_gk) / (k - 1)
    return rewards_gk - others_mean


def batch_normalized_advantages(scores_b: Array, *, eps: float = 1e-6, valid_b: Array | None = None) -> Array:
    """REINFORCE++ style: whiten scores over the whole batch (not per group).

    `valid_b` (0/1) keeps masked rows out of the statistics; their advantage is 0.
    """
    valid = jnp.ones_like(scores_b) if valid_b is None else valid_b.astype(scores_b.dtype)
    n = jnp.maximum(valid.sum(), 1.0)
    mean = (scores_b * valid).sum() / n
    var = (((scores_b - mean) ** 2) * valid).sum() / n
    return (scores_b - mean) / (jnp.sqrt(var) + eps) * valid


def gae_advantages(
    rewards_bt: Array, values_bt: Array, mask_bt: Array, *, gamma: float = 1.0, lam: float = 0.95
) -> tuple[Array, Array]:
    """Generalised advantage estimation over the tokens where mask is 1.

    Masked positions (prompt, observations, padding) are skipped: the recursion jumps from
    one model token to the next one, so an observation between two turns does not break the
    credit assignment. Returns (advantages_bt, returns_bt), both 0 where mask is 0.
    """
    mask = mask_bt.astype(rewards_bt.dtype)

    def step(carry: tuple[Array, Array], xs: tuple[Array, Array, Array]) -> tuple[tuple[Array, Array], Array]:
        next_value, next_adv = carry
        reward, value, m = xs
        delta = reward + gamma * next_value - value
        adv = delta + gamma * lam * next_adv
        # Where m is 0 the carry passes through unchanged.
        new_value = m * value + (1 - m) * next_value
        new_adv = m * adv + (1 - m) * next_adv
        return (new_value, new_adv), adv * m

    b = rewards_bt.shape[0]
    init = (jnp.zeros((b,), rewards_bt.dtype), jnp.zeros((b,), rewards_bt.dtype))
    xs = (rewards_bt.T[::-1], values_bt.T[::-1], mask.T[::-1])
    _, adv_tb = jax.lax.scan(step, init, xs)
    advantages = adv_tb[::-1].T
    return advantages, (advantages + values_bt) * mask


def zero_variance_groups(rewards_gk: Array, *, atol: float = REWARD_ATOL) -> Array:
    """1 for groups whose rewards differ (they teach something), 0 for all-equal groups.

    DAPO's dynamic sampling drops the 0 groups before the step, so the batch is not diluted
    by samples whose advantage is 0.
    """
    spread = rewards_gk.max(axis=1) - rewards_gk.min(axis=1)
    return (spread > atol).astype(jnp.int32)


def overlong_penalty(lengths_b: Array, *, max_tokens: int, buffer_tokens: int) -> Array:
    """DAPO's soft overlong punishment, counted in generated tokens.

    0 up to max_tokens - buffer_tokens, then falling linearly to -1 at max_tokens, -1 beyond.
    """
    if not 0 < buffer_tokens <= max_tokens:
        raise ValueError("need 0 < buffer_tokens <= max_tokens")
    start = max_tokens - buffer_tokens
    over = (lengths_b - start).astype(jnp.float32) / buffer_tokens
    return -jnp.clip(over, 0.0, 1.0)
