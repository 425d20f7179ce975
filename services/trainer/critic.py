"""The learned critic of PPO (`trainer.algorithm.advantage: gae`): values, GAE, the value loss.

The value model is a value head (dim -> 1) on a COPY of the policy backbone: separate
parameters, initialised from the policy's weights when the learner is made (or restored from
a checkpoint without a critic), trained by its own AdamW (`algorithm.critic_learning_rate`).
A separate model costs a second set of weights and Adam moments (the policy's memory again)
and a second forward/backward pass, but the value error never pulls on the policy's features;
a head on the policy's stop-gradient hidden states would be cheaper and is not what this is.
The copy keeps the (unused) unembedding matrix so it has the policy's tree and shardings: it
gets no gradient and moves only by weight decay.

Positions: the value V(s_t) of a target position t is read from the hidden state that predicts
token t + 1 (the state before the model emits it), so values, rewards, advantages and returns
are all [batch, length - 1] arrays aligned with `objectives.shifted`'s targets and mask.

Everything here is a pure function of arrays; the learner jits them and runs the updates.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax import Array

from arlo.config import AlgorithmConfig, Remat, TrainerConfig
from services.trainer.advantages import gae_advantages
from services.trainer.losses import masked_mean
from services.trainer.objectives import model_kl_bt, with_reference_logprobs


def make_critic(policy_state: nnx.State, dim: int) -> dict[str, Any]:
    """{"backbone": a copy of the policy's state, "head": {"w_d", "b"}}. The head starts at 0, so
    every value starts at 0 (no seed in it) and the first update fits the head first; the
    backbone's gradient flows once the head is non-zero."""
    return {"backbone": jax.tree.map(jnp.copy, policy_state),
            "head": {"w_d": jnp.zeros((dim,), jnp.float32), "b": jnp.zeros((), jnp.float32)}}


def values_bt(graphdef: Any, params: dict[str, Any], tokens_bt: Array, remat: Remat = "none") -> Array:
    """V(s_t) for every target position of `tokens_bt`: [batch, length - 1], float32."""
    h = nnx.merge(graphdef, params["backbone"]).hidden(tokens_bt[:, :-1], remat=remat)
    head = params["head"]
    return h.astype(jnp.float32) @ head["w_d"] + head["b"]


def whiten(x_bt: Array, mask_bt: Array, eps: float = 1e-6) -> Array:
    """(x - mean) / (std + eps) over the masked positions; 0 where mask is 0."""
    mean = masked_mean(x_bt, mask_bt)
    var = masked_mean((x_bt - mean) ** 2, mask_bt)
    return (x_bt - mean) / (jnp.sqrt(var) + eps) * mask_bt


def explained_variance(values_bt: Array, returns_bt: Array, mask_bt: Array) -> Array:
    """1 - Var(R - V) / Var(R) over the masked positions (1: perfect, 0: no better than a constant)."""
    def var(x: Array) -> Array:
        return masked_mean((x - masked_mean(x, mask_bt)) ** 2, mask_bt)

    return 1.0 - var(returns_bt - values_bt) / jnp.maximum(var(returns_bt), 1e-8)


def gae_targets(cfg: AlgorithmConfig, rewards_bt: Array, old_values_bt: Array,
                mask_bt: Array) -> tuple[Array, Array]:
    """(advantages_bt for the policy, returns_bt for the critic): GAE(gae_gamma, gae_lambda)
    over each sequence's model positions; returns = raw advantages + values, and the
    policy's advantages whitened over the batch when `whiten_advantages`."""
    adv, returns = gae_advantages(rewards_bt, old_values_bt, mask_bt, gamma=cfg.gae_gamma, lam=cfg.gae_lambda)
    if cfg.whiten_advantages:
        adv = whiten(adv, mask_bt)
    return adv, returns


def value_loss(new_bt: Array, old_bt: Array, returns_bt: Array, mask_bt: Array, clip: float,
               denominator: Array) -> tuple[Array, dict[str, Array]]:
    """PPO's clipped value loss: 0.5 * max((V - R)^2, (clip(V, V_old - c, V_old + c) - R)^2),
    summed over the masked positions and divided by `denominator` (the mini-batch's model
    tokens, so micro-batch losses add up to the mini-batch's token mean); `clip` 0: 0.5 (V - R)^2.
    The 0.5 is baselines' and verl's: the gradient of a token's loss is then (V - R)."""
    unclipped = (new_bt - returns_bt) ** 2
    if clip:
        clipped_v = old_bt + jnp.clip(new_bt - old_bt, -clip, clip)
        clipped = (clipped_v - returns_bt) ** 2
        per_token = jnp.maximum(unclipped, clipped)
        clip_fraction = masked_mean((clipped > unclipped).astype(jnp.float32), mask_bt)
    else:
        per_token, clip_fraction = unclipped, jnp.zeros(())
    loss = 0.5 * (per_token * mask_bt).sum() / denominator
    return loss, {"value_clip_fraction": clip_fraction}


def prepare_gae(graphdef: Any, tc: TrainerConfig, critic: dict[str, Any], state: nnx.State,
                ref_state: nnx.State | None, mbs: dict[str, Array]) -> tuple[dict[str, Array], dict[str, Array]]:
    """The batch's start, no gradient: the critic's values, the per-token rewards, GAE.

    `mbs` is the batch as [micro_batches, rows, length] arrays. Per-token rewards:
    `token_rewards_bt`, the reward the run optimises placed on its tokens
    (`batching.objective_rewards`: the same total as the group estimators' reward), minus
    kl_coef x the per-token KL to the reference with `kl_in_reward` (then mbs also carries the
    reference's logprobs, "ref_logprobs_bt", so the step does not compute them again). Returns
    mbs plus old_values_bt, returns_bt and advantages_bt (each [micro_batches, rows, length - 1])
    and the batch-start metrics."""
    cfg = tc.algorithm
    num_mb, size, length = mbs["mask_bt"].shape
    mask = mbs["mask_bt"][:, :, 1:].reshape(-1, length - 1)
    old_values = jax.lax.map(lambda mb: values_bt(graphdef, critic, mb["tokens_bt"]), mbs)
    old_values = jax.lax.stop_gradient(old_values).reshape(-1, length - 1) * mask
    rewards = mbs["token_rewards_bt"][:, :, 1:].reshape(-1, length - 1) * mask
    if cfg.kl_coef and cfg.kl_in_reward:
        assert ref_state is not None  # the learner holds a reference whenever kl_coef > 0
        model, ref_model = nnx.merge(graphdef, state), nnx.merge(graphdef, ref_state)
        # Chunked like the step's own logprobs; the reference's go on to the step in `mbs`.
        mbs = with_reference_logprobs(ref_model, mbs, tc)
        kl = jax.lax.map(lambda mb: model_kl_bt(model, mb, tc), mbs)
        rewards = rewards - cfg.kl_coef * kl.reshape(-1, length - 1)
    adv, returns = gae_targets(cfg, rewards, old_values, mask)
    metrics = {"value_mean": masked_mean(old_values, mask), "return_mean": masked_mean(returns, mask),
               "explained_variance": explained_variance(old_values, returns, mask)}

    def shaped(x: Array) -> Array:
        return x.reshape(num_mb, size, length - 1)

    return {**mbs, "old_values_bt": shaped(old_values), "returns_bt": shaped(returns),
            "advantages_bt": shaped(adv)}, metrics


def value_objective(graphdef: Any, tc: TrainerConfig, critic: dict[str, Any], mb: dict[str, Array],
                    denominator: Array) -> tuple[Array, dict[str, Array]]:
    """One micro-batch's share of the clipped value loss (gradient w.r.t. `critic`)."""
    mask = mb["mask_bt"][:, 1:]
    new = values_bt(graphdef, critic, mb["tokens_bt"], tc.remat)
    return value_loss(new, mb["old_values_bt"], mb["returns_bt"], mask, tc.algorithm.value_clip, denominator)
