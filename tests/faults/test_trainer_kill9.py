"""`kill -9` of a real trainer process mid-run, with groups still queued, then a restart.

The restarted trainer must resume from the newest complete checkpoint (step and version
continue, versions never repeat), re-read the entries the dead one never acknowledged, and
train every trajectory exactly once in the final lineage: the dead process's steps up to
that checkpoint plus every step of the new one. Each step's trajectory ids come from the
trainer's JSON log (one line per step).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import uuid
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from arlo.config import load_config
from arlo.coord import TrajectoryStream, WeightPointer, connect, delete_run
from arlo.proto.v1 import common_pb2

ROOT = Path(__file__).resolve().parents[2]
GROUPS = 30
pytestmark = pytest.mark.timeout(900)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def trajectory(group: str, reward: float) -> common_pb2.Trajectory:
    prompt = [257, 260, 51, 43, 52, 61, 258, 261]
    return common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=prompt + [55, 258],
        logprobs=[0.0] * 8 + [-5.5, -5.5], loss_mask=[0] * 8 + [1, 1], policy_versions=[-1] * 8 + [0, 0],
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


def start(config: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "ARLO_TOKEN": "kill9-token", "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_CONFIG", None)
    return subprocess.Popen([sys.executable, "-m", "services.trainer", "-c", str(config)], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


def records(log: Path) -> list[dict[str, Any]]:
    out = []
    for line in log.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue  # a line cut by kill -9
    return out


def steps(log: Path) -> list[dict[str, Any]]:
    return [r for r in records(log) if "trajectory_ids" in r]


async def wait_until(check: Callable[[], Any], proc: subprocess.Popen, log: Path, timeout_s: float) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert proc.poll() is None, f"trainer exited with {proc.returncode}:\n{log.read_text()[-3000:]}"
        assert asyncio.get_running_loop().time() < deadline, f"timed out:\n{log.read_text()[-3000:]}"
        await asyncio.sleep(0.02)


def complete_versions(ckpt: Path) -> list[int]:
    return sorted(int(p.name) for p in ckpt.iterdir() if p.is_dir() and p.name.isdigit())


async def stop(redis: Any, run_id: str, *procs: subprocess.Popen | None) -> None:
    """Kills what still runs and deletes the run's keys: no process or key outlives a test."""
    for proc in procs:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
    await delete_run(redis, run_id)
    await redis.aclose()


# Slow tier: the default tier kills -9 the trainer at three points of a run (mid-step, just published,
# mid-save) and checks the same resume and exactly-once training, below
# (test_kill9_mid_step_just_published_and_mid_save_never_go_back).
@pytest.mark.slow
async def test_kill9_resumes_from_the_last_complete_checkpoint_and_trains_each_trajectory_once(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"run_id": run_id, "redis": {"url": redis_url}, "trainer": {
        "server": {"port": free_port(), "metrics_port": -1, "grace_s": 0.2}, "groups_per_step": 1,
        "read_block_ms": 100, "max_staleness": 100000, "checkpoint_dir": str(ckpt), "checkpoint_every": 1}}))
    redis = await connect(load_config(overrides={"redis": {"url": redis_url}}).redis)
    stream = TrajectoryStream(redis, run_id, consumer="test-producer")
    pointer = WeightPointer(redis, run_id)
    pointer_versions: list[int] = []

    async def pointer_state():
        state = await pointer.get()
        if state is not None:
            pointer_versions.append(state.version)
        return state

    async def pending() -> int:
        return int((await redis.xpending(stream.keys.traj, "trainer"))["pending"])

    fed = []
    for _ in range(GROUPS):
        group = uuid.uuid4().hex
        for reward in (1.0, 0.0):
            traj = trajectory(group, reward)
            await stream.add(traj)
            fed.append(traj.id)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start(config, first_log)
    second = None
    try:
        async def checkpointed_three() -> bool:
            state = await pointer_state()
            return state is not None and state.checkpoint_version >= 3

        await wait_until(checkpointed_three, first, first_log, timeout_s=240)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        at_kill = await pointer_state()
        unacked = await pending()
        newest_complete = complete_versions(ckpt)[-1]
        dead_steps = steps(first_log)
        assert len({t for s in dead_steps for t in s["trajectory_ids"]}) < len(fed), "killed too late"
        assert unacked > 0 and newest_complete >= at_kill.checkpoint_version >= 3

        second = start(config, second_log)

        async def all_acked() -> bool:
            await pointer_state()
            backlog = await stream.backlog()
            return backlog == 0 and bool(steps(second_log))

        await wait_until(all_acked, second, second_log, timeout_s=240)
        final = await pointer_state()
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, second_log.read_text()[-3000:]
    finally:
        await stop(redis, run_id, first, second)

    later = records(second_log)
    resumed = next(r for r in later if r["msg"].startswith("resumed from checkpoint"))
    reread = next(r for r in later if "pending_entries" in r)
    new_steps = steps(second_log)
    # Resumed from the newest complete checkpoint; the dead process's step numbering continues.
    assert resumed["version"] == newest_complete
    dead_by_step = {s["step"]: s for s in dead_steps}
    assert dead_by_step[resumed["step"]]["version"] == resumed["version"]
    assert [s["step"] for s in new_steps] == list(range(resumed["step"] + 1, resumed["step"] + 1 + len(new_steps)))
    # Versions never repeat: the new process numbers above everything the dead one published.
    assert min(s["version"] for s in new_steps) > max(at_kill.version, max(s["version"] for s in dead_steps))
    assert pointer_versions == sorted(pointer_versions)
    assert final.version == new_steps[-1]["version"] and final.checkpoint_version == final.version
    # It re-read what the dead process had been given but never acknowledged.
    assert reread["pending_entries"] == unacked
    lineage = [s for s in dead_steps if s["step"] <= resumed["step"]] + new_steps
    counts = Counter(t for s in lineage for t in s["trajectory_ids"])
    assert set(counts) == set(fed)
    assert [t for t, n in counts.items() if n != 1] == []


KILL_POINTS = ("mid-step", "just-published", "mid-save")


async def kill_at(point: str, proc: subprocess.Popen, log: Path, pointer: WeightPointer,
                  feed: Callable[[], Any], rng: random.Random) -> dict:
    """Feeds one group at a time to an idle trainer and kills it at `point` of that group's step.

    mid-step: a random delay after the feed, while the pointer still names the previous version
    (the batch is being read or trained; a kill that came late is retried with the next group).
    just-published: the pointer has just moved to the new version (published, not durable, nothing
    of it acked). mid-save: the step's log line is out but its "checkpoint V complete" line is not."""
    def checkpointed() -> set[int]:
        return {r["checkpoint_version"] for r in records(log) if "complete:" in r.get("msg", "")}

    async def idle() -> bool:  # the newest step is checkpointed and nothing is queued
        stepped = {s["version"] for s in steps(log)}
        state = await pointer.get()
        return bool(stepped) and max(stepped) in checkpointed() and state.version == max(stepped)

    await feed()  # the first step of this process (compiles)
    await wait_until(idle, proc, log, timeout_s=240)
    delay = 0.3
    while True:
        before = (await pointer.get()).version
        await feed()
        if point == "mid-step":
            await asyncio.sleep(rng.uniform(0.0, delay))
            if (await pointer.get()).version == before:
                break
            delay /= 2  # too late: the step was already published
            await wait_until(idle, proc, log, timeout_s=120)
            continue
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            state = await pointer.get()
            if point == "just-published" and state.version > before:
                break
            if point == "mid-save" and any(s["version"] > before for s in steps(log)) and not any(
                    v > before for v in checkpointed()):
                break
            await asyncio.sleep(0.002)
        break
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=30)
    return {"point": point, "pointer_before": before, "pointer": await pointer.get()}


async def test_kill9_mid_step_just_published_and_mid_save_never_go_back(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    """Issue 16: kill -9 at several points of one run. After each restart: resumed from the newest
    complete checkpoint, versions only go forward, every trajectory acknowledged (`seen:`) at a
    kill is in what that checkpoint covers; at the end each trajectory is trained exactly once in
    the surviving lineage and the pointer names the trainer's newest, checkpointed version."""
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"run_id": run_id, "redis": {"url": redis_url}, "trainer": {
        "server": {"port": free_port(), "metrics_port": -1, "grace_s": 0.2}, "groups_per_step": 1,
        "read_block_ms": 50, "max_staleness": 100000, "checkpoint_dir": str(ckpt), "checkpoint_every": 1}}))
    redis = await connect(load_config(overrides={"redis": {"url": redis_url}}).redis)
    stream = TrajectoryStream(redis, run_id, consumer="test-producer")
    pointer = WeightPointer(redis, run_id)
    fed: list[str] = []

    async def feed() -> None:
        group = uuid.uuid4().hex
        for reward in (1.0, 0.0):
            traj = trajectory(group, reward)
            await stream.add(traj)
            fed.append(traj.id)

    rng = random.Random(16)
    logs: list[Path] = []
    kills: list[dict] = []
    proc = None
    try:
        for i, point in enumerate(KILL_POINTS):
            logs.append(tmp_path / f"{i}.log")
            proc = start(config, logs[-1])
            kill = await kill_at(point, proc, logs[-1], pointer, feed, rng)
            kill["checkpoint"] = complete_versions(ckpt)[-1]
            kill["acked"] = {k.decode().rsplit(":", 1)[1] async for k in redis.scan_iter(f"arlo:{run_id}:seen:*")}
            kills.append(kill)
        logs.append(tmp_path / "last.log")
        proc = start(config, logs[-1])
        for _ in range(3):
            await feed()

        async def all_acked() -> bool:
            return await stream.backlog() == 0 and bool(steps(logs[-1]))

        await wait_until(all_acked, proc, logs[-1], timeout_s=300)
        final = await pointer.get()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, logs[-1].read_text()[-3000:]
    finally:
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        await delete_run(redis, run_id)
        await redis.aclose()

    resumed = [next(r for r in records(log) if r["msg"].startswith("resumed from checkpoint")) for log in logs[1:]]
    lineage: list[dict] = []
    for i, log in enumerate(logs):
        if i:
            kill = kills[i - 1]
            # Resumed from the newest complete checkpoint at the kill; numbered above all published.
            assert resumed[i - 1]["version"] == kill["checkpoint"], kill["point"]
            later = steps(log)
            assert not later or min(s["version"] for s in later) > kill["pointer"].version, kill["point"]
            # Everything acknowledged at the kill is in what the restored checkpoint covers.
            covered = {t for s in lineage if s["version"] <= kill["checkpoint"] for t in s["trajectory_ids"]}
            assert kill["acked"] <= covered, (kill["point"], len(kill["acked"] - covered))
        cut = resumed[i]["step"] if i < len(resumed) else None
        lineage += [s for s in steps(log) if cut is None or s["step"] <= cut]
    counts = Counter(t for s in lineage for t in s["trajectory_ids"])
    assert set(counts) == set(fed) and [t for t, n in counts.items() if n != 1] == []
    assert final.version == lineage[-1]["version"] == final.checkpoint_version
    print({k["point"]: (k["pointer_before"], k["pointer"].version, k["checkpoint"], len(k["acked"])) for k in kills})


async def test_kill9_after_the_warm_start_resumes_past_it_and_does_not_redo_it(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    """The SFT warm start is checkpointed when it ends: a trainer killed before its first RL
    checkpoint used to restart with nothing on disk and redo every SFT step (the built-in demo's
    600, minutes on 2 cores). Now the restart resumes from the warm start's checkpoint, in RL."""
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.yaml"
    sft_steps = 6
    config.write_text(json.dumps({"run_id": run_id, "redis": {"url": redis_url}, "trainer": {
        "server": {"port": free_port(), "metrics_port": -1, "grace_s": 0.2}, "groups_per_step": 1,
        "read_block_ms": 50, "checkpoint_dir": str(ckpt), "checkpoint_every": 1000,
        "sft": {"data": "builtin:arith_tool", "steps": sft_steps, "batch_size": 8}}}))
    redis = await connect(load_config(overrides={"redis": {"url": redis_url}}).redis)
    pointer = WeightPointer(redis, run_id)
    first_log, second_log = tmp_path / "first.log", tmp_path / "second.log"
    first = start(config, first_log)
    second = None
    try:
        async def warm_start_checkpointed() -> bool:
            state = await pointer.get()
            return state is not None and state.checkpoint_version >= 1

        await wait_until(warm_start_checkpointed, first, first_log, timeout_s=240)
        first.send_signal(signal.SIGKILL)
        first.wait(timeout=30)
        second = start(config, second_log)

        async def resumed() -> bool:
            return any(r.get("msg", "").startswith("resumed from checkpoint") for r in records(second_log))

        await wait_until(resumed, second, second_log, timeout_s=240)
        second.send_signal(signal.SIGTERM)
        assert second.wait(timeout=60) == 0, second_log.read_text()[-3000:]
    finally:
        await stop(redis, run_id, first, second)
    warm = [r for r in records(first_log) if r.get("msg", "").startswith("warm start done")]
    assert len(warm) == 1 and warm[0]["msg"].startswith(f"warm start done: {sft_steps} SFT steps -> version 1")
    back = next(r for r in records(second_log) if r.get("msg", "").startswith("resumed from checkpoint"))
    assert back["step"] == sft_steps and back["version"] == 1, back
    assert not [r for r in records(second_log) if r.get("msg", "").startswith("warm start done")]
    assert not [r for r in records(second_log) if r.get("phase") == "sft"]
