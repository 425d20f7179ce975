"""Policy losses: pure functions returning (loss, metrics).

PPO/GRPO clipping, DAPO's clip-higher, dual clip, GSPO's sequence-level ratio, the
decoupled (off-policy) objective and truncated importance weights are configurations of
one clipped surrogate, not copied branches. Their switches are the run's `trainer.algorithm`
section (`AlgorithmConfig`), read here as they are declared there: 0 turns an option off.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from arlo.config import Aggregation, AlgorithmConfig, KlKind
from arlo.model.logprobs import token_entropy as token_entropy  # the entropy bonus's; one definition
from arlo.model.sampling import LOGPROB_FLOOR


def masked_mean(x_bt: Array, mask_bt: Array) -> Array:
    """Mean over the tokens where mask is 1; padding never enters the mean (0 if none)."""
    mask = mask_bt.astype(x_bt.dtype)
    return (x_bt * mask).sum() / jnp.maximum(mask.sum(), 1.0)


def aggregate_numerator(loss_bt: Array, mask_bt: Array, mode: Aggregation) -> Array:
    """The additive part of an aggregation: summing it over micro-batches gives the batch's."""
    mask = mask_bt.astype(loss_bt.dtype)
    if mode in ("token_mean", "seq_sum_norm"):
        return (loss_bt * mask).sum()
    if mode == "seq_mean_token_mean":
        return ((loss_bt * mask).sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)).sum()
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate_denominator(mask_bt: Array, mode: Aggregation, norm_constant: float | None = None,
                          num_rows: int | Array | None = None) -> Array:
    """The divisor of an aggregation, from the WHOLE batch's mask (not a micro-batch's).

    `num_rows` is the number of real sequences for "seq_sum_norm" (padding rows excluded).
    """
    mask = mask_bt.astype(jnp.float32)
    if mode == "token_mean":
        return jnp.maximum(mask.sum(), 1.0)
    if mode == "seq_mean_token_mean":
        return jnp.maximum((mask.sum(axis=1) > 0).sum().astype(jnp.float32), 1.0)
    if mode == "seq_sum_norm":
        if not norm_constant:
            raise ValueError("aggregation 'seq_sum_norm' needs norm_constant")
        rows = mask.shape[0] if num_rows is None else num_rows
        return jnp.asarray(norm_constant * rows, jnp.float32)
    raise ValueError(f"unknown aggregation {mode!r}")


def aggregate(loss_bt: Array, mask_bt: Array, mode: Aggregation, norm_constant: float | None = None,
              denominator: Array | None = None) -> Array:
    """Reduces per-token losses to a scalar; padding and observations never count.

    Pass the whole batch's `denominator` when `loss_bt` is one micro-batch of it, so that the
    micro-batch losses add up to exactly the full-batch loss.
    """
    if denominator is None:
        denominator = aggregate_denominator(mask_bt, mode, norm_constant)
    return aggregate_numerator(loss_bt, mask_bt, mode) / denominator


def policy_loss(
    logprobs_bt: Array,
    proximal_logprobs_bt: Array,
    behaviour_logprobs_bt: Array,
    advantages_bt: Array,
    mask_bt: Array,
    cfg: AlgorithmConfig,
    denominator: Array | None = None,
) -> tuple[Array, dict[str, Array]]:
    """The clipped surrogate, decoupled: clip against the proximal policy, weight by proximal/behaviour.

    The ratio is clipped to [1 - clip_eps, 1 + (clip_eps_high or clip_eps)]; "sequence"
    `ratio_level` is GSPO (one ratio per sequence, the length-normalised product of token
    ratios); `dual_clip` c > 1 caps the loss of negative advantages at c * |A|. On-policy
    PPO/GRPO passes the behaviour logprobs as the proximal ones (weight 1). With `is_cap`, tokens sampled by an older or numerically different sampler are re-weighted by
    min(pi_prox / pi_behaviour, is_cap) (truncated importance sampling).
    """
    mask = mask_bt.astype(logprobs_bt.dtype)
    log_ratio_bt = (logprobs_bt - proximal_logprobs_bt) * mask
    if cfg.ratio_level == "sequence":
        seq_log_ratio = log_ratio_bt.sum(axis=1) / jnp.maximum(mask.sum(axis=1), 1.0)
        log_ratio_bt = jnp.broadcast_to(seq_log_ratio[:, None], log_ratio_bt.shape) * mask
    ratio = jnp.exp(log_ratio_bt)
    unclipped = -advantages_bt * ratio
    clipped = -advantages_bt * jnp.clip(ratio, 1.0 - cfg.clip_eps, 1.0 + (cfg.clip_eps_high or cfg.clip_eps))
    loss_bt = jnp.maximum(unclipped, clipped)
    if cfg.dual_clip:
        loss_bt = jnp.where(advantages_bt < 0, jnp.minimum(loss_bt, -cfg.dual_clip * advantages_bt), loss_bt)
    mismatch_bt = proximal_logprobs_bt - behaviour_logprobs_bt
    weight_bt = jnp.ones_like(loss_bt)
    if cfg.is_cap:
        weight_bt = jax.lax.stop_gradient(jnp.minimum(jnp.exp(mismatch_bt), cfg.is_cap))
    loss = aggregate(loss_bt * weight_bt, mask, cfg.aggregation, cfg.norm_constant or None, denominator)
    metrics = {
        "clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), mask),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio_bt, mask),  # k3 of KL(prox || current)
        "ratio_mean": masked_mean(ratio, mask),
        "is_weight_mean": masked_mean(weight_bt, mask),
        **mismatch_metrics(proximal_logprobs_bt, behaviour_logprobs_bt, mask),
    }
    return loss, metrics


def mismatch_metrics(trainer_bt: Array, behaviour_bt: Array, mask_bt: Array,
                     outside_bt: Array | None = None) -> dict[str, Array]:
    """Sampler vs trainer, split so that one kind cannot hide the other.

    `logprob_mismatch`: mean |trainer - behaviour| over the model tokens both sides kept, a
    number of nats (numerics, staleness). `logprob_outside`: the fraction of model tokens one
    side's filter left out: `outside_bt` (the trainer's top-k/top-p/min-p would not have kept
    the sampled token; arlo.model.logprobs.sampled_token_logprobs_and_outside) or a behaviour
    logprob at LOGPROB_FLOOR (the sampler's floor for what it could not score). Mixed into one
    mean, a 0.5 % of floored tokens read as a 50-nat mismatch.
    """
    mask = mask_bt.astype(jnp.float32)
    outside = behaviour_bt <= LOGPROB_FLOOR
    if outside_bt is not None:
        outside = outside | outside_bt.astype(bool)
    return {"logprob_mismatch": masked_mean(jnp.abs(trainer_bt - behaviour_bt), mask * ~outside),
            "logprob_outside": masked_mean(outside.astype(jnp.float32), mask)}


def kl_estimate(logprobs_bt: Array, ref_logprobs_bt: Array, kind: KlKind) -> Array:
    """Per-token estimators of KL(pi || pi_ref) from samples of pi (Schulman's k1, k2, k3)."""
    log_r = ref_logprobs_bt - logprobs_bt
    if kind == "k1":
        return -log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "k3":
        return jnp.exp(log_r) - 1.0 - log_r
    raise ValueError(f"unknown KL estimator {kind!r}; use k1, k2 or k3")


def sft_loss(logprobs_bt: Array, mask_bt: Array) -> tuple[Array, dict[str, Array]]:
    """Cross-entropy on the masked (demonstration) tokens."""
    nll = masked_mean(-logprobs_bt, mask_bt)
    return nll, {"nll": nll}
