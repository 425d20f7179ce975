"""Staleness admission control against the real Redis."""

from __future__ import annotations

import asyncio

import pytest

from arlo.config import RedisConfig
from arlo.coord import Heartbeat, TrajectoryStream, WeightPointer, connect, delete_run
from services.rollout.admission import AdmissionGate, may_start


@pytest.mark.parametrize(("running", "accepted", "version", "staleness", "ok"), [
    (0, 0, 0, 0, True),     # the first batch may start
    (4, 0, 0, 0, False),    # on-policy: one batch in flight at a time
    (0, 4, 0, 0, False),    # ...and the trainer has not consumed it yet
    (0, 4, 1, 0, True),     # version 1: the next batch may start
    (4, 0, 0, 1, True),     # staleness 1: two batches ahead
    (4, 4, 0, 1, False),
])
def test_rule(running: int, accepted: int, version: int, staleness: int, ok: bool) -> None:
    assert may_start(running=running, accepted=accepted, group_size=4, trainer_version=version,
                     max_staleness=staleness, batch_size=4) is ok


def test_stale_drops_are_given_back_to_the_budget() -> None:
    # On-policy, version 1, 8 accepted: the budget (8) is used up, unless the trainer dropped
    # 4 of them as stale (e.g. made before its restart): then one more group may start.
    rule = dict(running=0, accepted=8, group_size=4, trainer_version=1, max_staleness=0, batch_size=4)
    assert not may_start(**rule)
    assert may_start(**rule, dropped_stale=4)


async def test_gate_reads_the_trainers_stale_counter(redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=4, poll_s=0.02)
        await redis.set(f"arlo:{run_id}:rollout:accepted", 4)
        blocked = asyncio.create_task(gate.acquire(4))
        await asyncio.sleep(0.2)
        assert not blocked.done()
        await TrajectoryStream(redis, run_id, consumer="trainer").count_stale(4)
        await asyncio.wait_for(blocked, 5)
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_gate_waits_for_the_trainer_and_counts_other_workers(redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=4, poll_s=0.02)
        await asyncio.wait_for(gate.acquire(4), 5)
        blocked = asyncio.create_task(gate.acquire(4))
        await asyncio.sleep(0.2)
        assert not blocked.done()  # a second batch would be stale under max_staleness 0
        await gate.finish(4, written=4)
        await asyncio.sleep(0.1)
        assert not blocked.done()  # accepted but not trained on yet
        await WeightPointer(redis, run_id).publish(1, source="grpc://x:1", sha256="0" * 64)
        await asyncio.wait_for(blocked, 5)
        assert gate.running == 4 and gate.waits == 1
        # Another worker's heartbeat counts its running episodes.
        other = AdmissionGate(redis, run_id, instance="w2", max_staleness=0, batch_size=4, poll_s=0.02)
        await Heartbeat(redis, run_id, service="rollout", instance="w1").beat(running=gate.running)
        assert await other.others_running() == 4
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()
