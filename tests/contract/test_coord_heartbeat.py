"""Heartbeats against a real Redis: fields readable by `arlo status`, expiry of dead instances."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from arlo.config import RedisConfig
from arlo.coord import Heartbeat, Keys, connect, delete_run, read_statuses


@pytest.fixture
async def r(redis_url: str, run_id: str) -> AsyncIterator[Redis]:
    client = await connect(RedisConfig(url=redis_url))
    yield client
    await delete_run(client, run_id)
    await client.aclose()


async def test_beat_fields_are_listed_per_instance(r: Redis, run_id: str) -> None:
    await Heartbeat(r, run_id, service="trainer", instance="0").beat(version=3, loss=0.25, state="training")
    await Heartbeat(r, run_id, service="inference", instance="10.0.0.7:50051").beat(busy=True, queue=2)
    statuses = await read_statuses(r, run_id)
    assert [(s["service"], s["instance"]) for s in statuses] == [("inference", "10.0.0.7:50051"), ("trainer", "0")]
    inference, trainer = statuses
    assert (trainer["version"], trainer["loss"], trainer["state"]) == ("3", "0.25", "training")
    assert (inference["busy"], inference["queue"]) == ("1", "2")
    assert abs(float(trainer["ts"]) - time.time()) < 60


async def test_one_services_statuses_alone(r: Redis, run_id: str) -> None:
    """What the admission gate reads before each check: only the rollouts' hashes (a prefix of
    another service's name is not a match)."""
    await Heartbeat(r, run_id, service="rollout", instance="host-1:7").beat(running=4)
    await Heartbeat(r, run_id, service="rollout", instance="host-2").beat(running=8)
    await Heartbeat(r, run_id, service="rollouts", instance="x").beat(running=1)
    await Heartbeat(r, run_id, service="trainer", instance="0").beat(version=3)
    rollouts = await read_statuses(r, run_id, "rollout")
    assert [(s["service"], s["instance"], s["running"]) for s in rollouts] == [("rollout", "host-1:7", "4"),
                                                                                ("rollout", "host-2", "8")]
    assert len(await read_statuses(r, run_id)) == 4


async def test_statuses_of_other_runs_are_not_listed(r: Redis, run_id: str) -> None:
    other = run_id + "-other"
    try:
        await Heartbeat(r, other, service="trainer", instance="0").beat(x=1)
        assert await read_statuses(r, run_id) == []
    finally:
        await delete_run(r, other)


async def test_status_expires_without_beats(r: Redis, run_id: str) -> None:
    hb = Heartbeat(r, run_id, service="reward", instance="a", ttl_s=1.5)  # the reads below land inside it
    await hb.beat(n=1)
    assert 0 < await r.pttl(Keys(run_id).status("reward", "a")) <= 1500
    assert len(await read_statuses(r, run_id)) == 1
    await asyncio.sleep(1.7)
    assert await read_statuses(r, run_id) == []


async def test_run_beats_until_cancelled(r: Redis, run_id: str) -> None:
    hb = Heartbeat(r, run_id, service="rollout", instance="w1", ttl_s=2.0)
    counter = iter(range(1_000_000))
    task = asyncio.ensure_future(hb.run(0.02, lambda: {"episodes": next(counter)}))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    (status,) = await read_statuses(r, run_id)
    assert int(status["episodes"]) >= 3


async def test_run_rejects_an_interval_past_the_ttl(r: Redis, run_id: str) -> None:
    hb = Heartbeat(r, run_id, service="s", instance="i", ttl_s=1.0)
    with pytest.raises(ValueError, match="interval_s"):
        await hb.run(1.0, dict)


async def test_run_always_stops_when_cancelled(r: Redis, run_id: str) -> None:
    # On Python 3.11 redis-py can swallow a cancel that lands as a command is sent; the loop
    # must stop anyway (it used to run on forever about one cancel in five).
    hb = Heartbeat(r, run_id, service="rollout", instance="w1", ttl_s=2.0)
    for i in range(60):
        task = asyncio.ensure_future(hb.run(0.0005, lambda: {"n": 1}))
        await asyncio.sleep(0.001 + (i % 7) * 0.0007)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, f"heartbeat loop ignored cancel #{i}"
        assert task.cancelled()


async def test_reading_statuses_costs_the_same_however_many_keys_redis_holds(r: Redis, run_id: str) -> None:
    """The admission gate reads the rollout statuses before groups start; a keyspace scan grew
    with every trained trajectory's `seen:{id}` key (7 days' TTL), so a long run's check slowed."""
    await Heartbeat(r, run_id, service="rollout", instance="w1").beat(running=4)
    pipe = r.pipeline(transaction=False)
    for i in range(20_000):
        pipe.set(f"arlo:{run_id}:seen:{i}", 1, ex=600)
    await pipe.execute()
    scans_before = await _scans(r)
    statuses = await read_statuses(r, run_id)
    assert [(s["service"], s["instance"], s["running"]) for s in statuses] == [("rollout", "w1", "4")]
    # A scan would take 100+ SCAN calls over 20,000 keys; the index takes SMEMBERS and one HGETALL.
    assert await _scans(r) == scans_before


async def test_an_expired_status_leaves_the_index_and_a_new_beat_lists_it_again(r: Redis, run_id: str) -> None:
    hb = Heartbeat(r, run_id, service="reward", instance="a", ttl_s=0.3)
    await hb.beat(n=1)
    await asyncio.sleep(0.5)
    assert await read_statuses(r, run_id) == []
    assert await r.smembers(Keys(run_id).statuses) == set()
    await hb.beat(n=2)
    assert [s["n"] for s in await read_statuses(r, run_id)] == ["2"]


async def _scans(r: Redis) -> int:
    """SCAN calls this Redis has served (INFO commandstats)."""
    return int((await r.info("commandstats")).get("cmdstat_scan", {}).get("calls", 0))
