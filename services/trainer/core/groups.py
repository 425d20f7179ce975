"""Groups before they are batched: validation, whole-group assembly, the staleness judgement.

Pure Python on the stream's records (no JAX, no Redis): the trainer core (core/book.py) feeds
stream entries in and takes whole, fresh groups out.
"""

from __future__ import annotations

import logging
import math
import time
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from arlo import groups
from arlo.filter_replay import NOT_KEPT, unpack_kept
from arlo.groups import MAX_ABS_REWARD, REWARD_ATOL, group_failed
from arlo.proto.v1 import common_pb2
from services.trainer.core.lineage import MAX_VERSION, Lineage

log = logging.getLogger(__name__)

MAX_GROUP_SIZE = 1024  # rollout.group_size's bound: a larger claim can never complete
CLOSED_GROUPS_KEPT = 100_000


@dataclass(kw_only=True, slots=True)
class DropCounts:
    stale: int = 0
    failed: int = 0
    malformed: int = 0
    poisoned: int = 0
    """A non-finite or out-of-bounds reward, logprob, loss_mask or policy version, or a token id
    outside the vocabulary (dead-lettered; poison_reason)."""

    @property
    def total(self) -> int:
        return self.stale + self.failed + self.malformed + self.poisoned


def validate_trajectory(traj: common_pb2.Trajectory, routing_bytes: int = 0, kept_width: int = 0,
                        vocab_size: int = 0) -> str | None:
    """Why a trajectory cannot be trained on, or None when it is well formed. `routing_bytes`: the
    model's bytes of routed_experts per model token (arlo/routing_replay.py; 0: not checked).
    `kept_width`: the run's filter replay K (arlo/filter_replay.py; 0: kept_token_ids ignored);
    `vocab_size` bounds its ids (0: not checked)."""
    n = len(traj.token_ids)
    if n < 2:
        return "fewer than 2 tokens"
    if not (len(traj.logprobs) == len(traj.loss_mask) == len(traj.policy_versions) == n):
        return "token_ids, logprobs, loss_mask and policy_versions differ in length"
    if traj.group_size < 1 or not traj.group_id:
        return "missing group_id or group_size"
    if traj.group_size > MAX_GROUP_SIZE:
        return f"group_size {traj.group_size} > {MAX_GROUP_SIZE}"
    if not any(traj.loss_mask):
        return "no model tokens (loss_mask all 0)"
    ends = [r.token_end for r in traj.turn_rewards]
    if any(not 1 <= e <= n for e in ends) or ends != sorted(ends):
        return f"turn_rewards token_end must be ascending in [1, {n}]"
    if routing_bytes and traj.routed_experts:
        want = sum(1 for m in traj.loss_mask if m) * routing_bytes
        if len(traj.routed_experts) != want:
            return (f"routed_experts has {len(traj.routed_experts)} bytes; the model tokens x {routing_bytes} bytes "
                    f"per token is {want}")
    if kept_width and traj.kept_token_ids:
        return kept_sets_reason(traj, kept_width, vocab_size)
    return None


def kept_sets_reason(traj: common_pb2.Trajectory, width: int, vocab_size: int = 0) -> str | None:
    """Why a trajectory's kept sets are unusable: the wrong size, an id outside the vocabulary
    (a gather past it reads NaN: the whole step would be skipped) or twice in one set (a set the
    sampler cannot have kept), or a model token its own kept set does not hold (the sampler draws
    only from it; such a record would score the token over a set that never sampled it)."""
    model_pos = np.flatnonzero(np.asarray(traj.loss_mask, bool))
    try:
        kept = unpack_kept(traj.kept_token_ids, tokens=len(model_pos), width=width)
    except ValueError as e:
        return str(e)
    if kept.size and (kept.min() < NOT_KEPT or (vocab_size > 0 and kept.max() >= vocab_size)):
        return f"kept_token_ids: an id outside [0, {vocab_size}) (or -1 for none): {int(kept.min())}..{int(kept.max())}"
    ordered = np.sort(kept, axis=1)
    if ((ordered[:, 1:] == ordered[:, :-1]) & (ordered[:, 1:] != NOT_KEPT)).any():
        return "kept_token_ids: an id twice in one kept set"
    drawn = np.asarray(traj.token_ids, np.int64)[model_pos]
    missing = np.flatnonzero(~(kept == drawn[:, None]).any(axis=1))
    if missing.size:
        return f"kept_token_ids: model token {int(model_pos[missing[0]])} is not in the kept set it was drawn from"
    return None


MAX_LOGPROB = 1e-3
"""A model token's behaviour logprob above this is not a log-probability (0 is certainty; the
margin is bf16 rounding of a near-certain token)."""
MIN_LOGPROB = -1e4
"""A sampled token's logprob below this cannot have been drawn (probability e^-10000); float32
logits give log-softmax values of a few hundred at worst. A finite -1e30 overflows the
importance ratio to inf (tests/unit/test_trainer_learner.py's huge_negative_logprob)."""


def poison_reason(traj: common_pb2.Trajectory, vocab_size: int) -> str | None:
    """Why a trajectory's values would corrupt the weights, or None.

    One NaN or inf reaches every parameter through the advantages (rewards) or the importance
    ratios (logprobs), and an id outside [0, vocab_size) indexes the embedding out of range
    (JAX clamps or fills it silently), so every token counts, loss mask 0 included. Finite
    extremes do the same harm: a reward past MAX_ABS_REWARD, a model token's logprob outside
    [MIN_LOGPROB, MAX_LOGPROB], a loss_mask other than 0 or 1 (the mask is the loss's per-token
    weight), a policy version outside the version range (it decides staleness).
    """
    return _reward_reason(traj) or _token_reason(traj, vocab_size)


def _out_of_bounds(value: float) -> str | None:
    if not math.isfinite(value):
        return "non-finite "
    return f"out-of-bounds (past +-{MAX_ABS_REWARD:g}) " if abs(value) > MAX_ABS_REWARD else None


def _reward_reason(traj: common_pb2.Trajectory) -> str | None:
    what = _out_of_bounds(traj.reward)
    if what:
        return f"{what}reward {traj.reward}"
    for name, value in traj.reward_components.items():
        what = _out_of_bounds(value)
        if what:
            return f"{what}reward component {name[:64]!r}: {value}"
    for turn in traj.turn_rewards:
        what = _out_of_bounds(turn.reward)
        if what:
            return f"{what}turn reward {turn.reward} at token_end {turn.token_end}"
    return None


def _token_reason(traj: common_pb2.Trajectory, vocab_size: int) -> str | None:
    tokens = np.asarray(traj.token_ids, np.int64)
    if tokens.size and (tokens.min() < 0 or (vocab_size > 0 and tokens.max() >= vocab_size)):
        return f"token id outside [0, {vocab_size}): {int(tokens.min())}..{int(tokens.max())}"
    mask = np.asarray(traj.loss_mask, np.int64)
    if mask.size and mask.max() > 1:
        return f"loss_mask holds {int(mask.max())}; each token's mask is 0 (context) or 1 (model)"
    logprobs = np.asarray(traj.logprobs, np.float64)
    if np.isnan(logprobs).any():
        return "NaN logprob"
    model = logprobs[mask == 1]
    if not np.isfinite(model).all():
        return "non-finite logprob on a loss-masked (model) token"
    if not np.isfinite(logprobs[1:]).all():
        # The loss reads every token's logprob after the first, times its mask: -inf x 0 is NaN.
        return "non-finite logprob on a context token (only the first token's is never read)"
    if model.size and not MIN_LOGPROB <= model.min() <= model.max() <= MAX_LOGPROB:
        return (f"logprob on a model token outside [{MIN_LOGPROB:g}, {MAX_LOGPROB:g}]: "
                f"{model.min():g}..{model.max():g}")
    versions = np.asarray(traj.policy_versions, np.int64)
    # Context tokens carry -1 (no policy sampled them); a model token's version is a published one.
    if versions.size and ((versions < mask - 1).any() or versions.max() > MAX_VERSION):
        return (f"policy version outside [0, {MAX_VERSION}] on a model token or [-1, {MAX_VERSION}] on a "
                f"context token: {int(versions.min())}..{int(versions.max())}")
    return None


def future_reason(traj: common_pb2.Trajectory, newest: int) -> str | None:
    """Why a trajectory sampled from a version this trainer never had is refused, or None. This
    trainer numbers every version it publishes (a foreign pointer's included: it renumbers above
    it), so a sample newer than its current version claims weights that never existed; admitted,
    it would count as the freshest of samples (10^15 passed intake, issue 33 item 16)."""
    versions = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
    if versions and max(versions) > newest:
        return f"policy version {max(versions)} is newer than this trainer's newest version {newest}"
    return None


def oldest_version(traj: common_pb2.Trajectory) -> int:
    versions = [v for v, m in zip(traj.policy_versions, traj.loss_mask, strict=True) if m]
    return min(versions) if versions else -1


def group_oldest_version(trajectories: Sequence[common_pb2.Trajectory]) -> int:
    """The oldest policy version any model token of the group was sampled from."""
    return min(oldest_version(t) for t in trajectories)


@dataclass(frozen=True, kw_only=True, slots=True)
class ReadyGroup:
    trajectories: list[common_pb2.Trajectory]
    entry_ids: list[str]
    read_at: float = 0.0
    """Unix time the read that completed the group returned, and when intake had judged it ready."""
    ready_at: float = 0.0


@dataclass(kw_only=True)
class GroupAssembler:
    """Collects trajectories until their group is complete; hands out whole groups only.

    Nothing is held forever: a malformed member drops its group at once (and its later members
    on arrival), and a group still incomplete `incomplete_timeout_s` after its first member came
    (its producer died mid-group, or it claims members that never come) is dropped as failed.
    """

    max_staleness: int
    vocab_size: int = 0
    lineage: Lineage | None = None
    """How fresh a group must be (core/lineage.py); default: `max_staleness` on plain version numbers."""
    """Token ids must lie in [0, vocab_size) (0: only >= 0 is checked)."""
    incomplete_timeout_s: float = 600.0
    routing_bytes: int = 0
    """Bytes of routed_experts per model token (validate_trajectory); 0: not checked."""
    kept_width: int = 0
    """Filter replay's K (validate_trajectory); 0: kept_token_ids ignored."""
    pending: dict[str, dict[str, common_pb2.Trajectory]] = field(default_factory=dict)
    drops: DropCounts = field(default_factory=DropCounts)
    _first_seen: dict[str, float] = field(default_factory=dict)
    _closed: OrderedDict[str, str] = field(default_factory=OrderedDict)  # group id -> why its members drop
    _rejected: list[str] = field(default_factory=list)  # dropped entry ids not yet handed out
    _dead: list[tuple[str, common_pb2.Trajectory, str]] = field(default_factory=list)  # to dead-letter

    def __post_init__(self) -> None:
        if self.lineage is None:
            self.lineage = Lineage(max_staleness=self.max_staleness)

    def add(self, entries: Iterable[tuple[str, common_pb2.Trajectory]], now: float | None = None, *,
            newest: int | None = None) -> None:
        """`newest`: the newest version this trainer has (a sample of a later one is poisoned)."""
        now = time.monotonic() if now is None else now
        # Keyed by entry id: an entry re-delivered by XAUTOCLAIM must not fill its group twice.
        for entry_id, traj in entries:
            gid = traj.group_id
            reason = self._closed.get(gid)
            if reason is None and group_failed((traj,)):
                reason = "failed"  # a masked group (its worker gave up on it): no need to wait for the rest
                self._close(gid, reason)
            elif reason is None and (why := self._invalid(traj, newest)) is not None:
                # The member itself is dead-lettered with its reason (inspectable); its group closes.
                kind = "malformed" if self.malformed(traj) else "poisoned"
                log.warning("group %r dropped: member %r is %s (%s)", gid[:64], traj.id[:64], kind, why)
                self._close(gid, kind)
                setattr(self.drops, kind, getattr(self.drops, kind) + 1)
                self._dead.append((entry_id, traj, why))
                continue
            if reason is not None:
                self._drop([entry_id], reason)
                continue
            members = self.pending.setdefault(gid, {})
            if not members:
                self._first_seen[gid] = now
            members[entry_id] = traj

    def take_ready(self, trainer_version: int, now: float | None = None) -> tuple[list[ReadyGroup], list[str]]:
        """Complete usable groups, and the entry ids dropped since the last call (finished with)."""
        now = time.monotonic() if now is None else now
        ready: list[ReadyGroup] = []
        for gid in list(self.pending):
            members = self.pending[gid]
            if len(members) < next(iter(members.values())).group_size:
                if now - self._first_seen[gid] > self.incomplete_timeout_s:
                    log.warning("group %r dropped: %d of %d members after %.0fs", gid[:64], len(members),
                                next(iter(members.values())).group_size, now - self._first_seen[gid])
                    self._close(gid, "failed")
                continue
            del self.pending[gid]
            del self._first_seen[gid]
            trajs = list(members.values())
            reason = self._judge(trajs, trainer_version)
            # Members beyond group_size would start a group that never completes: drop them on arrival.
            self._remember(gid, reason or "failed")
            if reason is None:
                ready.append(ReadyGroup(trajectories=trajs, entry_ids=list(members)))
            else:
                self._rejected.extend(members)
        dropped, self._rejected = self._rejected, []
        return ready, dropped

    def has_whole(self, gid: str) -> bool:
        """Whether group `gid` arrived whole here (ready, trained or dropped since), or was closed."""
        return gid in self._closed

    def take_dead(self) -> list[tuple[str, common_pb2.Trajectory, str]]:
        """(entry id, trajectory, reason) of members rejected since the last call, for `traj:dead`."""
        dead, self._dead = self._dead, []
        return dead

    def malformed(self, traj: common_pb2.Trajectory) -> str | None:
        """`validate_trajectory` with this run's record sizes."""
        return validate_trajectory(traj, self.routing_bytes, self.kept_width, self.vocab_size)

    def _invalid(self, traj: common_pb2.Trajectory, newest: int | None) -> str | None:
        return self.malformed(traj) or poison_reason(traj, self.vocab_size) \
            or (None if newest is None else future_reason(traj, newest))

    def _close(self, gid: str, reason: str) -> None:
        """Drops the group's pending members now, and its later members on arrival."""
        members = self.pending.pop(gid, {})
        self._first_seen.pop(gid, None)
        self._drop(list(members), reason)
        self._remember(gid, reason)

    def _remember(self, gid: str, reason: str) -> None:
        self._closed[gid] = reason
        while len(self._closed) > CLOSED_GROUPS_KEPT:
            self._closed.popitem(last=False)

    def _drop(self, entry_ids: list[str], reason: str) -> None:
        setattr(self.drops, reason, getattr(self.drops, reason) + len(entry_ids))
        self._rejected.extend(entry_ids)

    def _judge(self, group: Sequence[common_pb2.Trajectory], trainer_version: int) -> str | None:
        # One bad member masks the whole group: GRPO advantages of a half group are wrong.
        if any(self.malformed(t) for t in group):
            self.drops.malformed += len(group)
            return "malformed"
        if group_failed(group):
            self.drops.failed += len(group)
            return "failed"
        assert self.lineage is not None
        if not self.lineage.admissible(group_oldest_version(group), trainer_version):
            self.drops.stale += len(group)
            return "stale"
        return None


def has_reward_spread(group: ReadyGroup, atol: float = REWARD_ATOL) -> bool:
    """False for a group whose rewards are all equal: its GRPO advantages are all 0 (arlo/groups.py)."""
    return groups.has_reward_spread([t.reward for t in group.trajectories], atol)
