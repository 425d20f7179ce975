"""What holds a run that makes no step: the counters and limits behind it, in words.

`arlo train`/`demo` ask here when the trainer takes no step for too long, so the error names
the counter or the limit (the admission budget, the backlog, a checkpoint hold, the rollout's
refused episodes, the dead letters) instead of pointing at the service logs. Also where the
driver learns that a rollout worker refused an episode the config cannot hold
(`RolloutStatus.refused`): a run stops on that at once, with the worker's message.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio import Redis

from arlo.config import RunConfig
from arlo.coord import AdmissionCounters, Keys, RolloutStatus, TrajectoryStream, WeightPointer
from arlo.coord.client import text
from arlo.coord.heartbeat import read_statuses
from arlo.coord.records import headroom, read_service_statuses


class RunHolds:
    def __init__(self, redis: Redis, cfg: RunConfig) -> None:
        self.redis, self.cfg = redis, cfg

    async def refused(self, since: float) -> str | None:
        """A rollout worker's refusal beaten after unix time `since` (a worker killed before then,
        e.g. by an earlier `arlo train` with another config, beats no more), or None."""
        for raw in await read_statuses(self.redis, self.cfg.run_id, RolloutStatus.SERVICE):
            if raw.get("refused") and float(raw.get("ts") or 0) > since:
                return raw["refused"]
        return None

    async def explain(self, status: Any) -> str:
        """Why the trainer (its GetStatus `status`) takes no step: every hold that applies."""
        run, trainer = self.cfg.run_id, self.cfg.trainer
        batch = trainer.groups_per_step * self.cfg.rollout.group_size
        counters = await AdmissionCounters.read(self.redis, run)
        pointer = await WeightPointer(self.redis, run).get()
        version = pointer.version if pointer else 0
        rollouts = await read_service_statuses(self.redis, run, RolloutStatus)
        running = sum(s.running for s in rollouts.values())
        holds: list[str] = []
        trainers = await read_statuses(self.redis, run, "trainer")
        waiting = next((t["waiting_on"] for t in trainers if t.get("waiting_on")), "")
        if waiting:  # the core's own account of what it waits for (core/trainer.py `waiting`)
            holds.append(f"the trainer waits: {waiting}")
        if not rollouts:
            holds.append("no rollout worker is beating (none started, or all died: their logs say why)")
        refused = next((s.refused for s in rollouts.values() if s.refused), "")
        if refused:
            holds.append(f"the rollout refuses episodes: {refused}")
        failing = [s for s in rollouts.values() if s.last_failure]
        if failing:  # the cause, not only "N trajectories queued" (issue 33, item 3)
            failed = sum(s.failed_groups for s in rollouts.values())
            holds.append(f"the rollout's episodes fail ({failed} groups so far), the last: {failing[0].last_failure}")
        backlog = await TrajectoryStream(self.redis, run, consumer="driver").backlog()
        room = headroom(running=running, accepted=counters.accepted, trainer_version=version,
                        max_staleness=trainer.max_staleness, batch_size=batch, dropped_stale=counters.dropped_stale,
                        backlog=backlog)
        if rollouts and room < self.cfg.rollout.group_size:
            # The gate's own rule (records.headroom), with each term named as the keys and settings are.
            counted = counters.accepted - counters.dropped_stale - version * batch
            holds.append(
                f"the admission budget is spent: {running} episodes running + {min(counted, backlog)} queued for the "
                f"trainer (the stream's backlog {backlog}, at most rollout:accepted {counters.accepted} - "
                f"traj:dropped_stale {counters.dropped_stale} - version {version} x batch {batch}) leave room for "
                f"{max(room, 0)} under (trainer.max_staleness {trainer.max_staleness} + 1) x batch {batch} "
                f"(trainer.groups_per_step x rollout.group_size), less than a group of {self.cfg.rollout.group_size}")
        holds.extend(await self._queue_holds(status, batch))
        if not holds:
            holds.append(f"no limit found holding it ({_counts(status)}); the service logs say more")
        return "; ".join(holds)

    async def _queue_holds(self, status: Any, batch: int) -> list[str]:
        keys = Keys(self.cfg.run_id)
        queued, dead = await self.redis.xlen(keys.traj), await self.redis.xlen(keys.traj_dead)
        holds: list[str] = []
        if dead:
            last = await self.redis.xrevrange(keys.traj_dead, count=1)
            fields = {text(k): v for k, v in last[0][1].items()} if last else {}
            reason = text(fields.get("dead:reason", b""))
            holds.append(f"{dead} trajectories in {keys.traj_dead}, the last refused as {reason!r}")
        if status.held_entries:
            holds.append(f"{status.held_entries} trained entries are held for a checkpoint "
                         f"(trainer.checkpoint_every) against redis.max_backlog {self.cfg.redis.max_backlog}")
        if queued >= self.cfg.redis.max_backlog:
            holds.append(f"the trajectory stream is full: {queued} entries, redis.max_backlog "
                         f"{self.cfg.redis.max_backlog}")
        elif not holds and queued < batch:
            holds.append(f"{queued} trajectories queued, {batch} needed for a step "
                         f"(trainer.groups_per_step {self.cfg.trainer.groups_per_step} x rollout.group_size "
                         f"{self.cfg.rollout.group_size})")
        return holds


def _counts(status: Any) -> str:
    return (f"trainer step {status.step}, version {status.version}, {status.trajectories_consumed} trajectories "
            f"trained, {status.trajectories_dropped} dropped")
