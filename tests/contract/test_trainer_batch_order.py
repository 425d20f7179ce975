"""Groups finish out of the order they started (multi-turn episodes, slow environments): the
trainer takes the oldest policy's ready groups first, so one left behind by younger groups does
not age past `max_staleness` at the next step and get dropped (intake.py `Intake.take_batch`);
and a step waits, bounded, for such a group still in flight (services/trainer/core/expiring.py)."""

from __future__ import annotations

import asyncio
import uuid
from contextlib import asynccontextmanager

import pytest

from arlo.coord import TrajectoryStream
from arlo.coord.records import count_accepted, mark_in_flight
from arlo.proto.v1 import common_pb2
from tests.support.trainer import trainer_config, trainer_service


async def add_group(stream: TrajectoryStream, policy_version: int, group: str = "") -> None:
    group, prompt = group or uuid.uuid4().hex, [257, 260, 51, 43, 52, 61, 258, 261]
    for reward in (1.0, 0.0):
        await stream.add(common_pb2.Trajectory(
            id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=prompt + [55, 258],
            logprobs=[0.0] * 8 + [-5.5, -5.5], loss_mask=[0] * 8 + [1, 1],
            policy_versions=[-1] * 8 + [policy_version] * 2, reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK))


async def wait_for_version(loop, version: int, timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while loop.state.version < version and not loop.dropped()["stale"]:
        assert asyncio.get_running_loop().time() < deadline, f"version {loop.state.version}, waited for {version}"
        await asyncio.sleep(0.02)


@pytest.mark.timeout(180)
async def test_an_older_group_that_arrives_after_a_younger_one_is_trained_first_not_dropped(
        redis_url: str, run_id: str) -> None:
    cfg = trainer_config(redis_url, run_id, trainer={"max_staleness": 1, "start_paused": True})
    async with trainer_service(cfg) as (_, loop, redis):
        stream = TrajectoryStream(redis, run_id, consumer="test-producer")
        loop.resume(until_step=1)
        await add_group(stream, 0)
        await wait_for_version(loop, 1)
        await loop.pause()  # returns once step 1's tail is done
        # A read issued during step 1 may still block (read_block_ms): let it return empty, so the
        # two groups below reach the loop together, in one read, after the resume.
        await asyncio.sleep(1.0)

        # While the trainer is paused at version 1: a group of version 1 lands first, then one of
        # version 0 (started earlier, finished later). Trained in arrival order, the version-0 group
        # would be two versions old at the second step (max_staleness 1) and dropped.
        await add_group(stream, 1)
        await add_group(stream, 0)
        loop.resume(until_step=3)
        await wait_for_version(loop, 3)
        await loop.pause()  # the step's counters are final
        assert loop.dropped()["stale"] == 0
        assert loop.state.consumed == 6


@asynccontextmanager
async def paused_at_version_1(redis_url: str, run_id: str, *, expiring_wait_s: float):
    """(loop, redis, stream): a trainer at max_staleness 1 paused at version 1, its reads idle."""
    cfg = trainer_config(redis_url, run_id, trainer={"max_staleness": 1, "start_paused": True,
                                                      "expiring_wait_s": expiring_wait_s})
    async with trainer_service(cfg) as (_, loop, redis):
        stream = TrajectoryStream(redis, run_id, consumer="test-producer")
        loop.resume(until_step=1)
        await add_group(stream, 0)
        await wait_for_version(loop, 1)
        await loop.pause()
        await asyncio.sleep(1.0)  # a read issued during step 1 returns empty (read_block_ms)
        yield loop, redis, stream


@pytest.mark.timeout(180)
async def test_a_step_waits_for_an_older_group_still_in_flight_instead_of_leaving_it_to_go_stale(
        redis_url: str, run_id: str) -> None:
    async with paused_at_version_1(redis_url, run_id, expiring_wait_s=60.0) as (loop, redis, stream):
        # At version 1 a version-0 group is still being generated when a version-1 group lands.
        # Trained alone, the version-1 group makes version 2, where the version-0 group is too old.
        await mark_in_flight(redis, run_id, "slow", 0)
        await add_group(stream, 1)
        loop.resume(until_step=3)
        deadline = asyncio.get_running_loop().time() + 30
        while loop.core.book.expiring.waits < 1:  # the resumed loop reads the group, then waits
            assert asyncio.get_running_loop().time() < deadline, "the step never waited for the older group"
            await asyncio.sleep(0.05)
        assert loop.state.version == 1 and loop.core.book.expiring.waits == 1  # waiting for it, not training
        await add_group(stream, 0, group="slow")  # its worker leaves the mark: the trainer takes it off
        await wait_for_version(loop, 3)
        await loop.pause()
        assert loop.dropped()["stale"] == 0
        assert loop.state.consumed == 6
        assert loop.core.book.expiring.timeouts == 0
        assert await redis.zrange(f"arlo:{run_id}:rollout:inflight", 0, -1) == []


@pytest.mark.timeout(180)
async def test_a_group_written_just_after_the_loops_read_is_still_waited_for(redis_url: str, run_id: str) -> None:
    """The group lands (and its worker is done with it) between the loop's last stream read and
    its look at the in-flight set: the mark is still there, because only the trainer takes it off."""
    async with paused_at_version_1(redis_url, run_id, expiring_wait_s=60.0) as (loop, redis, stream):
        await mark_in_flight(redis, run_id, "slow", 0)
        settle, landed = loop.stream.settle_in_flight, []

        async def group_lands_first(**kwargs):
            if not landed:
                landed.append(True)
                await add_group(stream, 0, group="slow")
                await count_accepted(redis, run_id, 2)  # its worker's finish (AdmissionGate.finish)
            return await settle(**kwargs)

        loop.stream.settle_in_flight = group_lands_first
        await add_group(stream, 1)
        loop.resume(until_step=3)
        await wait_for_version(loop, 3)
        await loop.pause()
        assert landed and loop.dropped()["stale"] == 0 and loop.state.consumed == 6


@pytest.mark.timeout(180)
async def test_the_wait_for_a_group_in_flight_is_bounded(redis_url: str, run_id: str) -> None:
    async with paused_at_version_1(redis_url, run_id, expiring_wait_s=0.5) as (loop, redis, stream):
        await mark_in_flight(redis, run_id, "lost", 0)  # its worker died: it never comes
        await add_group(stream, 1)
        started = asyncio.get_running_loop().time()
        loop.resume(until_step=2)
        await wait_for_version(loop, 2)
        assert asyncio.get_running_loop().time() - started >= 0.5
        assert (loop.core.book.expiring.waits, loop.core.book.expiring.timeouts) == (1, 1)
        await loop.pause()
        # Two floors past it the lost group's mark is pruned (a mark is a lower bound: one floor
        # past, its group could still have been generated by the floor's version).
        assert await stream.settle_in_flight(arrived=(), floor=loop.state.version) == set()
