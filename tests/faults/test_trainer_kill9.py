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
pytestmark = pytest.mark.timeout(420)


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
        for proc in (first, second):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
        await delete_run(redis, run_id)
        await redis.aclose()

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
