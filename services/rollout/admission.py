"""Staleness as admission control (AReaL): start an episode only if it cannot end up too stale.

A worker may start a group of K episodes only while

    running + accepted + K <= (max_staleness + trainer_version + 1) * batch_size

where `running` counts episodes in flight across all workers, `accepted` counts trajectories
written to the stream over the run, and batch_size is trajectories per trainer step. Then
no trajectory can be older than `max_staleness` versions by the time the trainer reaches it,
so nothing generated is thrown away for staleness (discarding starves slow, hard episodes).
"""

from __future__ import annotations

import asyncio
import logging

from redis.asyncio import Redis

from arlo.coord import AdmissionCounters, RolloutStatus, WeightPointer, read_service_statuses
from arlo.coord.records import count_accepted

log = logging.getLogger(__name__)


def may_start(*, running: int, accepted: int, group_size: int, trainer_version: int, max_staleness: int,
              batch_size: int, dropped_stale: int = 0) -> bool:
    """The admission rule, as a pure function. Trajectories the trainer dropped as stale after
    they were accepted (e.g. generated before a trainer restart) are given back to the budget;
    otherwise each such drop would shrink it for good and could stop every worker."""
    return running + accepted - dropped_stale + group_size <= (max_staleness + trainer_version + 1) * batch_size


class AdmissionGate:
    """Blocks group starts that would exceed the staleness bound.

    `accepted` is a Redis counter (durable across worker restarts; `AdmissionCounters`). Other
    workers' running counts come from their heartbeats (`RolloutStatus`), so a dead worker's episodes stop counting once its
    heartbeat expires; this worker's own count is exact.
    """

    def __init__(self, redis: Redis, run_id: str, *, instance: str, max_staleness: int, batch_size: int,
                 poll_s: float = 0.2) -> None:
        self.redis = redis
        self.run_id = run_id
        self.instance = instance
        self.max_staleness = max_staleness
        self.batch_size = batch_size
        self.poll_s = poll_s
        self.pointer = WeightPointer(redis, run_id)
        self.running = 0
        self.waits = 0
        self._acquiring = asyncio.Lock()

    async def others_running(self) -> int:
        statuses = await read_service_statuses(self.redis, self.run_id, RolloutStatus)
        return sum(s.running for instance, s in statuses.items() if instance != self.instance)

    async def acquire(self, group_size: int) -> None:
        """Waits until a group of `group_size` may start, then counts it as running."""
        async with self._acquiring:  # one check-and-count at a time, or two could pass on one slot
            await self._acquire(group_size)

    async def _acquire(self, group_size: int) -> None:
        waited = False
        while True:
            # Our own count first, then the counter: `finish` raises the counter before it lowers
            # the count, so this order never sees a finished group in neither.
            own_running = self.running
            pointer = await self.pointer.get()
            version = pointer.version if pointer else 0
            counters = await AdmissionCounters.read(self.redis, self.run_id)
            running = own_running + await self.others_running()
            if may_start(running=running, accepted=counters.accepted, group_size=group_size, trainer_version=version,
                         max_staleness=self.max_staleness, batch_size=self.batch_size,
                         dropped_stale=counters.dropped_stale):
                self.running += group_size
                return
            if not waited:
                self.waits += 1
                waited = True
            await asyncio.sleep(self.poll_s)

    async def finish(self, group_size: int, written: int) -> None:
        """The group is over: it no longer runs, and `written` trajectories were accepted."""
        if written:
            await count_accepted(self.redis, self.run_id, written)
        self.running -= group_size
