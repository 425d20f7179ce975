"""The learner: a functional, jitted GRPO step over an NNX model's state.

The model is split once (`nnx.split`); the step is `jax.jit` over (state, opt_state, batch)
with both donated, because `nnx.jit` would walk the module graph in Python on every call.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from arlo.model import ModelConfig, create_model, token_logprobs
from services.trainer.advantages import grpo_advantages
from services.trainer.batching import Batch
from services.trainer.losses import ClipConfig, clipped_surrogate_loss


@dataclass(frozen=True, kw_only=True, slots=True)
class LearnerConfig:
    learning_rate: float = 1e-3
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0
    clip: ClipConfig = ClipConfig()
    scale_adv_by_std: bool = True


@dataclass(frozen=True, kw_only=True, slots=True)
class StepMetrics:
    loss: float
    reward_mean: float
    clip_fraction: float
    approx_kl: float
    grad_norm: float
    num_tokens: int


def make_optimizer(cfg: LearnerConfig) -> optax.GradientTransformation:
    return optax.chain(
        optax.clip_by_global_norm(cfg.max_grad_norm),
        optax.adamw(cfg.learning_rate, weight_decay=cfg.weight_decay),
    )


class Learner:
    """Holds the policy state and optimizer state; `step` applies one GRPO update."""

    def __init__(self, model_cfg: ModelConfig, *, seed: int, cfg: LearnerConfig) -> None:
        self.model_cfg = model_cfg
        self.cfg = cfg
        self.graphdef, self.state = nnx.split(create_model(model_cfg, seed))
        self._tx = make_optimizer(cfg)
        self.opt_state = self._tx.init(self.state)
        self.step_count = 0
        self._step = jax.jit(functools.partial(_train_step, self.graphdef, self._tx, cfg), donate_argnums=(0, 1))

    def step(self, batch: Batch) -> StepMetrics:
        device_batch = {
            "tokens_bt": jnp.asarray(batch.tokens_bt),
            "behaviour_logprobs_bt": jnp.asarray(batch.behaviour_logprobs_bt),
            "mask_bt": jnp.asarray(batch.mask_bt),
            "rewards_gk": jnp.asarray(batch.rewards_gk),
        }
        self.state, self.opt_state, metrics = self._step(self.state, self.opt_state, device_batch)
        self.step_count += 1
        host = jax.device_get(metrics)  # one deliberate sync per step, for logging
        return StepMetrics(
            loss=float(host["loss"]), reward_mean=float(np.mean(batch.rewards_gk)),
            clip_fraction=float(host["clip_fraction"]), approx_kl=float(host["approx_kl"]),
            grad_norm=float(host["grad_norm"]), num_tokens=batch.num_tokens,
        )


def _train_step(
    graphdef: Any, tx: optax.GradientTransformation, cfg: LearnerConfig,
    state: nnx.State, opt_state: Any, batch: dict[str, jax.Array],
) -> tuple[nnx.State, Any, dict[str, jax.Array]]:
    advantages_b = grpo_advantages(batch["rewards_gk"], scale_by_std=cfg.scale_adv_by_std).reshape(-1)

    def loss_fn(state: nnx.State) -> tuple[jax.Array, dict[str, jax.Array]]:
        model = nnx.merge(graphdef, state)
        tokens = batch["tokens_bt"]
        logits_btv = model(tokens[:, :-1])
        logprobs_bt = token_logprobs(logits_btv, tokens[:, 1:])
        return clipped_surrogate_loss(
            logprobs_bt, batch["behaviour_logprobs_bt"][:, 1:], advantages_b, batch["mask_bt"][:, 1:], cfg.clip
        )

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(state)
    updates, opt_state = tx.update(grads, opt_state, state)
    state = optax.apply_updates(state, updates)
    return state, opt_state, {**metrics, "loss": loss, "grad_norm": optax.tree.norm(grads)}
