"""Typed records of what services tell each other through Redis, beside the trajectory stream.

The staleness budget is kept by two counters (the rollout's accepted trajectories, the
trainer's stale drops) and by the rollout workers' heartbeats (episodes running). Writers and
readers go through these records, so a field is named, typed and parsed in one place, and the
key names come from `Keys` (the layout in docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self, TypeVar

from redis.asyncio import Redis

from arlo.coord.client import cancel_safe, text
from arlo.coord.heartbeat import Field, read_statuses
from arlo.coord.keys import Keys


@dataclass(frozen=True, kw_only=True, slots=True)
class AdmissionCounters:
    """The run's admission counters (plain Redis integers, durable across restarts)."""

    accepted: int = 0
    """Trajectories the rollout wrote for training (`rollout:accepted`)."""
    dropped_stale: int = 0
    """Trajectories the trainer dropped as stale after they were accepted (`traj:dropped_stale`)."""

    @classmethod
    @cancel_safe
    async def read(cls, redis: Redis, run_id: str) -> AdmissionCounters:
        keys = Keys(run_id)
        accepted, stale = await redis.mget(keys.rollout_accepted, keys.traj_dropped_stale)
        return cls(accepted=_count(accepted, keys.rollout_accepted), dropped_stale=_count(stale, keys.traj_dropped_stale))


def _count(raw: bytes | str | None, key: str) -> int:
    try:
        return int(text(raw)) if raw is not None else 0
    except ValueError:
        raise ValueError(f"{key}: expected an integer counter, got {raw!r}") from None


@cancel_safe
async def count_accepted(redis: Redis, run_id: str, n: int) -> None:
    """The rollout wrote `n` more trajectories that the trainer will train on (0: a group ended
    with nothing written, which frees its budget all the same: the other gates are told)."""
    keys = Keys(run_id)
    pipe = redis.pipeline(transaction=False)
    if n:
        pipe.incrby(keys.rollout_accepted, n)
    pipe.publish(keys.admission_events, "finished")
    await pipe.execute()


@cancel_safe
async def count_dropped_stale(redis: Redis, run_id: str, n: int) -> None:
    """The trainer dropped `n` accepted trajectories as stale: given back to the rollout's budget."""
    keys = Keys(run_id)
    pipe = redis.pipeline(transaction=False)
    pipe.incrby(keys.traj_dropped_stale, n)
    pipe.publish(keys.admission_events, "stale")
    await pipe.execute()


S = TypeVar("S", bound="ServiceStatus")


@dataclass(frozen=True, kw_only=True, slots=True)
class ServiceStatus:
    """A heartbeat's fields as a record; `SERVICE` names the service kind whose status it is.

    `fields()` is what a Heartbeat writes; `parse` reads a status hash back: a missing field
    takes its default (an instance of an older version), an unknown one is ignored, a field
    that does not parse is an error naming it.
    """

    SERVICE: ClassVar[str] = ""

    def fields(self) -> dict[str, Field]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}

    @classmethod
    def parse(cls, raw: Mapping[str, str]) -> Self:
        values: dict[str, Any] = {}
        for f in dataclasses.fields(cls):
            if f.name in raw:
                kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
                try:
                    values[f.name] = kind(raw[f.name])
                except ValueError:
                    raise ValueError(f"{cls.SERVICE} status field {f.name!r}: expected {kind.__name__}, "
                                     f"got {raw[f.name]!r}") from None
        return cls(**values)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutStatus(ServiceStatus):
    """A rollout worker's heartbeat; other workers' admission gates sum `running`."""

    SERVICE: ClassVar[str] = "rollout"

    groups: int = 0
    episodes: int = 0
    retries: int = 0
    failed_groups: int = 0
    running: int = 0
    """Episodes this worker has in flight (admitted, not finished)."""
    admission_waits: int = 0


async def read_service_statuses(redis: Redis, run_id: str, kind: type[S]) -> dict[str, S]:
    """The live status records of one service kind, by instance."""
    return {s["instance"]: kind.parse(s) for s in await read_statuses(redis, run_id) if s["service"] == kind.SERVICE}
