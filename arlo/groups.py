"""Which GRPO groups the trainer trains on: one rule, applied by the rollout and the trainer.

The rollout counts a written group as accepted by the staleness budget only if the trainer
will train on it; were the two to disagree, the budget would leak (counted groups never
trained) or overflow. So both ask these functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from arlo.proto.v1 import common_pb2

REWARD_ATOL = 1e-6
"""Rewards closer than this count as equal (a group of them has all-zero GRPO advantages)."""
MAX_ABS_REWARD = 1e6
"""Largest |reward| anywhere (an environment's step reward, a trajectory's reward, a component):
rewards are scores (0/1, a pass rate, a few shaped terms), and one of 1e30 swamps a group's
advantages and every later statistic. No config clips rewards; the environment gateway refuses a
remote environment's reward past it and the trainer dead-letters a trajectory carrying one."""


def group_failed(group: Iterable[common_pb2.Trajectory]) -> bool:
    """One failed member masks the whole group: GRPO advantages of a half group are wrong."""
    return any(t.status == common_pb2.TRAJECTORY_STATUS_ERROR for t in group)


def has_reward_spread(rewards: Sequence[float], atol: float = REWARD_ATOL) -> bool:
    """False for a group whose rewards are all equal: its GRPO advantages are all 0."""
    return bool(rewards) and max(rewards) - min(rewards) > atol


def trainable_count(group: Sequence[common_pb2.Trajectory], *, filter_zero_variance: bool) -> int:
    """How many of a complete group's trajectories the trainer will train on: all or none.

    A failed group is dropped; with dynamic sampling (filter_zero_variance) so is a group whose
    rewards are all equal. Staleness is the trainer's own call, made when it reads the group.
    """
    if group_failed(group):
        return 0
    if filter_zero_variance and not has_reward_spread([t.reward for t in group]):
        return 0
    return len(group)
