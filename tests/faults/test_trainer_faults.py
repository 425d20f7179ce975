"""Faults inside a running trainer (real gRPC server, real Redis, real Orbax on a real filesystem):
a step that raises, a weight pointer the trainer did not write, a checkpoint disk that fills up
(a size-limited tmpfs) and then frees, damaged checkpoint pieces at restore, and the intake that
runs while a step trains (services/trainer/stream_side.py): a producer's retry of the step's own
trajectories, and an intake failure mid-step."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import subprocess
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from arlo.background import TaskGroup
from arlo.config import load_config
from arlo.coord import TrajectoryStream, WeightPointer, connect, delete_run
from arlo.proto.v1 import common_pb2, trainer_pb2
from services.trainer.__main__ import start_trainer
from services.trainer.core.book import STEP_ATTEMPTS
from services.trainer.loop import TrainingLoop
from services.trainer.server import TrainerServicer

pytestmark = pytest.mark.timeout(300)
PROMPT = [257, 260, 51, 43, 52, 61, 258, 261]


def traj(group: str, reward: float, version: int = 0) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=PROMPT + [55, 258],
        logprobs=[0.0] * 8 + [-5.5, -5.5], loss_mask=[0] * 8 + [1, 1], policy_versions=[-1] * 8 + [version] * 2,
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


async def add_group(stream: TrajectoryStream, version: int = 0) -> list[str]:
    group = uuid.uuid4().hex
    trajs = [traj(group, 1.0, version), traj(group, 0.0, version)]
    await stream.add_group(trajs)
    return [t.id for t in trajs]


async def wait_for(predicate: Callable[[], bool], timeout_s: float = 90.0,
                   seen: Callable[[], object] = lambda: "") -> None:
    """Polls `predicate`; a timeout says what `seen` returns then (the state the wait was on)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, f"timed out after {timeout_s:.0f}s: {seen()}"
        await asyncio.sleep(0.05)


def durability_seen(loop: Any) -> str:
    state = loop.state
    return (f"version {state.version}, checkpoint {state.checkpoint_version}, held {state.held_entries}, "
            f"failures {state.checkpoint_failures}, acked undurable {state.acked_undurable}, "
            f"error {state.checkpoint_error!r}")


@asynccontextmanager
async def trainer(redis_url: str, run_id: str, **section) -> AsyncIterator[tuple[TrainingLoop, TaskGroup, dict]]:
    os.environ["ARLO_TOKEN"] = "faults-token"
    cfg = load_config(overrides={"run_id": run_id, "redis": {"url": redis_url, "max_backlog": 64}, "trainer": {
        "server": {"port": 0, "metrics_port": -1, "grace_s": 0.2}, "groups_per_step": 1, "read_block_ms": 100,
        **section}})
    tasks = TaskGroup()
    server, loop = await start_trainer(cfg, tasks)
    redis = await connect(cfg.redis)
    try:
        yield loop, tasks, {"redis": redis, "stream": TrajectoryStream(redis, run_id, consumer="test-producer"),
                            "pointer": WeightPointer(redis, run_id)}
    finally:
        await tasks.cancel_all()
        await loop.close(10)
        await server.stop(0.1)
        await delete_run(redis, run_id)
        await redis.aclose()
        os.environ.pop("ARLO_TOKEN", None)


async def drained(stream: TrajectoryStream, timeout_s: float = 30.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while await stream.backlog():
        assert asyncio.get_running_loop().time() < deadline, f"backlog {await stream.backlog()}"
        await asyncio.sleep(0.05)


async def status(loop: TrainingLoop) -> trainer_pb2.GetStatusResponse:
    return await TrainerServicer(loop).GetStatus(trainer_pb2.GetStatusRequest(), None)


async def test_a_step_that_raises_puts_its_groups_back_then_dead_letters_them(redis_url: str, run_id: str) -> None:
    async with trainer(redis_url, run_id) as (loop, tasks, io):
        real_step, calls = loop.replica.step, []

        def failing(batch):  # an XLA or host error inside the step, before its update applies
            calls.append(batch.trajectory_ids)
            if len(calls) in (1, 3, 4, 5):
                raise RuntimeError(f"injected step failure {len(calls)}")
            return real_step(batch)

        loop.replica.step = failing
        first = await add_group(io["stream"])
        await wait_for(lambda: loop.state.version >= 1)
        # Trained on the retry, not dropped: nothing counted failed, nothing acked untrained.
        assert loop.state.failed_steps == 1 and loop.dropped()["failed"] == 0
        assert set(calls[1]) == set(first) and tasks.restarts["training-loop"] == 1
        await drained(io["stream"])
        second = await add_group(io["stream"])
        await wait_for(lambda: loop.dropped()["step_error"] == 2)  # 3 failures: dead-lettered with the error
        dead = await io["redis"].xrange(io["stream"].keys.traj_dead)
        assert len(dead) == 2 and all(f"failed {STEP_ATTEMPTS} times" in f[b"dead:reason"].decode() for _, f in dead)
        assert loop.state.version == 1
        await drained(io["stream"])
        assert await io["redis"].exists(*(io["stream"].keys.seen(t) for t in second)) == 0
        assert (await status(loop)).failed_steps == 4


async def test_a_foreign_pointer_is_reported_and_overtaken(redis_url: str, run_id: str) -> None:
    async with trainer(redis_url, run_id) as (loop, _, io):
        await add_group(io["stream"])
        await wait_for(lambda: loop.state.version >= 1)
        # Nobody the trainer knows writes this: a hijack, or a stray trainer's far-ahead version.
        await io["redis"].hset(io["stream"].keys.weights, "version", 1_000_000)
        await add_group(io["stream"])
        await wait_for(lambda: loop.state.version > 1_000_000)
        pointer = await io["pointer"].get()
        assert pointer.version == loop.state.version == 1_000_001
        assert pointer.sha256 == loop.store.get(0).sha256 and pointer.source == loop.source
        assert (await status(loop)).pointer_conflicts == 1
        await add_group(io["stream"], version=1_000_001)  # sampled from the new version: trains on
        await wait_for(lambda: loop.state.version == 1_000_002)
        assert (await io["pointer"].get()).version == 1_000_002 and loop.state.pointer_conflicts == 1


@pytest.fixture
def small_disk(tmp_path: Path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a size-limited tmpfs here (needs root)")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def fill(disk: Path) -> Path:
    filler = disk / "filler"
    with filler.open("wb") as f:
        try:
            while True:
                f.write(b"\0" * (1 << 20))
                f.flush()
        except OSError:
            pass
    return filler


@pytest.mark.parametrize("max_held", [4, 1], ids=["some-held", "none-held"])
async def test_a_full_checkpoint_disk_is_reported_never_stalls_training_and_saves_resume(
        redis_url: str, run_id: str, small_disk: Path, max_held: int) -> None:
    """A small hold bound, so the test sees it act. Below one step's entries (a group is 2) every
    step is acknowledged without a checkpoint as it publishes and nothing stays held: the saves
    are owed all the same (CI once saw them never retried once nothing was held)."""
    ckpt = small_disk / "ckpt"
    async with trainer(redis_url, run_id, checkpoint_dir=str(ckpt), checkpoint_every=1,
                       max_staleness=1000) as (loop, _, io):
        loop.core.holds.policy = dataclasses.replace(loop.core.holds.policy, hold_bound=max_held)
        slow_acks(loop.stream, 0.3)  # a loaded Redis: a status read may land mid-acknowledgement
        await add_group(io["stream"])
        await wait_for(lambda: loop.state.checkpoint_version >= 1)
        filler = fill(small_disk)
        for _ in range(4):
            await add_group(io["stream"])
        await wait_for(lambda: loop.state.version >= 5, seen=lambda: durability_seen(loop))  # the disk full
        await wait_for(lambda: loop.state.checkpoint_failures >= 2, seen=lambda: durability_seen(loop))
        failing = await status(loop)
        assert failing.checkpoint_version == 1 and failing.checkpoint_error
        assert "No space" in failing.checkpoint_error or "ENOSPC" in failing.checkpoint_error.upper() or \
            "28" in failing.checkpoint_error, failing.checkpoint_error
        # Held for a checkpoint, but never more than the bound: the rest acknowledged and counted.
        # The bound is applied as each step's entries join the held ones: at most one step's
        # entries (one group of 2 here) above it at the moment GetStatus reads the count.
        assert failing.held_entries <= max_held + 2 and failing.acked_undurable >= 2
        filler.unlink()  # space returns: saves resume by themselves, no restart, no new data
        await wait_for(lambda: loop.state.checkpoint_version == loop.state.version and not loop.state.held_entries,
                       timeout_s=60, seen=lambda: durability_seen(loop))
        resumed = await status(loop)
        assert resumed.checkpoint_error == "" and resumed.held_entries == 0
        await drained(io["stream"])
        assert (await io["pointer"].get()).checkpoint_version == loop.state.version


def test_a_full_checkpoint_disk_is_named_whatever_the_failed_save_raised(small_disk: Path) -> None:
    """The class behind a CI flake: a save on a full disk failed with Orbax's cleanup error
    ('Directory not empty' on its partial directory), no ENOSPC in its chain, and the status
    hid the cause. The checkpointer tells a disk without room for a checkpoint by itself."""
    from services.trainer.checkpoint import Checkpointer
    from services.trainer.saves import describe_save_failure
    checkpointer = Checkpointer(str(small_disk / "ckpt"))
    cleanup = OSError(39, f"Directory not empty: '{small_disk}/ckpt/00000002.orbax-checkpoint-tmp'")
    try:
        assert checkpointer.out_of_space() is None
        assert describe_save_failure(cleanup, checkpointer.out_of_space()).startswith("OSError: [Errno 39]")
        filler = fill(small_disk)
        full = checkpointer.out_of_space()
        assert full is not None and full.errno == 28 and str(small_disk) in str(full)
        said = describe_save_failure(cleanup, full)
        assert said.startswith("OSError: [Errno 28] No space left on device") and "Directory not empty" in said
        filler.unlink()
        assert checkpointer.out_of_space() is None
    finally:
        checkpointer.close()


def slow_acks(stream: Any, delay_s: float) -> None:
    """`stream.ack` (the real one) answers `delay_s` later."""
    real = stream.ack

    async def ack(*args: Any, **kw: Any) -> Any:
        await asyncio.sleep(delay_s)
        return await real(*args, **kw)

    stream.ack = ack


def flip_bytes(directory: Path) -> None:
    """Flips one byte in the middle of the largest data file under `directory` (a bad sector)."""
    target = max((p for p in directory.rglob("*") if p.is_file()), key=lambda p: p.stat().st_size)
    data = bytearray(target.read_bytes())
    data[len(data) // 2] ^= 0xFF
    target.write_bytes(bytes(data))


async def test_damaged_optimizer_state_or_metadata_falls_back_to_an_older_checkpoint(
        redis_url: str, run_id: str, tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    section = {"checkpoint_dir": str(ckpt), "checkpoint_every": 1, "max_staleness": 1000}
    async with trainer(redis_url, run_id, **section) as (loop, _, io):
        for _ in range(3):
            await add_group(io["stream"])
        await wait_for(lambda: loop.state.checkpoint_version == 3)
        flip_bytes(ckpt / "00000003" / "opt_state")  # params intact: only its checksum catches this
        meta = ckpt / "00000002" / "meta" / "metadata"
        meta.write_text(meta.read_text().replace('"step": 2', '"step": 9'))  # still valid JSON
    # The restart comes after the first trainer stopped: two at once on one run are refused (test_trainer_lease.py).
    async with trainer(redis_url, run_id, **section) as (again, _, _):
        report = await status(again)
        assert again.learner.step_count == 1 and report.checkpoint_version == 1
        assert report.checkpoint_fallbacks == 2 and again.state.version == 4  # numbered above all


def fail_once(obj: Any, name: str, message: str, *, when: Callable[[Any], bool]) -> list:
    """`obj.<name>` (an async method of one argument) raises ConnectionError(message) the first
    time `when(argument)` holds; returns the arguments of the failed calls."""
    real, failures = getattr(obj, name), []

    async def failing(arg: Any) -> Any:
        if not failures and when(arg):
            failures.append(arg)
            raise ConnectionError(message)
        return await real(arg)

    setattr(obj, name, failing)
    return failures


@asynccontextmanager
async def slow_steps(loop: TrainingLoop, seconds: float = 1.0) -> AsyncIterator[tuple[list, threading.Event]]:
    """Each update takes `seconds` longer (its batches' trajectory ids are recorded; the event is set
    once the first one is training), so the test can act while a step is in flight."""
    real_step, trained, training = loop.replica.step, [], threading.Event()

    def slow(batch):
        trained.append(batch.trajectory_ids)
        training.set()
        time.sleep(seconds)
        return real_step(batch)

    loop.replica.step = slow
    yield trained, training


async def test_the_next_batch_is_read_and_grouped_while_a_step_trains(redis_url: str, run_id: str) -> None:
    async with trainer(redis_url, run_id) as (loop, _, io), slow_steps(loop) as (trained, training):
        records: list[dict] = []

        async def keep(record: dict) -> None:
            records.append(record)

        loop.on_step.append(keep)
        first = await add_group(io["stream"])
        await wait_for(training.is_set)
        second = await add_group(io["stream"])  # arrives while step 1 trains
        await wait_for(lambda: loop.state.version >= 2)
        await drained(io["stream"])
        assert [set(ids) for ids in trained] == [set(first), set(second)]  # each once, in order
        rl = [r for r in records if r["phase"] == "rl"]
        assert rl[0]["timing"]["intake_overlapped_s"] > 0  # the second group was taken in during step 1
        assert rl[1]["timing"]["intake_s"] == 0.0  # so step 2 started without reading anything
        # Step 1's record and acks ran beside step 2 (services/trainer/tail.py), in step order.
        assert rl[1]["timing"]["tail_overlapped_s"] > 0
        assert [r["version"] for r in rl] == [1, 2]


async def test_a_failed_acknowledgement_in_a_deferred_tail_is_retried_and_nothing_trains_twice(
        redis_url: str, run_id: str) -> None:
    async with trainer(redis_url, run_id) as (loop, tasks, io), slow_steps(loop) as (trained, training):
        failures = fail_once(loop.stream, "ack", "injected: Redis went away during step 1's acknowledgement",
                             when=bool)  # the first ack of any entries
        first = await add_group(io["stream"])
        await wait_for(training.is_set)
        second = await add_group(io["stream"])  # trains while step 1's tail runs (and fails)
        await wait_for(lambda: loop.state.version >= 2)
        await drained(io["stream"])  # step 1's entries went with step 2's acknowledgement
        # The restart is counted when the task group sees the loop end, which may come after the
        # drain (CI: KeyError 'training-loop' under load).
        await wait_for(lambda: tasks.restarts.get("training-loop", 0) >= 1)
        assert len(failures) == 1 and tasks.restarts["training-loop"] == 1
        assert [set(ids) for ids in trained] == [set(first), set(second)]  # the restart re-read; none retrained
        assert sum(loop.dropped().values()) == 0 and loop.state.held_entries == 0


async def test_a_producer_retry_of_the_training_steps_trajectories_is_not_trained_again(
        redis_url: str, run_id: str) -> None:
    async with trainer(redis_url, run_id) as (loop, _, io), slow_steps(loop) as (trained, training):
        group = uuid.uuid4().hex
        trajs = [traj(group, 1.0), traj(group, 0.0)]
        await io["stream"].add_group(trajs)
        await wait_for(training.is_set)
        # The producer's first XADD landed but its reply was lost: it sends the same trajectories
        # again, as new entries, while the step that trains them is in flight (held by no list but
        # the step's own until the step records them).
        await io["stream"].add_group(trajs)
        await wait_for(lambda: loop.dropped()["duplicate"] == 2)
        await drained(io["stream"])
        await asyncio.sleep(1.5)  # a second step, were one taken, would have begun by now
        assert len(trained) == 1 and loop.state.version == 1


async def test_an_intake_failure_during_a_step_publishes_the_step_then_rereads_what_it_lost(
        redis_url: str, run_id: str) -> None:
    async with trainer(redis_url, run_id) as (loop, tasks, io), slow_steps(loop) as (trained, training):
        failures = fail_once(loop.stream, "filter_unseen", "injected: Redis went away during intake",
                             when=lambda _: training.is_set())
        first = await add_group(io["stream"])
        await wait_for(training.is_set)
        second = await add_group(io["stream"])  # read during step 1; its intake fails
        await wait_for(lambda: loop.state.version >= 2)
        await drained(io["stream"])
        assert len(failures) == 1 and tasks.restarts["training-loop"] == 1
        # Step 1 published despite the failure; the restarted loop re-read the second group's entries.
        assert [set(ids) for ids in trained] == [set(first), set(second)]
        assert sum(loop.dropped().values()) == 0


async def test_a_publish_beside_the_next_step_sends_its_own_steps_weights(redis_url: str, run_id: str,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The run loop copies a step's weights and publishes them while the next step trains (and
    donates the arrays the copy came from): each version's published bytes are exactly what an
    inline publish of its step's weights would have sent."""
    from arlo.model.weights import ServingCopy, sha256_hex
    from services.trainer.gather import state_bytes

    async with trainer(redis_url, run_id) as (loop, _, io):
        expected: dict[int, str] = {}  # version -> sha256 of its weights, serialised at once, inline
        second_trained = threading.Event()
        real_step, real_to_bytes = loop.replica.step, ServingCopy.to_bytes

        def step(batch):
            metrics = real_step(batch)
            expected[loop.learner.step_count] = sha256_hex(state_bytes(loop.learner.state, loop.learner.param_dtype))
            if loop.learner.step_count == 2:
                second_trained.set()
            return metrics

        def late_to_bytes(copy: ServingCopy) -> bytes:  # version 1's serialisation waits for step 2
            assert second_trained.wait(120), "step 2 never trained"
            return real_to_bytes(copy)

        loop.replica.step = step
        monkeypatch.setattr(ServingCopy, "to_bytes", late_to_bytes)
        records: list[dict] = []

        async def keep(record: dict) -> None:
            records.append(record)

        loop.on_step.append(keep)
        await add_group(io["stream"])
        await add_group(io["stream"])
        await wait_for(lambda: len(records) >= 2, seen=lambda: records)
        await drained(io["stream"])
        assert (await io["pointer"].get()).version == loop.state.version == 2
        assert [loop.store.get(v).sha256 for v in (1, 2)] == [expected[1], expected[2]]
        assert expected[1] != expected[2]
        first, second = (r["anatomy"] for r in records)
        assert first["published_at"] >= second["trained_at"]  # published after step 2 donated its arrays
        assert records[0]["timing"]["publish_overlapped_s"] > 0
        assert first["cut_at"] == second["prev_cut_at"]  # the step ends at the cut, not at the pointer


async def test_a_failed_publish_beside_the_next_step_is_retried_inline_and_nothing_is_lost(
        redis_url: str, run_id: str) -> None:
    # Staleness 4: the three groups, all sampled from version 0, stay fresh until the third step.
    async with trainer(redis_url, run_id, max_staleness=4) as (loop, _, io), slow_steps(loop, 0.5) as (trained, _):
        real_publish, failures = loop.pointer.publish, []

        async def failing(version: int, **kw: Any) -> bool:
            if version == 1 and not failures:
                failures.append(version)
                raise ConnectionError("injected: Redis went away during version 1's publish")
            return await real_publish(version, **kw)

        loop.pointer.publish = failing
        groups = [await add_group(io["stream"]) for _ in range(3)]
        await wait_for(lambda: loop.state.version >= 3, seen=lambda: loop.state)
        await drained(io["stream"])  # every step's entries acknowledged once a later version published
        assert failures == [1] and loop.state.publish_failures == 1
        assert [set(ids) for ids in trained] == [set(g) for g in groups]  # each once, none lost
        pointer = await io["pointer"].get()
        assert pointer.version == 3 and pointer.sha256 == loop.store.get(3).sha256
        assert sum(loop.dropped().values()) == 0 and loop.state.held_entries == 0


async def test_a_step_that_must_publish_inline_waits_for_the_previous_overlapped_publish(
        redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A pause-due step publishes inline (its tail may not run beside a next step): it must not
    overtake the previous step's publish still in its tail, or that one finds its own newer
    version on the pointer (a spurious conflict and failure, a version never published)."""
    from arlo.model.weights import ServingCopy

    async with trainer(redis_url, run_id, max_staleness=4) as (loop, _, io):
        second_trained = threading.Event()
        real_step, real_to_bytes = loop.replica.step, ServingCopy.to_bytes

        def step(batch):
            metrics = real_step(batch)
            if loop.learner.step_count == 2:
                second_trained.set()
            return metrics

        def late_to_bytes(copy: ServingCopy) -> bytes:
            # Version 1's publish is still running when step 2 ends, and gives step 2's publish
            # 3 s to overtake it (which it must not take).
            assert second_trained.wait(120), "step 2 never trained"
            deadline = time.monotonic() + 3.0
            while loop.store.get(2) is None and time.monotonic() < deadline:
                time.sleep(0.01)
            return real_to_bytes(copy)

        loop.replica.step = step
        monkeypatch.setattr(ServingCopy, "to_bytes", late_to_bytes)
        loop.resume(until_step=2)  # step 2 is pause-due: published inline
        await add_group(io["stream"])
        await add_group(io["stream"])
        await wait_for(lambda: loop.state.paused and loop.learner.step_count == 2, seen=lambda: loop.state)
        await loop.pause()
        assert loop.state.publish_failures == 0 and loop.state.pointer_conflicts == 0
        assert [v for v in (1, 2) if loop.store.get(v) is not None] == [1, 2]  # both published, in order
        assert (await io["pointer"].get()).version == loop.state.version == 2


async def test_training_runs_at_most_one_step_ahead_of_a_slow_publish(redis_url: str, run_id: str) -> None:
    """Each overlapped publish holds a device copy of the weights: with the pointer slower than a
    step (a slow Redis, a hash slower than the update), steps wait for the previous publish
    rather than pile up copies and run ahead of what the fleet can be given."""
    async with trainer(redis_url, run_id, max_staleness=8) as (loop, _, io):
        real_publish, ahead = loop.pointer.publish, []

        async def slow(version: int, **kw: Any) -> bool:
            ahead.append(loop.state.version - version)
            await asyncio.sleep(0.3)
            return await real_publish(version, **kw)

        loop.pointer.publish = slow
        for _ in range(6):
            await add_group(io["stream"])
        await wait_for(lambda: loop.learner.step_count >= 6, seen=lambda: loop.state)
        await drained(io["stream"])
        assert len(ahead) >= 6 and max(ahead) <= 1, ahead
        assert loop.state.publish_failures == 0 and (await io["pointer"].get()).version == 6
