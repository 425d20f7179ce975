"""The Redis key names of one run: everything a run writes lives under `arlo:{run_id}:`."""

from __future__ import annotations

from dataclasses import dataclass

from redis.asyncio import Redis

from arlo.config import check_run_id
from arlo.coord.client import cancel_safe


@dataclass(frozen=True, slots=True)
class Keys:
    """Key names for one run. Every module builds keys here so the layout has one source."""

    run_id: str

    def __post_init__(self) -> None:
        check_run_id(self.run_id)

    @property
    def prefix(self) -> str:
        return f"arlo:{self.run_id}:"

    @property
    def traj(self) -> str:
        """Stream of serialized `Trajectory` messages, consumer group `trainer`."""
        return self.prefix + "traj"

    @property
    def traj_dead(self) -> str:
        """Stream of entries that could not be decoded, kept for inspection."""
        return self.prefix + "traj:dead"

    @property
    def traj_acked(self) -> str:
        """Counter of acknowledged entries still in `traj` (backlog fallback when XINFO has no lag)."""
        return self.prefix + "traj:acked"

    @property
    def weights(self) -> str:
        return self.prefix + "weights"

    @property
    def weights_events(self) -> str:
        """Pub/sub channel carrying each newly published version number."""
        return self.prefix + "weights:events"

    @property
    def admission_events(self) -> str:
        """Pub/sub channel: something the admission rule reads changed (a stale drop, a finished
        group, a version an inference replica now serves). Wakes the gates; carries no state."""
        return self.prefix + "admission:events"

    @property
    def rollout_accepted(self) -> str:
        """Counter of trajectories the rollout wrote for training (the admission gate's)."""
        return self.prefix + "rollout:accepted"

    @property
    def rollout_inflight(self) -> str:
        """Sorted set: the id of each group admitted and not yet finished -> the policy version its
        admission counted on. The trainer waits (bounded) for one about to age past the staleness
        bound instead of filling the batch without it (services/trainer/core/expiring.py)."""
        return self.prefix + "rollout:inflight"

    @property
    def traj_dropped_stale(self) -> str:
        """Counter of trajectories the trainer dropped as stale (given back to the gate's budget)."""
        return self.prefix + "traj:dropped_stale"

    @property
    def eval_requests(self) -> str:
        """Stream of evaluation requests, consumer group `rollout` (one worker takes each)."""
        return self.prefix + "eval:requests"

    @property
    def eval_results(self) -> str:
        """Stream of evaluation results (JSON), read by whoever asked."""
        return self.prefix + "eval:results"

    @property
    def metrics(self) -> str:
        """Stream of the trainer's per-step diagnostics (JSON, one entry per applied step, capped)."""
        return self.prefix + "metrics"

    def tasks_cursor(self, env_key: str) -> str:
        """Counter of task seeds handed out for one rollout.envs entry (its label or env name)."""
        return f"{self.prefix}tasks:cursor:{env_key}"

    def tasks_pending(self, env_key: str) -> str:
        """Sorted set of seeds handed out but not finished, scored by when (for re-issue after a crash)."""
        return f"{self.prefix}tasks:pending:{env_key}"

    def seen(self, traj_id: str) -> str:
        """Marker of a trajectory that was trained on (de-duplication)."""
        return f"{self.prefix}seen:{traj_id}"

    def status(self, service: str, instance: str) -> str:
        if not service or ":" in service:
            raise ValueError(f"service {service!r}: must be non-empty and contain no ':'")
        if not instance:
            raise ValueError("instance: must be non-empty")
        return f"{self.prefix}status:{service}:{instance}"

    @property
    def status_prefix(self) -> str:
        return self.prefix + "status:"

    @property
    def statuses(self) -> str:
        """Set of the status hash keys beaten so far: readers look these up instead of scanning
        the keyspace, which grows with the run (a `seen:{id}` key per trained trajectory)."""
        return self.prefix + "statuses"

    @property
    def trainer_lease(self) -> str:
        """Hash {token, owner, renewals, since}, expiring: the one trainer of the run (arlo/coord/lease.py)."""
        return self.prefix + "trainer:lease"

    @property
    def trainer_holder(self) -> str:
        """The token of the trainer that last acquired the lease; never expires (the fence's key)."""
        return self.prefix + "trainer:holder"

    @property
    def pattern(self) -> str:
        """Every key of the run (SCAN pattern)."""
        return self.prefix + "*"


@cancel_safe
async def delete_run(redis: Redis, run_id: str) -> int:
    """Deletes every key of a run (SCAN + UNLINK, never KEYS); returns how many were removed."""
    pattern = Keys(run_id).pattern
    removed = 0
    batch: list[bytes | str] = []
    async for key in redis.scan_iter(match=pattern, count=500):
        batch.append(key)
        if len(batch) >= 500:
            removed += int(await redis.unlink(*batch))
            batch = []
    if batch:
        removed += int(await redis.unlink(*batch))
    return removed
