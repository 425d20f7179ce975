"""Typed coordination records against the real Redis: the admission counters under their
documented key names, and heartbeat status records written and read back."""

from __future__ import annotations

import pytest

from arlo.config import RedisConfig
from arlo.coord import AdmissionCounters, Heartbeat, RolloutStatus, TrajectoryStream, connect, delete_run
from arlo.coord.records import count_accepted, mark_in_flight, read_service_statuses, settle_in_flight


async def test_admission_counters_live_under_the_documented_keys(redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        assert await AdmissionCounters.read(redis, run_id) == AdmissionCounters()
        await count_accepted(redis, run_id, 8)
        await TrajectoryStream(redis, run_id, consumer="trainer").count_stale(3)
        assert await AdmissionCounters.read(redis, run_id) == AdmissionCounters(accepted=8, dropped_stale=3)
        # The layout docs/architecture.md lists: changing it strands a running fleet's budget.
        assert int(await redis.get(f"arlo:{run_id}:rollout:accepted")) == 8
        assert int(await redis.get(f"arlo:{run_id}:traj:dropped_stale")) == 3
        await redis.set(f"arlo:{run_id}:traj:dropped_stale", "lots")
        with pytest.raises(ValueError, match="traj:dropped_stale: expected an integer"):
            await AdmissionCounters.read(redis, run_id)
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_groups_in_flight_stay_marked_until_the_trainer_has_them_or_they_are_too_old(
        redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        await mark_in_flight(redis, run_id, "old", 1)  # a worker died with it: never finished
        await mark_in_flight(redis, run_id, "late", 2)  # admitted on 2, its first token may be 3's
        for group in ("a", "b", "unwritten"):
            await mark_in_flight(redis, run_id, group, 3)
        await mark_in_flight(redis, run_id, "young", 4)
        assert await settle_in_flight(redis, run_id, arrived=(), floor=3) == {"late", "a", "b", "unwritten"}
        await count_accepted(redis, run_id, 2)  # "a" written: still in flight until the trainer has it
        await count_accepted(redis, run_id, 0, unwritten_group="unwritten")  # never reached the stream
        assert await settle_in_flight(redis, run_id, arrived=(), floor=3) == {"late", "a", "b"}
        assert await settle_in_flight(redis, run_id, arrived=("a", "late"), floor=3) == {"b"}
        assert await AdmissionCounters.read(redis, run_id) == AdmissionCounters(accepted=2)
        # The member more than one below the floor went with the first call (a batch cannot take it).
        assert await redis.zrange(f"arlo:{run_id}:rollout:inflight", 0, -1) == [b"b", b"young"]
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_rollout_status_round_trips_through_a_heartbeat(redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        status = RolloutStatus(groups=3, episodes=12, retries=1, failed_groups=0, running=8, admission_waits=2)
        await Heartbeat(redis, run_id, service=RolloutStatus.SERVICE, instance="w1").beat(**status.fields())
        await Heartbeat(redis, run_id, service="trainer", instance="t0").beat(version=4)  # another kind: not read
        await Heartbeat(redis, run_id, service="rollout", instance="old").beat(running=4)  # fewer fields: defaults
        assert await read_service_statuses(redis, run_id, RolloutStatus) == {
            "w1": status, "old": RolloutStatus(running=4)}
        with pytest.raises(ValueError, match="rollout status field 'running': expected int"):
            RolloutStatus.parse({"running": "many"})
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()
