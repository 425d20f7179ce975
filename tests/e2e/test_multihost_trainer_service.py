"""`python -m services.trainer` as two JAX processes (the JobSet's variables, on loopback) with the
real Redis: process 0 trains from the stream, publishes, checkpoints and serves PullWeights while
process 1 replays its work; stopping process 0 releases process 1, and both exit cleanly."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from arlo.config import load_config
from arlo.coord import TrajectoryStream, WeightPointer, connect, delete_run
from arlo.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "multihost-token"
GROUPS = 4
# Slow tier: the two-process trainer itself (lockstep, equal to one process) is in the default tier,
# tests/unit/test_trainer_multihost.py; this adds the service around it.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


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


def start(config: Path, pid: int, coordinator: str, log: Path) -> subprocess.Popen:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "TPU_", "MEGASCALE_", "JOB_COMPLETION"))}
    env = {**base, "ARLO_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": "--xla_force_host_platform_device_count=2", "JAX_COORDINATOR_ADDRESS": coordinator,
           "JAX_NUM_PROCESSES": "2", "JOB_COMPLETION_INDEX": str(pid)}
    env.pop("ARLO_CONFIG", None)
    # On one machine the hosts' trainer ports would collide: process 1 takes any free one.
    port = [] if pid == 0 else ["--port", "0"]
    return subprocess.Popen([sys.executable, "-m", "services.trainer", "-c", str(config), *port], cwd=ROOT, env=env,
                            stdout=subprocess.DEVNULL, stderr=log.open("w"))


async def pull(address: str, version: int) -> bytes:
    async with make_channel(address, token=TOKEN) as channel:
        stub = trainer_pb2_grpc.TrainerStub(channel)
        chunks = [c async for c in stub.PullWeights(trainer_pb2.PullWeightsRequest(version=version), timeout=30)]
    return b"".join(c.data for c in chunks)


async def test_two_process_trainer_trains_from_the_stream_and_stops_together(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    ckpt = tmp_path / "ckpt"
    config = tmp_path / "run.yaml"
    config.write_text(json.dumps({"run_id": run_id, "redis": {"url": redis_url}, "trainer": {
        "server": {"host": "127.0.0.1", "port": free_port(), "metrics_port": -1, "grace_s": 0.2},
        "groups_per_step": 1, "read_block_ms": 100, "max_staleness": 100000, "checkpoint_dir": str(ckpt),
        "checkpoint_every": 2, "mesh": {"axis_sizes": [1, -1, 1]}}}))
    redis = await connect(load_config(overrides={"redis": {"url": redis_url}}).redis)
    stream = TrajectoryStream(redis, run_id, consumer="test-producer")
    pointer = WeightPointer(redis, run_id)
    coordinator = f"127.0.0.1:{free_port()}"
    logs = [tmp_path / f"trainer-{pid}.log" for pid in range(2)]
    procs = [start(config, pid, coordinator, logs[pid]) for pid in range(2)]

    def tails() -> str:
        return "\n".join(f"--- process {i}:\n{log.read_text()[-2500:]}" for i, log in enumerate(logs))

    async def wait_for(check, timeout_s: float) -> None:  # noqa: ANN001
        deadline = asyncio.get_running_loop().time() + timeout_s
        while not await check():
            assert all(p.poll() is None for p in procs), f"a trainer process exited:\n{tails()}"
            assert asyncio.get_running_loop().time() < deadline, f"timed out:\n{tails()}"
            await asyncio.sleep(0.1)

    try:
        await stream.ensure_group()
        for _ in range(GROUPS):
            group = uuid.uuid4().hex
            for reward in (1.0, 0.0):
                await stream.add(trajectory(group, reward))

        async def trained() -> bool:
            state = await pointer.get()
            return state is not None and state.version >= GROUPS and state.checkpoint_version >= GROUPS

        await wait_for(trained, 300)
        state = await pointer.get()
        assert state is not None and state.source.startswith("grpc://127.0.0.1:")
        # Process 0 serves the version it published; the bytes match the pointer's checksum.
        data = await pull(state.source.removeprefix("grpc://"), state.version)
        assert hashlib.sha256(data).hexdigest() == state.sha256
        assert int((await redis.xpending(stream.keys.traj, "trainer"))["pending"]) == 0  # all acknowledged

        procs[0].send_signal(signal.SIGTERM)  # process 1 gets no signal: process 0's stop releases it
        for p in procs:
            assert p.wait(timeout=120) == 0, tails()
        # Process 1 replayed everything: the restore at start, then a step and a publish per
        # version, and a save every second version.
        replayed = re.search(r"leader stopped after (\d+) ops", logs[1].read_text())
        assert replayed is not None, tails()
        assert int(replayed.group(1)) == 1 + 2 * GROUPS + GROUPS // 2, tails()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        await delete_run(redis, run_id)
        await redis.aclose()
