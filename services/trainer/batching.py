"""From trajectories to a padded training batch: whole groups only, stale or failed groups dropped.

Pure NumPy/JAX arrays: no Redis, no gRPC. Which groups a batch holds is the core's (core/groups.py).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import jax.numpy as jnp
import numpy as np

from arlo.config import AlgorithmConfig
from arlo.filter_replay import NOT_KEPT, unpack_kept
from arlo.proto.v1 import common_pb2
from arlo.routing_replay import expert_dtype, unpack_experts
from services.trainer.advantages import overlong_penalty

log = logging.getLogger(__name__)



@dataclass(frozen=True, kw_only=True, slots=True)
class Batch:
    """A right-padded batch; token t of row b is predicted from tokens < t."""

    tokens_bt: np.ndarray  # int32
    behaviour_logprobs_bt: np.ndarray  # float32, logprob of tokens_bt[b, t] under the sampler
    mask_bt: np.ndarray  # float32, 1 where the model produced the token
    rewards_gk: np.ndarray  # float32, [groups, group_size]
    token_rewards_bt: np.ndarray
    """float32, the environment's per-turn (process) rewards: row b's turn reward sits at the turn's
    last model token (Trajectory.turn_rewards); 0 elsewhere and for trajectories without any.
    What the trainer optimises of these two is `objective_rewards`'s choice."""
    trajectory_ids: tuple[str, ...]
    num_tokens: int
    experts_btlk: np.ndarray | None = None
    """Routing replay (uint8/uint16 [rows, length, routed layers, top_k]): the experts the sampler
    recorded for token t of row b, at INPUT position t - 1 (the position whose output predicts t),
    so the forward over tokens[:, :-1] reads them at its own positions. None: nothing recorded."""
    replay_bt: np.ndarray | None = None
    """float32 [rows, length], 1 where experts_btlk holds a record (the positions before model
    tokens of trajectories that carry Trajectory.routed_experts), 0 elsewhere."""
    kept_btk: np.ndarray | None = None
    """Filter replay (int32 [rows, length, K], arlo/filter_replay.py): the ids the sampler's filter
    kept when it drew token t of row b, at position t (NOT_KEPT padded; all NOT_KEPT where nothing
    was recorded). None: filter replay is off."""

    @property
    def num_groups(self) -> int:
        return int(self.rewards_gk.shape[0])


def trained_length(traj: common_pb2.Trajectory) -> int:
    """Tokens up to and including the last model token (all of them when it has none)."""
    for i in range(len(traj.loss_mask) - 1, -1, -1):
        if traj.loss_mask[i]:
            return i + 1
    return max(len(traj.token_ids), 1)


def bucket_length(n: int, minimum: int = 16, *, longest_episode: int = 0) -> int:
    """Next power of two >= n: a small, known set of compiled train steps.

    `longest_episode` > 0 (rollout.max_episode_tokens): the longest batch the rollout can fill,
    rounded up to a multiple of `minimum`, is a bucket of its own, so no batch pads past it: at
    issue 17's 596k workload (16-token prompts, 32-token completions) every batch padded 48
    tokens to 64, a third more train-step work than the episodes hold. Longer rows (another
    producer's) take the power of two, as before."""
    length = minimum
    while length < n:
        length *= 2
    top = -(-longest_episode // minimum) * minimum
    return top if n <= top < length else length


def build_batch(groups: Sequence[Sequence[common_pb2.Trajectory]], max_seq_len: int, pad_id: int,
                *, overlong: tuple[int, int] | None = None, longest_episode: int = 0,
                routing: tuple[int, int, int] | None = None, kept_width: int = 0) -> Batch:
    """Right-pads whole groups into one batch; sequences longer than the model's context are cut.

    `overlong` = (max_tokens, buffer_tokens) adds DAPO's soft penalty on generated tokens to rewards.
    `longest_episode`: rollout.max_episode_tokens, a length bucket of its own (`bucket_length`).
    `routing`: the model's (routed layers, top_k, num_experts) (arlo.routing_replay.routing_shape):
    the trajectories' routed_experts become `experts_btlk` / `replay_bt` (None when none carries any).
    `kept_width`: K of the run's filter replay (arlo.filter_replay.kept_width; 0: off): the
    trajectories' kept_token_ids become `kept_btk`.
    """
    trajs = [t for g in groups for t in g]
    group_size = len(groups[0])
    if any(len(g) != group_size for g in groups):
        raise ValueError("all groups in a batch must have the same size")
    # Context after a row's last model token (the end-of-turn a budget cut adds, a last
    # observation) carries no loss: left out, so an episode of max_episode_tokens fits its bucket.
    longest = min(max(trained_length(t) for t in trajs), max_seq_len)
    length = min(bucket_length(longest, longest_episode=longest_episode), max_seq_len)
    tokens = np.full((len(trajs), length), pad_id, np.int32)
    logprobs = np.zeros((len(trajs), length), np.float32)
    mask = np.zeros((len(trajs), length), np.float32)
    token_rewards = np.zeros((len(trajs), length), np.float32)
    for row, t in enumerate(trajs):
        n = min(len(t.token_ids), length)
        tokens[row, :n] = t.token_ids[:n]
        logprobs[row, :n] = t.logprobs[:n]
        mask[row, :n] = t.loss_mask[:n]
        for turn in t.turn_rewards:
            # A turn cut off by the context limit keeps its reward on the last token kept.
            token_rewards[row, min(turn.token_end, n) - 1] += turn.reward
    experts, replay = _routing_arrays(trajs, length, routing)
    rewards = np.array([[t.reward for t in g] for g in groups], np.float32)
    if overlong is not None:
        generated = jnp.asarray([[sum(t.loss_mask) for t in g] for g in groups])
        rewards = rewards + np.asarray(overlong_penalty(generated, max_tokens=overlong[0], buffer_tokens=overlong[1]))
    return Batch(
        tokens_bt=tokens, behaviour_logprobs_bt=logprobs, mask_bt=mask, rewards_gk=rewards,
        token_rewards_bt=token_rewards,
        trajectory_ids=tuple(t.id for t in trajs), num_tokens=int(mask.sum()),
        experts_btlk=experts, replay_bt=replay, kept_btk=_kept_arrays(trajs, length, kept_width),
    )


def _routing_arrays(trajs: Sequence[common_pb2.Trajectory], length: int,
                    routing: tuple[int, int, int] | None) -> tuple[np.ndarray | None, np.ndarray | None]:
    """(experts_btlk, replay_bt) of `Batch`; (None, None) without routing or any record. Token t's
    record goes to position t - 1; a model token cut off by the length is left out with it."""
    if routing is None or not any(t.routed_experts for t in trajs):
        return None, None
    layers, top_k, num_experts = routing
    experts = np.zeros((len(trajs), length, layers, top_k), expert_dtype(num_experts))
    replay = np.zeros((len(trajs), length), np.float32)
    for row, t in enumerate(trajs):
        if not t.routed_experts:
            continue
        model_pos = np.flatnonzero(np.asarray(t.loss_mask, bool))
        records = unpack_experts(t.routed_experts, tokens=len(model_pos), routed_layers=layers, top_k=top_k,
                                 num_experts=num_experts)
        keep = (model_pos >= 1) & (model_pos < min(len(t.token_ids), length))
        experts[row, model_pos[keep] - 1] = records[keep]
        replay[row, model_pos[keep] - 1] = 1.0
    return experts, replay


def _kept_arrays(trajs: Sequence[common_pb2.Trajectory], length: int, width: int) -> np.ndarray | None:
    """`Batch.kept_btk`; None when off. With replay on every batch has one (NOT_KEPT where nothing
    was recorded: the trainer's own filter), so every step is the program the warm-up compiled.
    Token t's kept set goes to position t; a model token cut off by the length is left out with it."""
    if not width:
        return None
    kept = np.full((len(trajs), length, width), NOT_KEPT, np.int32)
    for row, t in enumerate(trajs):
        if not t.kept_token_ids:
            continue
        model_pos = np.flatnonzero(np.asarray(t.loss_mask, bool))
        records = unpack_kept(t.kept_token_ids, tokens=len(model_pos), width=width)
        keep = model_pos < min(len(t.token_ids), length)
        kept[row, model_pos[keep]] = records[keep]
    return kept


def objective_rewards(batch: Batch, cfg: AlgorithmConfig) -> tuple[np.ndarray, np.ndarray]:
    """The one reward the step optimises, as (rewards_gk, token_rewards_bt): reward_weight x the
    reward service's score (`batch.rewards_gk`, at each row's last model token) plus
    env_reward_weight x the environment's turn rewards (`batch.token_rewards_bt`, where they are).

    Group estimators take rewards_gk, GAE the per-token array; each row of that sums to the
    row's entry of rewards_gk, so an episode's undiscounted return is the same under both (the
    built-in environments report their correctness as a turn reward too: adding both by
    default would count it twice)."""
    rows, length = batch.mask_bt.shape
    last = length - 1 - np.argmax(batch.mask_bt[:, ::-1] > 0, axis=1)  # each row's last model token
    score = batch.rewards_gk.reshape(-1).astype(np.float32) * np.float32(cfg.reward_weight)
    tokens = batch.token_rewards_bt.astype(np.float32) * np.float32(cfg.env_reward_weight)
    tokens[np.arange(rows), last] += score
    return tokens.sum(axis=1).reshape(batch.rewards_gk.shape), tokens
