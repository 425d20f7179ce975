"""What one micro-batch contributes to the loss: the RL objective and the SFT objective.

Pure functions of (model, micro-batch, whole-batch denominators); the learner sums their
gradients over micro-batches, so a batch trains the same whatever the micro-batch size.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax
import jax.numpy as jnp
from jax import Array

from arlo.model import token_logprobs
from arlo.model.logprobs import chunked_token_logprobs
from services.trainer.advantages import (
    batch_normalized_advantages,
    grpo_advantages,
    rloo_advantages,
)
from services.trainer.losses import (
    PolicyLossConfig,
    aggregate,
    kl_estimate,
    masked_mean,
    policy_loss,
    sft_loss,
    token_entropy,
)

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ForwardConfig:
    """Memory for long trajectories: what the backward pass keeps, and how logprobs are taken."""

    remat: Literal["none", "full", "dots"] = "none"
    logprob_chunk: int = 0
    """> 0: logprobs in pieces of this many tokens, never holding [batch, length, vocab] logits."""


def forward_logprobs(model, inputs: Array, targets: Array, fwd: ForwardConfig,
                     need_logits: bool = False) -> tuple[Array, Array | None]:
    """(logprobs_bt, logits_btv or None when chunked)."""
    h = model.hidden(inputs, remat=fwd.remat)
    if fwd.logprob_chunk and not need_logits:
        return chunked_token_logprobs(model, h, targets, fwd.logprob_chunk), None
    logits = model.logits_from_hidden(h)
    return token_logprobs(logits, targets), logits


@dataclass(frozen=True, kw_only=True, slots=True)
class ObjectiveConfig:
    loss: PolicyLossConfig = PolicyLossConfig()
    advantage: AdvantageEstimator = "grpo"
    decoupled: bool = False
    """Decoupled PPO: clip against the trainer's own (proximal) logprobs and re-weight by
    proximal/behaviour (needs loss.is_cap); else clip directly against the behaviour policy."""
    kl_coef: float = 0.0
    kl_kind: Literal["k1", "k2", "k3"] = "k3"
    kl_in_reward: bool = False
    """Subtract kl_coef x the sequence's summed KL from its reward instead of adding a loss term."""
    entropy_coef: float = 0.0
    forward: ForwardConfig = ForwardConfig()


def advantages_b(cfg: ObjectiveConfig, rewards_gk: Array) -> Array:
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


def rl_objective(model, mb: dict[str, Array], denominator: Array, cfg: ObjectiveConfig,
                 ref_model=None) -> tuple[Array, dict[str, Array]]:
    inputs, targets, behaviour, mask = shifted(mb)
    logprobs, logits = forward_logprobs(model, inputs, targets, cfg.forward, need_logits=cfg.entropy_coef > 0)
    proximal = jax.lax.stop_gradient(logprobs) if cfg.decoupled else behaviour
    adv_bt = jnp.broadcast_to(mb["advantages_b"][:, None], logprobs.shape)
    loss, metrics = policy_loss(logprobs, proximal, behaviour, adv_bt, mask, cfg.loss, denominator)
    if cfg.kl_coef and not cfg.kl_in_reward:
        ref_lp = jax.lax.stop_gradient(token_logprobs(ref_model(inputs), targets))
        kl = kl_estimate(logprobs, ref_lp, cfg.kl_kind)
        loss = loss + cfg.kl_coef * aggregate(kl, mask, cfg.loss.aggregation, cfg.loss.norm_constant, denominator)
        metrics["kl_ref"] = masked_mean(kl, mask)
    if cfg.entropy_coef:
        assert logits is not None  # need_logits above
        entropy = token_entropy(logits)
        loss = loss - cfg.entropy_coef * aggregate(entropy, mask, cfg.loss.aggregation, cfg.loss.norm_constant,
                                                   denominator)
        metrics["entropy"] = masked_mean(entropy, mask)
    return loss, metrics


def sequence_kl(model, ref_model, mb: dict[str, Array], kind: str) -> Array:
    """Summed per-token KL of each sequence, for a KL penalty folded into the reward."""
    inputs, targets, _, mask = shifted(mb)
    lp = token_logprobs(model(inputs), targets)
    ref = token_logprobs(ref_model(inputs), targets)
    return (kl_estimate(lp, ref, kind) * mask).sum(axis=1)


def sft_objective(model, mb: dict[str, Array], denominator: Array,
                  fwd: ForwardConfig = ForwardConfig()) -> tuple[Array, dict[str, Array]]:
    """`mb` holds tokens_bt and mask_bt only (an SFT batch has no sampler logprobs)."""
    tokens = mb["tokens_bt"]
    logprobs, _ = forward_logprobs(model, tokens[:, :-1], tokens[:, 1:], fwd)
    mask = mb["mask_bt"][:, 1:]
    loss, metrics = sft_loss(logprobs, mask)
    # sft_loss is a token mean over this micro-batch; rescale to the whole batch's token count.
    return loss * jnp.maximum(mask.sum(), 1.0) / denominator, metrics
