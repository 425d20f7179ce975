"""Staleness admission control against the real Redis."""

from __future__ import annotations

import asyncio

import pytest

from arlo.config import RedisConfig
from arlo.coord import Heartbeat, TrajectoryStream, WeightPointer, connect, delete_run
from arlo.proto.v1.common_pb2 import Trajectory
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
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=4, poll_s=60.0)
        await redis.set(f"arlo:{run_id}:rollout:accepted", 4)
        blocked = asyncio.create_task(gate.acquire(4))
        await asyncio.sleep(0.2)
        assert not blocked.done()
        await TrajectoryStream(redis, run_id, consumer="trainer").count_stale(4)
        await asyncio.wait_for(blocked, 5)  # woken by the trainer's event, not the 60 s poll
        await gate.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_an_admitted_group_is_marked_on_the_version_its_check_counted_on(
        redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        await WeightPointer(redis, run_id).publish(3, source="grpc://t:1", sha256="ab")
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=1, batch_size=8, poll_s=60.0,
                             served_version=_served(2))  # the replicas still serve version 2
        stream = TrajectoryStream(redis, run_id, consumer="trainer")
        assert await asyncio.wait_for(gate.acquire(4), 5) == 2
        assert await asyncio.wait_for(gate.acquire(4), 5) == 2  # on the first check's headroom
        await gate.mark("g1", 2)
        await gate.mark("g2", 2)
        assert await stream.settle_in_flight(arrived=(), floor=2) == {"g1", "g2"}
        await gate.finish(4, written=4)  # written: the trainer unmarks it once it has it
        await gate.finish(4, written=0, unwritten_group="g2")  # never reached the stream
        assert await stream.settle_in_flight(arrived=(), floor=2) == {"g1"}
        await gate.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


def _served(version: int):
    async def served() -> int:
        return version
    return served


async def test_gate_waits_for_the_trainer_and_counts_other_workers(redis_url: str, run_id: str) -> None:
    redis = await connect(RedisConfig(url=redis_url))
    try:
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=4, poll_s=60.0)
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
        other = AdmissionGate(redis, run_id, instance="w2", max_staleness=0, batch_size=4, poll_s=60.0)
        await Heartbeat(redis, run_id, service="rollout", instance="w1").beat(running=gate.running)
        assert await other.others_running() == 4
        await gate.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_gate_waits_until_inference_serves_the_new_version(redis_url: str, run_id: str) -> None:
    # On-policy: the pointer moving is not enough; an episode started before the replicas swap
    # would be generated by the old policy and dropped as stale.
    redis = await connect(RedisConfig(url=redis_url))
    served = 0

    async def served_version() -> int:
        return served

    try:
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=4, poll_s=60.0,
                             served_version=served_version)
        await asyncio.wait_for(gate.acquire(4), 5)
        await gate.finish(4, written=4)
        pointer = WeightPointer(redis, run_id)
        await pointer.publish(1, source="grpc://x:1", sha256="0" * 64)
        blocked = asyncio.create_task(gate.acquire(4))
        await asyncio.sleep(0.3)
        assert not blocked.done()  # the pointer is at 1, the replicas still serve 0
        served = 1
        await pointer.announce_served(1)
        await asyncio.wait_for(blocked, 5)  # the replica's event wakes it, long before the poll
        await gate.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_gate_wakes_on_another_workers_finished_group(redis_url: str, run_id: str) -> None:
    # A group that wrote nothing (all failed, or filtered) frees its budget: the other workers'
    # gates hear of it at once through the admission channel.
    redis = await connect(RedisConfig(url=redis_url))
    try:
        w1 = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=4, poll_s=60.0)
        w2 = AdmissionGate(redis, run_id, instance="w2", max_staleness=0, batch_size=4, poll_s=60.0)
        beat = Heartbeat(redis, run_id, service="rollout", instance="w1")
        await asyncio.wait_for(w1.acquire(4), 5)
        await beat.beat(running=w1.running)
        blocked = asyncio.create_task(w2.acquire(4))
        await asyncio.sleep(0.3)
        assert not blocked.done()
        await beat.beat(running=0)  # w1's group ends: its heartbeat no longer counts it...
        await w1.finish(4, written=0)  # ...and the event says so
        await asyncio.wait_for(blocked, 5)
        await w1.aclose()
        await w2.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_a_burst_of_groups_pays_for_one_check(redis_url: str, run_id: str) -> None:
    # Synchronous, version 1 served, version 0's batch accepted: the next batch of 4 groups x 4
    # may start. The first group's check
    # (Redis reads and the served-version RPC) admits the other three as well.
    redis = await connect(RedisConfig(url=redis_url))
    checks = 0

    async def served_version() -> int:
        nonlocal checks
        checks += 1
        return 1

    try:
        await WeightPointer(redis, run_id).publish(1, source="grpc://x:1", sha256="0" * 64)
        await redis.set(f"arlo:{run_id}:rollout:accepted", 16)
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=0, batch_size=16, poll_s=60.0,
                             served_version=served_version)
        for _ in range(4):
            await asyncio.wait_for(gate.acquire(4), 5)
        assert gate.running == 16 and checks == 1
        blocked = asyncio.create_task(gate.acquire(4))  # a fifth would be stale: a fresh check says no
        await asyncio.sleep(0.2)
        assert not blocked.done() and checks == 1  # the pointer alone refuses it, no RPC needed
        blocked.cancel()
        await gate.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_budget_counts_only_what_the_stream_still_holds_for_the_trainer(redis_url: str, run_id: str) -> None:
    """Issue 33: a failed run's 24 accepted trajectories were dead-lettered (no model tokens), yet
    still counted: with the config fixed, the same run id admitted no group ever again."""
    redis = await connect(RedisConfig(url=redis_url))
    stream = TrajectoryStream(redis, run_id, consumer="rollout")
    try:
        await stream.ensure_group()
        await redis.set(f"arlo:{run_id}:rollout:accepted", 24)  # the failed run's count; its entries are gone
        gate = AdmissionGate(redis, run_id, instance="w1", max_staleness=1, batch_size=8, poll_s=60.0,
                             backlog=stream.backlog)
        await asyncio.wait_for(gate.acquire(8), 5)  # the counters alone: 24 > (1 + 0 + 1) x 8, blocked for good
        await gate.finish(8, 0)
        await gate.aclose()
        # Entries the trainer has yet to take still count: 16 unread fill the budget of 2 batches.
        await stream.add_group([Trajectory(id=f"t{i}", group_id=f"g{i // 8}", group_size=8) for i in range(16)])
        full = AdmissionGate(redis, run_id, instance="w3", max_staleness=1, batch_size=8, poll_s=60.0,
                             backlog=stream.backlog)
        blocked = asyncio.create_task(full.acquire(8))
        await asyncio.sleep(0.3)
        assert not blocked.done()
        blocked.cancel()
        await full.aclose()
        without_cap = AdmissionGate(redis, run_id, instance="w2", max_staleness=1, batch_size=8, poll_s=60.0)
        await redis.delete(f"arlo:{run_id}:traj")
        stuck = asyncio.create_task(without_cap.acquire(8))
        await asyncio.sleep(0.3)
        assert not stuck.done()  # the old rule: what the counter says, whatever the stream holds
        stuck.cancel()
        await without_cap.aclose()
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


def test_rule_caps_the_counted_queue_at_the_backlog() -> None:
    rule = dict(running=0, accepted=24, group_size=8, trainer_version=0, max_staleness=1, batch_size=8)
    assert not may_start(**rule)
    assert may_start(**rule, backlog=0) and may_start(**rule, backlog=8) and not may_start(**rule, backlog=9)
    # Replicas a version behind the pointer: the batch of that version still counts against the start.
    lagging = dict(running=0, accepted=16, group_size=8, max_staleness=1, batch_size=8, backlog=0)
    assert may_start(**lagging, trainer_version=1, pointer_version=1)
    assert may_start(**lagging, trainer_version=0, pointer_version=1)
    assert not may_start(**{**lagging, "group_size": 9}, trainer_version=0, pointer_version=1)
