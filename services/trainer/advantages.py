"""Advantage estimators: pure functions over explicit arrays.

Groups are the rows of a [G, K] array: K trajectories sampled for the same prompt.
"""

from __future__ import annotations

from jax import Array


def grpo_advantages(rewards_gk: Array, *, scale_by_std: bool = True, eps: float = 1e-6) -> Array:
    """GRPO group normalisation: (r - mean_group) / (std_group + eps).

    `scale_by_std=False` is Dr. GRPO's unbiased variant (centre only). A group whose rewards
    are all equal gets advantage 0 everywhere: it carries no learning signal.
    """
    centred = rewards_gk - rewards_gk.mean(axis=1, keepdims=True)
    if not scale_by_std:
        return centred
    return centred / (rewards_gk.std(axis=1, keepdims=True) + eps)
