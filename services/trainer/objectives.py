"""What one micro-batch contributes to the loss: the RL objective and the SFT objective.

Pure functions of (model, micro-batch, whole-batch denominators); the learner sums their
gradients over micro-batches, so a batch trains the same whatever the micro-batch size.
They read the run's `trainer` section directly: `algorithm` for the objective, `remat` and
`logprob_chunk` for the memory of the forward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import Array

from arlo.config import AlgorithmConfig, KlKind, Remat, TrainerConfig
from arlo.model import token_logprobs
from arlo.model.logprobs import chunked_token_logprobs
from services.trainer.advantages import (
    batch_normalized_advantages,
    grpo_advantages,
    rloo_advantages,
)
from services.trainer.losses import (
    aggregate,
    kl_estimate,
    masked_mean,
    policy_loss,
    sft_loss,
    token_entropy,
)


def forward_logprobs(model, inputs: Array, targets: Array, *, remat: Remat = "none", logprob_chunk: int = 0,
                     need_logits: bool = False) -> tuple[Array, Array | None]:
    """(logprobs_bt, logits_btv or None when chunked): `logprob_chunk` > 0 never holds
    [batch, length, vocab] logits whole (unless the caller needs the logits)."""
    h = model.hidden(inputs, remat=remat)
    if logprob_chunk and not need_logits:
        return chunked_token_logprobs(model, h, targets, logprob_chunk), None
    logits = model.logits_from_hidden(h)
    return token_logprobs(logits, targets), logits


def advantages_b(cfg: AlgorithmConfig, rewards_gk: Array) -> Array:
    """Per-sequence advantages, flattened in group-major order (the batch's row order)."""
    if cfg.advantage == "grpo":
        adv = grpo_advantages(rewards_gk, scale_by_std=True)
    elif cfg.advantage == "dr_grpo":
        adv = grpo_advantages(rewards_gk, scale_by_std=False)
    elif cfg.advantage == "rloo":
        adv = rloo_advantages(rewards_gk)
    elif cfg.advantage == "reinforce_pp":
        centred = rewards_gk - rewards_gk.mean(axis=1, keepdims=True)
        adv = batch_normalized_advantages(centred.reshape(-1)).reshape(rewards_gk.shape)
    else:
        raise ValueError(f"unknown advantage estimator {cfg.advantage!r}")
    return adv.reshape(-1)


def shifted(mb: dict[str, Array]) -> tuple[Array, Array, Array, Array]:
    """Inputs, targets and the per-target arrays: token t is predicted from tokens < t."""
    tokens = mb["tokens_bt"]
    return tokens[:, :-1], tokens[:, 1:], mb["behaviour_logprobs_bt"][:, 1:], mb["mask_bt"][:, 1:]


def rl_objective(model, mb: dict[str, Array], denominator: Array, tc: TrainerConfig,
                 ref_model=None) -> tuple[Array, dict[str, Array]]:
    """`tc.algorithm`: decoupled PPO clips against the trainer's own (proximal) logprobs and
    re-weights by proximal/behaviour; else it clips directly against the behaviour policy."""
    cfg = tc.algorithm
    norm = cfg.norm_constant or None
    inputs, targets, behaviour, mask = shifted(mb)
    logprobs, logits = forward_logprobs(model, inputs, targets, remat=tc.remat, logprob_chunk=tc.logprob_chunk,
                                        need_logits=cfg.entropy_coef > 0)
    proximal = jax.lax.stop_gradient(logprobs) if cfg.decoupled else behaviour
    adv_bt = jnp.broadcast_to(mb["advantages_b"][:, None], logprobs.shape)
    loss, metrics = policy_loss(logprobs, proximal, behaviour, adv_bt, mask, cfg, denominator)
    if cfg.kl_coef and not cfg.kl_in_reward:
        ref_lp = jax.lax.stop_gradient(token_logprobs(ref_model(inputs), targets))
        kl = kl_estimate(logprobs, ref_lp, cfg.kl_kind)
        loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.aggregation, norm, denominator)
        metrics["kl_ref"] = masked_mean(kl, mask)
    if cfg.entropy_coef:
        assert logits is not None  # need_logits above
        entropy = token_entropy(logits)
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.aggregation, norm, denominator)
        metrics["entropy"] = masked_mean(entropy, mask)
    return loss, metrics


def sequence_kl(model, ref_model, mb: dict[str, Array], kind: KlKind) -> Array:
    """Summed per-token KL of each sequence, for a KL penalty folded into the reward."""
    inputs, targets, _, mask = shifted(mb)
    lp = token_logprobs(model(inputs), targets)
    ref = token_logprobs(ref_model(inputs), targets)
    return (kl_estimate(lp, ref, kind) * mask).sum(axis=1)


def sft_objective(model, mb: dict[str, Array], denominator: Array,
                  tc: TrainerConfig) -> tuple[Array, dict[str, Array]]:
    """`mb` holds tokens_bt and mask_bt only (an SFT batch has no sampler logprobs)."""
    tokens = mb["tokens_bt"]
    logprobs, _ = forward_logprobs(model, tokens[:, :-1], tokens[:, 1:], remat=tc.remat, logprob_chunk=tc.logprob_chunk)
    mask = mb["mask_bt"][:, 1:]
    loss, metrics = sft_loss(logprobs, mask)
    # sft_loss is a token mean over this micro-batch; rescale to the whole batch's token count.
    return loss * jnp.maximum(mask.sum(), 1.0) / denominator, metrics
