"""One optimizer step's diagnostics as a flat record: what metrics.jsonl, TensorBoard, Prometheus
and `arlo status` show.

Pure: built from the learner's `StepMetrics`, the step's trajectories and the loop's counters.
Field names are the exported names; a metric the objective does not compute this run (kl_ref
without a KL penalty, entropy without an entropy bonus) is absent, not 0, so a plot shows a gap
rather than a fake value. Every further scalar the objective returns is kept under its own name.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from arlo.proto.v1 import common_pb2
from services.trainer.learner import StepMetrics

RENAMED = {"is_weight_mean": "is_weight"}
"""Objective metric names -> exported names."""


def staleness_stats(trajs: Sequence[common_pb2.Trajectory], trainer_version: int) -> tuple[float, int]:
    """(mean, max) over model tokens of how many versions their sampling policy was behind
    `trainer_version` (the version the step trains from)."""
    lags = [trainer_version - v for t in trajs for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m]
    return (sum(lags) / len(lags), max(lags)) if lags else (0.0, 0)


UNNAMED_ENV = "unnamed"
"""The environment key of a trajectory that carries no `env_name` (a producer that sets none)."""


def per_env_stats(trajs: Sequence[common_pb2.Trajectory]) -> dict[str, dict[str, float]]:
    """Mean reward and trajectory count per environment (Trajectory.env_name: the mixture entry's
    label), so a mixture shows which of its environments the policy is learning."""
    rewards: dict[str, list[float]] = {}
    for t in trajs:
        rewards.setdefault(t.env_name or UNNAMED_ENV, []).append(t.reward)
    return {"reward_by_env": {k: sum(v) / len(v) for k, v in sorted(rewards.items())},
            "trajectories_by_env": {k: len(v) for k, v in sorted(rewards.items())}}


def trajectory_stats(trajs: Sequence[common_pb2.Trajectory]) -> dict[str, Any]:
    """Response lengths (model tokens), turns, environment (process) rewards, reward components,
    and reward per environment of the mixture."""
    if not trajs:
        return {}
    lengths = [sum(t.loss_mask) for t in trajs]
    components: dict[str, list[float]] = {}
    for t in trajs:
        for name, value in t.reward_components.items():
            components.setdefault(name, []).append(value)
    turn_rewards = [sum(r.reward for r in t.turn_rewards) for t in trajs]
    finish: dict[str, int] = {}
    for t in trajs:
        finish[t.finish_reason] = finish.get(t.finish_reason, 0) + 1
    return {
        "response_length_mean": sum(lengths) / len(lengths), "response_length_max": max(lengths),
        "turns_mean": sum(t.num_turns for t in trajs) / len(trajs),
        "env_reward_mean": sum(turn_rewards) / len(trajs),
        # Mean over the trajectories that carry the component (a composite's parts may differ).
        "reward_components": {k: sum(v) / len(v) for k, v in sorted(components.items())},
        "finish_reasons": dict(sorted(finish.items())),
        **per_env_stats(trajs),
    }


def step_record(*, phase: str, step: int, version: int, metrics: StepMetrics, counters: Mapping[str, Any],
                trajectories: Sequence[common_pb2.Trajectory] = (), trained_from: int = 0,
                now: float | None = None, timing: Mapping[str, float] | None = None,
                anatomy: Mapping[str, Any] | None = None, staleness: tuple[float, int] | None = None) -> dict[str, Any]:
    """`counters`: the loop's cumulative figures (tokens_trained, generated_tokens, consumed,
    skipped_steps, queue_depth, dropped by reason). `trained_from`: the version the step's
    gradients were taken at (its staleness reference). `timing` and `anatomy`: where the step's
    time went (services/trainer/anatomy.py), kept as the record's `timing` and `anatomy`.
    `staleness`: (mean, max) lag as the core judged it (after a restore, in lineage terms:
    core/lineage.py); by default from the trajectories' versions and `trained_from`."""
    record: dict[str, Any] = {
        "step": step, "version": version, "phase": phase, "time": time.time() if now is None else now,
        "loss": metrics.loss, "grad_norm": metrics.grad_norm, "num_tokens": metrics.num_tokens,
        **counters,
    }
    if phase == "rl":
        mean, worst = staleness if staleness is not None else staleness_stats(trajectories, trained_from)
        record.update(reward_mean=metrics.reward_mean, clip_fraction=metrics.clip_fraction,
                      approx_kl=metrics.approx_kl, staleness_mean=mean, staleness_max=worst,
                      num_trajectories=len(trajectories), **trajectory_stats(trajectories))
    if timing:
        record["timing"] = dict(timing)
    if anatomy:
        record["anatomy"] = dict(anatomy)
    for name, value in metrics.extra.items():
        record.setdefault(RENAMED.get(name, name), value)
    return record
