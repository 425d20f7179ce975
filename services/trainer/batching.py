"""From trajectories to a padded training batch: whole groups only, stale or failed groups dropped.

Pure Python/NumPy: no Redis, no gRPC. The server feeds stream entries in and gets batches out.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import jax.numpy as jnp
import numpy as np

from arlo.proto.v1 import common_pb2
from services.trainer.advantages import overlong_penalty


@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """A right-padded batch; token t of row b is predicted from tokens < t."""

    tokens_bt: np.ndarray  # int32
    behaviour_logprobs_bt: np.ndarray  # float32, logprob of tokens_bt[b, t] under the sampler
    mask_bt: np.ndarray  # float32, 1 where the model produced the token
    rewards_gk: np.ndarray  # float32, [groups, group_size]
    trajectory_ids: tuple[str, ...]
    num_tokens: int

    @property
    def num_groups(self) -> int:
        return int(self.rewards_gk.shape[0])


@dataclass(kw_only=True, slots=True)
class DropCounts:
    stale: int = 0
    failed: int = 0
    malformed: int = 0

    @property
    def total(self) -> int:
        return self.stale + self.failed + self.malformed


def validate_trajectory(traj: common_pb2.Trajectory) -> str | None:
    """Why a trajectory cannot be trained on, or None when it is well formed."""
    n = len(traj.token_ids)
    if n < 2:
        return "fewer than 2 tokens"
    if not (len(traj.logprobs) == len(traj.loss_mask) == len(traj.policy_versions) == n):
        return "token_ids, logprobs, loss_mask and policy_versions differ in length"
    if traj.group_size < 1 or not traj.group_id:
        return "missing group_id or group_size"
    if not any(traj.loss_mask):
        return "no model tokens (loss_mask all 0)"
    return None


def oldest_version(traj: common_pb2.Trajectory) -> int:
    versions = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
    return min(versions) if versions else -1


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadyGroup:
    trajectories: list[common_pb2.Trajectory]
    entry_ids: list[str]


@dataclass(kw_only=True)
class GroupAssembler:
    """Collects trajectories until their group is complete; hands out whole groups only."""

    max_staleness: int
    pending: dict[str, dict[str, common_pb2.Trajectory]] = field(default_factory=dict)
    drops: DropCounts = field(default_factory=DropCounts)

    def add(self, entries: Iterable[tuple[str, common_pb2.Trajectory]]) -> None:
        # Keyed by entry id: an entry re-delivered by XAUTOCLAIM must not fill its group twice.
        for entry_id, traj in entries:
            self.pending.setdefault(traj.group_id, {})[entry_id] = traj

    def take_ready(self, trainer_version: int) -> tuple[list[ReadyGroup], list[str]]:
        """Complete usable groups, and the entry ids of complete groups that were dropped."""
        ready: list[ReadyGroup] = []
        dropped: list[str] = []
        for gid in list(self.pending):
            members = self.pending[gid]
            if len(members) < next(iter(members.values())).group_size:
                continue
            del self.pending[gid]
            trajs = list(members.values())
            if self._judge(trajs, trainer_version) is None:
                ready.append(ReadyGroup(trajectories=trajs, entry_ids=list(members)))
            else:
                dropped.extend(members)
        return ready, dropped

    def _judge(self, group: Sequence[common_pb2.Trajectory], trainer_version: int) -> str | None:
        # One bad member masks the whole group: GRPO advantages of a half group are wrong.
        if any(validate_trajectory(t) for t in group):
            self.drops.malformed += len(group)
            return "malformed"
        if any(t.status == common_pb2.TRAJECTORY_STATUS_ERROR for t in group):
            self.drops.failed += len(group)
            return "failed"
        if min(oldest_version(t) for t in group) < trainer_version - self.max_staleness:
            self.drops.stale += len(group)
            return "stale"
        return None


def has_reward_spread(group: ReadyGroup, atol: float = 1e-6) -> bool:
    """False for a group whose rewards are all equal: its GRPO advantages are all 0."""
    rewards = [t.reward for t in group.trajectories]
    return max(rewards) - min(rewards) > atol


def bucket_length(n: int, minimum: int = 16) -> int:
    """Next power of two >= n: a small, known set of compiled train steps."""
    length = minimum
    while length < n:
        length *= 2
    return length


def build_batch(groups: Sequence[Sequence[common_pb2.Trajectory]], max_seq_len: int, pad_id: int,
                *, overlong: tuple[int, int] | None = None) -> Batch:
    """Right-pads whole groups into one batch; sequences longer than the model's context are cut.

    `overlong` = (max_tokens, buffer_tokens) adds DAPO's soft penalty on generated tokens to rewards.
    """
    trajs = [t for g in groups for t in g]
    group_size = len(groups[0])
    if any(len(g) != group_size for g in groups):
        raise ValueError("all groups in a batch must have the same size")
    longest = min(max(len(t.token_ids) for t in trajs), max_seq_len)
    length = min(bucket_length(longest), max_seq_len)
    tokens = np.full((len(trajs), length), pad_id, np.int32)
    logprobs = np.zeros((len(trajs), length), np.float32)
    mask = np.zeros((len(trajs), length), np.float32)
    for row, t in enumerate(trajs):
        n = min(len(t.token_ids), length)
        tokens[row, :n] = t.token_ids[:n]
        logprobs[row, :n] = t.logprobs[:n]
        mask[row, :n] = t.loss_mask[:n]
    rewards = np.array([[t.reward for t in g] for g in groups], np.float32)
    if overlong is not None:
        generated = jnp.asarray([[sum(t.loss_mask) for t in g] for g in groups])
        rewards = rewards + np.asarray(overlong_penalty(generated, max_tokens=overlong[0], buffer_tokens=overlong[1]))
    return Batch(
        tokens_bt=tokens, behaviour_logprobs_bt=logprobs, mask_bt=mask, rewards_gk=rewards,
        trajectory_ids=tuple(t.id for t in trajs), num_tokens=int(mask.sum()),
    )
