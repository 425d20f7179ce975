"""Policy losses: pure functions returning (loss, metrics).

Variants (PPO/GRPO clipping, asymmetric clip-higher) are configurations of one clipped
surrogate, not copied branches.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax.numpy as jnp
from jax import Array


@dataclass(frozen=True, kw_only=True, slots=True)
class ClipConfig:
    eps_low: float = 0.2
    """Ratio floor is 1 - eps_low."""
    eps_high: float = 0.2
    """Ratio ceiling is 1 + eps_high (DAPO's clip-higher sets it above eps_low)."""


def masked_mean(x_bt: Array, mask_bt: Array) -> Array:
    """Mean over the tokens where mask is 1; padding never enters the mean (0 if none)."""
    mask = mask_bt.astype(x_bt.dtype)
    return (x_bt * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def clipped_surrogate_loss(
    logprobs_bt: Array,
    behaviour_logprobs_bt: Array,
    advantages_b: Array,
    mask_bt: Array,
    cfg: ClipConfig,
) -> tuple[Array, dict[str, Array]]:
    """PPO/GRPO clipped surrogate, token-mean over the loss mask.

    The ratio is taken against the behaviour policy's logprobs recorded by inference, so
    trajectories generated a few versions back are still weighted correctly.
    """
    log_ratio = (logprobs_bt - behaviour_logprobs_bt) * mask_bt
    ratio = jnp.exp(log_ratio)
    adv = advantages_b[:, None]
    unclipped = -adv * ratio
    clipped = -adv * jnp.clip(ratio, 1.0 - cfg.eps_low, 1.0 + cfg.eps_high)
    loss = masked_mean(jnp.maximum(unclipped, clipped), mask_bt)
    metrics = {
        "clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), mask_bt),
        # k3 estimator of KL(behaviour || current): non-negative, low variance.
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, mask_bt),
        "ratio_mean": masked_mean(ratio, mask_bt),
    }
    return loss, metrics
