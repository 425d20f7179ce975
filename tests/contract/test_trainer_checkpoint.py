"""Trainer checkpoints against the real Redis and real Orbax writes: asynchronous saves, the
pointer's checkpoint field only after completion, acks held until a checkpoint covers the
step, resume skipping a damaged newest checkpoint, the SaveCheckpoint RPC, and a trainer that lost its
run (another took the lease) writing no files: no checkpoint, no version in shared storage, and a
restart setting aside a checkpoint such a trainer left behind."""

from __future__ import annotations

import asyncio
import logging
import shutil
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path

import grpc
import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from arlo.background import TaskGroup
from arlo.config import RunConfig, load_config
from arlo.coord import Keys, TrajectoryStream, WeightPointer, connect, delete_run
from arlo.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel
from services.trainer.__main__ import start_trainer
from services.trainer.checkpoint import (
    SET_ASIDE,
    Checkpointer,
    CheckpointMeta,
    load_checkpoint,
    params_sha256,
)
from services.trainer.learner import Learner
from services.trainer.lockstep import learner_arrays
from services.trainer.loop import TrainingLoop

TOKEN = "checkpoint-token"


def run_config(redis_url: str, run_id: str, ckpt: Path, every: int, storage: str = "") -> RunConfig:
    server = {"port": 0, "metrics_port": -1, "grace_s": 0.2}
    return load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url},
        "trainer": {"server": server, "groups_per_step": 1, "read_block_ms": 50, "max_staleness": 1000,
                    "checkpoint_dir": str(ckpt), "checkpoint_every": every, "weights": {"storage": storage}},
    })


@asynccontextmanager
async def trainer(cfg: RunConfig, tasks: TaskGroup | None = None) -> AsyncIterator[tuple[str, TrainingLoop]]:
    """`tasks`: the trainer's background tasks, for a test that watches them (a fatal stop)."""
    tasks = tasks or TaskGroup()
    running, loop = await start_trainer(cfg, tasks)
    try:
        yield f"127.0.0.1:{running.port}", loop
    finally:
        await tasks.cancel_all()
        await loop.close()
        await running.stop(0.1)


@pytest.fixture
async def env(redis_url: str, run_id: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict]:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    redis = await connect(load_config(overrides={"redis": {"url": redis_url}}).redis)
    try:
        yield {"redis": redis, "stream": TrajectoryStream(redis, run_id, consumer="test-producer"),
               "pointer": WeightPointer(redis, run_id), "ckpt": tmp_path / "ckpt",
               "cfg": lambda every: run_config(redis_url, run_id, tmp_path / "ckpt", every)}
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


def trajectory(group: str, reward: float) -> common_pb2.Trajectory:
    prompt = [257, 260, 51, 43, 52, 61, 258, 261]
    return common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=prompt + [55, 258],
        logprobs=[0.0] * 8 + [-5.5, -5.5], loss_mask=[0] * 8 + [1, 1], policy_versions=[-1] * 8 + [0, 0],
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


async def add_groups(stream: TrajectoryStream, n: int) -> list[str]:
    ids = []
    for _ in range(n):
        group = uuid.uuid4().hex
        for reward in (1.0, 0.0):
            traj = trajectory(group, reward)
            await stream.add(traj)
            ids.append(traj.id)
    return ids


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 60.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.02)


def complete(ckpt: Path, version: int) -> bool:
    # Orbax renames the temporary directory into place as its last act: the final name means complete.
    path = ckpt / f"{version:08d}"
    return path.is_dir() and (path / "meta").exists() and (path / "params").exists()


async def pending(env: dict) -> int:
    summary = await env["redis"].xpending(env["stream"].keys.traj, "trainer")
    return int(summary["pending"])


async def test_steps_continue_while_a_checkpoint_is_written_and_the_pointer_waits_for_it(
        env: dict, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="services.trainer.loop")
    caplog.set_level(logging.INFO, logger="services.trainer.saves")
    seen_checkpoints: list[tuple[int, bool]] = []

    async def watch_pointer() -> None:
        last = 0
        while True:
            state = await env["pointer"].get()
            if state is not None and state.checkpoint_version != last:
                last = state.checkpoint_version
                # Checked right after the field moved: the directory must already be complete.
                seen_checkpoints.append((last, complete(env["ckpt"], last)))
            await asyncio.sleep(0.005)

    async with trainer(env["cfg"](1)) as (_, loop):
        watcher = asyncio.create_task(watch_pointer())
        await add_groups(env["stream"], 6)
        await wait_for(lambda: loop.state.checkpoint_version >= 6)
        await asyncio.sleep(0.1)
        watcher.cancel()
    assert seen_checkpoints and all(ok for _, ok in seen_checkpoints), seen_checkpoints
    assert [v for v, _ in seen_checkpoints] == sorted({v for v, _ in seen_checkpoints})
    events = [("step", r.version) if hasattr(r, "trajectory_ids") else ("ckpt", r.checkpoint_version)
              for r in caplog.records if hasattr(r, "trajectory_ids") or hasattr(r, "checkpoint_version")]
    # Some version v+1 was trained and published before checkpoint v finished writing.
    overlapped = [v for v in range(1, 6) if events.index(("step", v + 1)) < events.index(("ckpt", v))]
    assert overlapped, events


async def test_trajectories_are_acked_only_once_a_checkpoint_covers_their_step(env: dict) -> None:
    async with trainer(env["cfg"](2)) as (_, loop):
        first = await add_groups(env["stream"], 1)
        await wait_for(lambda: loop.state.version >= 1)
        await asyncio.sleep(0.3)  # a loop that acked after publishing would have done so by now
        assert await pending(env) == 2 and loop.state.checkpoint_version == 0
        assert not await env["redis"].exists(*(env["stream"].keys.seen(t) for t in first))
        second = await add_groups(env["stream"], 1)
        await wait_for(lambda: loop.state.checkpoint_version == 2)
        assert await pending(env) == 0
        assert await env["redis"].exists(*(env["stream"].keys.seen(t) for t in first + second)) == 4
        pointer = await env["pointer"].get()
        assert pointer is not None and pointer.checkpoint_version == 2
        assert pointer.checkpoint_uri == f"file://{env['ckpt'].resolve() / '00000002'}"


async def test_a_checkpoint_whose_record_failed_is_recorded_and_its_steps_acknowledged_without_new_data(
        env: dict) -> None:
    """Redis refusing the record of a complete checkpoint (a failover, a blip) must not leave its
    steps pending until a restart: they pin the backlog producers wait on."""
    async with trainer(env["cfg"](1)) as (_, loop):
        record, failed = loop.saves.pointer.set_checkpoint, []

        async def fail_once(version: int, uri: str) -> bool:
            if not failed:
                failed.append(version)
                raise RedisConnectionError("Redis went away while recording the checkpoint")
            return await record(version, uri)

        loop.saves.pointer.set_checkpoint = fail_once
        await add_groups(env["stream"], 1)
        await wait_for(lambda: failed == [1])
        deadline = asyncio.get_running_loop().time() + 60
        while await pending(env):
            assert asyncio.get_running_loop().time() < deadline, "the checkpoint's steps stayed pending"
            await asyncio.sleep(0.05)
        assert loop.state.held_entries == 0 and loop.state.version == 1  # no new step was needed
    assert await recorded_checkpoint(env) == 1


def corrupt(ckpt: Path, version: int, how: str) -> None:
    target = ckpt / f"{version:08d}" / "params"
    if how == "garbage":
        for path in target.rglob("*"):
            if path.is_file():
                path.write_bytes(b"\0" * path.stat().st_size)
    else:  # well-formed files, wrong contents: only the recorded checksum can tell
        shutil.rmtree(target)
        shutil.copytree(ckpt / f"{version - 1:08d}" / "params", target)


@pytest.mark.parametrize("how", ["garbage", "swapped"])
async def test_resume_skips_a_damaged_newest_checkpoint_and_a_partial_one(
        env: dict, how: str, caplog: pytest.LogCaptureFixture) -> None:
    async with trainer(env["cfg"](1)) as (_, loop):
        await add_groups(env["stream"], 2)
        await wait_for(lambda: loop.state.checkpoint_version == 2)
        sha_v1 = loop.store.get(1).sha256
    corrupt(env["ckpt"], 2, how)
    partial = env["ckpt"] / "00000003.orbax-checkpoint-tmp"
    shutil.copytree(env["ckpt"] / "00000001", partial)  # what a crash mid-write leaves
    caplog.set_level(logging.WARNING, logger="services.trainer.checkpoint")
    async with trainer(env["cfg"](1)) as (_, loop):
        assert loop.learner.step_count == 1 and loop.state.checkpoint_version == 1
        assert params_sha256(loop.learner.state) == sha_v1
        assert loop.state.version == 3  # above the pointer (2): versions never repeat
        assert (await env["pointer"].get()).version == 3
        assert not partial.exists()
        await add_groups(env["stream"], 1)
        await wait_for(lambda: loop.state.checkpoint_version == 4)
        assert loop.learner.step_count == 2
    warnings = " ".join(r.getMessage() for r in caplog.records)
    assert "00000002" in warnings and "skipping" in warnings and "00000003.orbax-checkpoint-tmp" in warnings


async def test_save_checkpoint_rpc_returns_a_complete_checkpoint(env: dict) -> None:
    async with trainer(env["cfg"](0)) as (address, loop):
        async with make_channel(address, token=TOKEN) as ch:
            stub = trainer_pb2_grpc.TrainerStub(ch)
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "nothing to checkpoint" in err.value.details()
            await add_groups(env["stream"], 1)
            await wait_for(lambda: loop.state.version >= 1)
            resp = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
            assert resp.checkpoint_version == 1 and complete(env["ckpt"], 1)
            pointer = await env["pointer"].get()
            assert (pointer.checkpoint_version, pointer.checkpoint_uri) == (1, resp.checkpoint_uri)
            status = await stub.GetStatus(trainer_pb2.GetStatusRequest())
            assert status.checkpoint_version == 1
            again = await stub.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
            assert (again.checkpoint_version, again.checkpoint_uri) == (1, resp.checkpoint_uri)
        params, meta = load_checkpoint(resp.checkpoint_uri, loop.learner.state)
        assert meta == {"step": 1, "version": 1}
        assert params_sha256(params) == pointer.sha256


async def take_the_run(env: dict, run_id: str) -> None:
    """What a successor's lease acquisition writes (arlo/coord/lease.py): this trainer is fenced out."""
    await env["redis"].set(Keys(run_id).trainer_holder, "a-successor's-token")


async def recorded_checkpoint(env: dict) -> int:
    """The pointer's checkpoint version (0: none; no pointer when the fence refused the first publish too)."""
    state = await env["pointer"].get()
    return state.checkpoint_version if state is not None else 0


def step_dirs(ckpt: Path) -> list[str]:
    """The checkpoints a restore can see (Orbax lists step names only)."""
    return sorted(p.name for p in ckpt.iterdir() if p.name.isdigit()) if ckpt.exists() else []


def set_aside(ckpt: Path) -> list[str]:
    return sorted(p.name for p in (ckpt / SET_ASIDE).iterdir()) if (ckpt / SET_ASIDE).exists() else []


async def test_a_trainer_that_lost_the_run_writes_no_checkpoint_files(env: dict, run_id: str) -> None:
    """A trainer paused past its lease wakes with a checkpoint due: its files would be a second
    lineage's state in the run's directory (restored as the newest by the next restart)."""
    async with trainer(env["cfg"](0)) as (address, loop):
        await add_groups(env["stream"], 1)
        await wait_for(lambda: loop.state.version >= 1)
        await take_the_run(env, run_id)
        async with make_channel(address, token=TOKEN) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
        assert err.value.code() == grpc.StatusCode.ABORTED, err.value
        assert "another trainer holds" in err.value.details()
        assert "another trainer holds" in loop.state.must_restart  # the driver stops at its next turn
    assert step_dirs(env["ckpt"]) == []
    assert await recorded_checkpoint(env) == 0


async def test_a_checkpoint_written_while_the_run_was_taken_is_set_aside(env: dict, run_id: str) -> None:
    """Taken over during the write (the fence is checked before it starts): the record is refused,
    and the files written are moved out of the restore's reach."""
    async with trainer(env["cfg"](0)) as (address, loop):
        await add_groups(env["stream"], 1)
        await wait_for(lambda: loop.state.version >= 1)
        write = loop.saves.write

        async def write_then_lose_the_run(*args):
            uri = await write(*args)
            assert complete(env["ckpt"], 1)  # on disk, not yet recorded
            await take_the_run(env, run_id)
            return uri

        loop.saves.write = write_then_lose_the_run
        async with make_channel(address, token=TOKEN) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await trainer_pb2_grpc.TrainerStub(ch).SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=60)
        assert err.value.code() == grpc.StatusCode.ABORTED, err.value
        assert "another trainer holds" in loop.state.must_restart
    assert step_dirs(env["ckpt"]) == []
    assert [name.split("-")[:2] for name in set_aside(env["ckpt"])] == [["00000001", "fenced"]]
    assert await recorded_checkpoint(env) == 0


async def test_a_trainer_that_lost_the_run_writes_no_version_to_shared_storage(
        env: dict, run_id: str, redis_url: str, tmp_path: Path) -> None:
    """Its file would replace the successor's of the same version (replicas would refuse it on its
    checksum and pull the version from the trainer instead: a slower sync, every version)."""
    storage = tmp_path / "weights"
    tasks = TaskGroup()
    async with trainer(run_config(redis_url, run_id, env["ckpt"], 0, storage=f"file://{storage}"), tasks) as (_, loop):
        await take_the_run(env, run_id)
        await add_groups(env["stream"], 1)
        await wait_for(lambda: tasks.fatal is not None)  # the loop stopped for a restart
        assert "another trainer holds" in str(tasks.fatal) and loop.state.version == 1, tasks.fatal
    assert not storage.exists() or not any(storage.iterdir()), sorted(p.name for p in storage.iterdir())
    assert await env["pointer"].get() is None


def write_checkpoint(ckpt: Path, learner: Learner, version: int, writers: tuple[str, ...]) -> None:
    """A checkpoint of `learner` as a trainer whose lineage is `writers` writes it, unrecorded."""
    checkpointer = Checkpointer(str(ckpt))
    try:
        arrays = learner_arrays(learner)
        checkpointer.start_save(arrays.params, arrays.opt_state, CheckpointMeta(
            version=version, step=learner.step_count, params_sha256="", writers=writers))
        checkpointer.wait()
    finally:
        checkpointer.close()


async def test_a_restart_sets_aside_a_checkpoint_a_fenced_out_trainer_left_and_keeps_its_own_lineage(
        env: dict) -> None:
    """Trainer "a" checkpoints 1; "b" takes over, restores it and records it as its own. Then two
    unrecorded checkpoints land: 5 from "a" (a save that outlived its fencing, its process killed
    before it could set it aside) and 4 from "b" (a save whose record failed). The next trainer
    must not restore 5 (a second lineage) and must keep 4 (the run's own, merely unrecorded)."""
    async with trainer(env["cfg"](1)) as (_, loop):
        await add_groups(env["stream"], 1)
        await wait_for(lambda: loop.state.checkpoint_version == 1)
        a = loop.lease.token
    async with trainer(env["cfg"](1)) as (_, loop):
        b, b_learner = loop.lease.token, loop.learner
        assert loop.state.checkpoint_version == 1 and loop.saves.writers == (a, b)
        recorded = await env["pointer"].get()
        assert (recorded.checkpoint_version, recorded.checkpoint_writer) == (1, b)
    write_checkpoint(env["ckpt"], b_learner, 4, (a, b))
    write_checkpoint(env["ckpt"], b_learner, 5, (a,))
    async with trainer(env["cfg"](1)) as (_, loop):
        c = loop.lease.token
        assert loop.state.checkpoint_version == 4 and loop.saves.writers == (a, b, c)
        assert loop.state.version == 5  # the fenced-out trainer published nothing under that number
        recorded = await env["pointer"].get()
        assert (recorded.checkpoint_version, recorded.checkpoint_writer) == (4, c)
    assert step_dirs(env["ckpt"]) == ["00000001", "00000004"]
    assert [name.split("-")[:2] for name in set_aside(env["ckpt"])] == [["00000005", "foreign"]]
