"""The trainer's optimizers: AdamW behind a global grad-norm clip, on a warmup/decay schedule.

RL, the critic (`algorithm.advantage: gae`) and the SFT warm start each get their own, with
their own learning rate, so a warm start leaves RL a fresh AdamW.
"""

from __future__ import annotations

import optax

from arlo.config import TrainerConfig


def make_schedule(learning_rate: float, warmup_steps: int, total_steps: int) -> optax.Schedule:
    """Linear warmup, then constant, or (total_steps > 0) cosine decay to 10% of the peak."""
    if total_steps > 0:
        return optax.warmup_cosine_decay_schedule(
            init_value=0.0 if warmup_steps else learning_rate, peak_value=learning_rate,
            warmup_steps=warmup_steps, decay_steps=max(total_steps, warmup_steps + 1),
            end_value=learning_rate * 0.1)
    if warmup_steps > 0:
        return optax.linear_schedule(0.0, learning_rate, warmup_steps)
    return optax.constant_schedule(learning_rate)


def _adamw(schedule: optax.Schedule, tc: TrainerConfig) -> optax.GradientTransformation:
    return optax.chain(optax.clip_by_global_norm(tc.max_grad_norm),
                       optax.adamw(schedule, weight_decay=tc.weight_decay))


def rl_optimizer(tc: TrainerConfig) -> optax.GradientTransformation:
    return _adamw(make_schedule(tc.learning_rate, tc.warmup_steps, tc.total_steps), tc)


def critic_optimizer(tc: TrainerConfig) -> optax.GradientTransformation:
    """The critic's AdamW: the RL schedule's shape at `algorithm.critic_learning_rate`."""
    lr = tc.algorithm.critic_learning_rate or tc.learning_rate
    return _adamw(make_schedule(lr, tc.warmup_steps, tc.total_steps), tc)


def sft_optimizer(tc: TrainerConfig) -> optax.GradientTransformation:
    """The SFT warm start's optimizer: its own learning rate and warmup, constant afterwards."""
    return _adamw(make_schedule(tc.sft.learning_rate or tc.learning_rate, tc.sft.warmup_steps, 0), tc)
