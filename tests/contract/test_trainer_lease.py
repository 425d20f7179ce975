"""One trainer per run (issue 33, item 9): a second trainer with the same run id used to be
accepted, trained the same trajectories into a second lineage, wrote the same checkpoint
directory, and the run stalled. The lease (arlo/coord/lease.py) refuses it within seconds; its
fence refuses the pointer and acknowledgement writes of a trainer that lost the run while paused.
Real Redis; the last test starts a real second trainer process against a running one."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import yaml

from arlo.coord import TrajectoryStream, WeightPointer, connect, delete_run
from arlo.coord.lease import LeaseHeld, LeaseLost, TrainerLease, lease_holder
from arlo.proto.v1 import common_pb2
from tests.support.trainer import trainer_config, trainer_service

ROOT = Path(__file__).resolve().parents[2]
TTL_S = 1.5


@pytest.fixture
async def redis(redis_url: str, run_id: str):
    from arlo.config import load_config

    client = await connect(load_config(overrides={"run_id": run_id, "redis": {"url": redis_url}}).redis)
    try:
        yield client
    finally:
        await delete_run(client, run_id)
        await client.aclose()


def lease(redis, run_id: str, owner: str = "") -> TrainerLease:
    return TrainerLease(redis, run_id, ttl_s=TTL_S, owner=owner)


async def test_a_second_trainer_is_refused_while_the_first_renews(redis, run_id: str) -> None:
    first = lease(redis, run_id, owner="pod-a:1")
    await first.acquire()
    renewing = asyncio.create_task(first.keep_renewed())
    try:
        started = time.monotonic()
        with pytest.raises(LeaseHeld, match="pod-a:1.*renews its lease.*same run_id is refused"):
            await lease(redis, run_id, owner="pod-b:1").acquire()
        assert time.monotonic() - started < 2 * TTL_S  # seen renewing (every TTL_S / 3), not waiting the lease out
        await first.renew()  # the first trains on
        assert await lease_holder(redis, run_id) == "pod-a:1"  # what arlo status shows
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)


async def test_a_lease_nobody_renews_is_taken_after_its_ttl_and_a_released_one_at_once(redis, run_id: str) -> None:
    await lease(redis, run_id, owner="pod-a:1").acquire()  # then never renewed: a pod that died
    started = time.monotonic()
    second = lease(redis, run_id, owner="pod-b:1")
    await second.acquire()
    assert TTL_S * 0.5 < time.monotonic() - started < TTL_S * 3
    await second.release()
    started = time.monotonic()
    await lease(redis, run_id, owner="pod-c:1").acquire()
    assert time.monotonic() - started < TTL_S * 2 / 3  # at once: no wait for the ttl


async def test_a_dead_holder_on_this_host_is_taken_over_at_once(redis, run_id: str) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # its pid names no process now (a trainer killed with -9, before the supervisor's restart)
    await lease(redis, run_id, owner=f"{socket.gethostname()}:{gone.pid}").acquire()
    started = time.monotonic()
    await lease(redis, run_id).acquire()
    assert time.monotonic() - started < TTL_S * 2 / 3  # at once: no wait for the ttl


async def test_a_trainer_that_lost_the_run_while_paused_can_write_nothing(redis, run_id: str) -> None:
    paused = lease(redis, run_id, owner="pod-a:1")
    await paused.acquire()
    successor = lease(redis, run_id, owner="pod-b:1")
    await successor.acquire()  # after the paused one's ttl ran out
    stream = TrajectoryStream(redis, run_id, consumer="trainer-a", fence=paused.fence)
    await stream.ensure_group()
    producer = TrajectoryStream(redis, run_id, consumer="producer")  # unfenced writers are not concerned
    group = uuid.uuid4().hex
    ids = await producer.add_group([common_pb2.Trajectory(id=uuid.uuid4().hex, group_id=group, group_size=1,
                                                          token_ids=[1, 2], logprobs=[0.0, -1.0], loss_mask=[0, 1],
                                                          policy_versions=[-1, 0], reward=1.0)])
    assert len(await stream.read(10, 100)) == 1
    with pytest.raises(LeaseLost, match="another trainer holds"):
        await stream.mark_trained([t.trajectory.id for t in await stream.read(10, 0)] or ["t-of-the-run"])
    assert not await redis.keys(f"arlo:{run_id}:seen:*")  # the successor still trains them
    entries = await stream.read_own_pending(10)
    with pytest.raises(LeaseLost, match="dead-lettering 1 entries"):
        await stream.dead_letter([(e.entry_id, e.trajectory, "refused") for e in entries[0]])
    assert await redis.xlen(stream.keys.traj_dead) == 0  # no copy either
    with pytest.raises(LeaseLost, match="another trainer holds"):
        await stream.ack(ids)
    with pytest.raises(LeaseLost):
        await WeightPointer(redis, run_id, fence=paused.fence).publish(5, source="grpc://a", sha256="x")
    with pytest.raises(LeaseLost):
        await WeightPointer(redis, run_id, fence=paused.fence).set_checkpoint(5, "file:///a/5")
    with pytest.raises(LeaseLost, match="pod-b:1"):
        await paused.renew()
    assert await WeightPointer(redis, run_id).get() is None
    assert await WeightPointer(redis, run_id, fence=successor.fence).publish(1, source="grpc://b", sha256="y")


async def test_a_trainer_that_wakes_after_its_successor_stopped_is_still_fenced(redis, run_id: str) -> None:
    """The successor came and went (released, or died and expired): the lease key is gone, but the
    run was acquired by another token since, so the sleeper may neither write nor take it back."""
    sleeper = lease(redis, run_id, owner="pod-a:1")
    await sleeper.acquire()
    successor = lease(redis, run_id, owner="pod-b:1")
    await successor.acquire()  # after the sleeper's ttl
    assert await WeightPointer(redis, run_id, fence=successor.fence).publish(10, source="grpc://b", sha256="b")
    await successor.release()
    with pytest.raises(LeaseLost):
        await WeightPointer(redis, run_id, fence=sleeper.fence).publish(11, source="grpc://a", sha256="a")
    with pytest.raises(LeaseLost):
        await sleeper.renew()
    assert (await WeightPointer(redis, run_id).get()).sha256 == "b"
    await lease(redis, run_id, owner="pod-c:1").acquire()  # a new trainer starts at once


async def test_a_holder_in_another_pid_namespace_is_not_taken_for_dead(redis, run_id: str) -> None:
    """Same hostname, pid not visible here (host networking, a fixed --hostname): not 'gone'."""
    other = lease(redis, run_id, owner=f"{socket.gethostname()}:999999")
    other.namespace = "another-boot/pid:[1]"
    await other.acquire()
    renewing = asyncio.create_task(other.keep_renewed())
    try:
        with pytest.raises(LeaseHeld, match="renews its lease"):
            await lease(redis, run_id).acquire()
    finally:
        renewing.cancel()
        await asyncio.gather(renewing, return_exceptions=True)


@pytest.mark.timeout(300)
async def test_a_second_trainer_process_exits_naming_the_first_which_trains_on(
        redis_url: str, run_id: str, tmp_path: Path) -> None:
    cfg = trainer_config(redis_url, run_id, trainer={"lease_ttl_s": 3.0})
    async with trainer_service(cfg) as (_, loop, client):
        config = tmp_path / "second.yaml"
        config.write_text(yaml.safe_dump({"run_id": run_id, "redis": {"url": redis_url}, "auth": {"disabled": True},
                                          "trainer": {"lease_ttl_s": 3.0, "server": {"port": 0, "metrics_port": -1}}}))
        env = {**os.environ, "JAX_PLATFORMS": "cpu"}
        env.pop("ARLO_CONFIG", None)
        second = await asyncio.to_thread(
            subprocess.run, [sys.executable, "-m", "services.trainer", "-c", str(config)], cwd=ROOT, env=env,
            capture_output=True, text=True, timeout=240)
        assert second.returncode != 0, second.stderr[-2000:]
        assert "another trainer" in second.stderr and "same run_id is refused" in second.stderr, second.stderr[-2000:]
        assert "Traceback" not in second.stderr.splitlines()[-1]
        await loop.lease.renew()  # the first still holds the run
        stream = TrajectoryStream(client, run_id, consumer="producer")
        group = uuid.uuid4().hex
        await stream.add_group([common_pb2.Trajectory(
            id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=[257, 260, 51, 55, 258],
            logprobs=[0.0] * 3 + [-5.5, -5.5], loss_mask=[0] * 3 + [1, 1], policy_versions=[-1] * 3 + [0, 0],
            reward=r, status=common_pb2.TRAJECTORY_STATUS_OK) for r in (1.0, 0.0)])
        deadline = time.monotonic() + 120
        while loop.state.version < 1:
            assert time.monotonic() < deadline, "the first trainer stopped training"
            await asyncio.sleep(0.1)
