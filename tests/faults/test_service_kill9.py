"""kill -9, in turn, of an inference replica, the env_gateway, the reward service and a rollout
worker, then of Redis, during one local training run started the way `arlo demo` starts it.

After each fault the supervisor restarts the process and the run goes on taking steps. At the
end, with the rollout worker stopped and the trainer paused, every stream entry ever written is
accounted for: trained on (each trajectory id exactly once), dropped with a reason the trainer
counts, or still queued in Redis (unacknowledged, so it will be trained or dropped later). An
`audit` consumer group that never reads keeps every entry in the stream for that check. The
weight pointer and the trainer's version never go backwards, nor does any one inference
process's served version. Redis persists with an fsync'd append-only file, as a production
Redis would, so its restart loses nothing that was acknowledged.

Set ARLO_FAULT_REPORT=path.json to write the figures (docs/reliability.md quotes them).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from arlo.app.local import INFRA_SERVICES, LocalCluster, prepare_cluster
from arlo.app.redis_server import free_port, redis_answers
from arlo.app.supervisor import is_serving
from arlo.config import load_config
from arlo.coord import connect
from arlo.coord.client import text
from arlo.coord.codec import MalformedEntry, decode, parse_stream_id
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel

pytestmark = [pytest.mark.slow, pytest.mark.timeout(480),
              pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server on PATH")]

VICTIMS = ("inference", "env_gateway", "reward", "rollout", "redis")
STEPS_BETWEEN = 1


class PersistentRedis:
    """redis-server with an fsync'd AOF in `workdir`, restartable on the same port."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.process = subprocess.Popen(
            ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "yes",
             "--appendfsync", "always", "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 20
        while not redis_answers(self.url, 0.2):
            assert self.process.poll() is None and time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)

    def kill9(self) -> None:
        assert self.process is not None
        self.process.send_signal(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=10)


@dataclass
class Observed:
    pointer: list[int] = field(default_factory=list)
    trainer: list[int] = field(default_factory=list)
    inference: dict[int, list[int]] = field(default_factory=dict)  # pid -> versions it served, in order
    recovery_s: dict[str, float] = field(default_factory=dict)


class Run:
    def __init__(self, cluster: LocalCluster, redis: PersistentRedis) -> None:
        self.cluster = cluster
        self.redis = redis
        self.cfg = cluster.cfg
        self.seen = Observed()

    async def status(self) -> trainer_pb2.GetStatusResponse:
        async with make_channel(self.cfg.trainer.server.address, token=self.cluster.token) as ch:
            return await trainer_pb2_grpc.TrainerStub(ch).GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)

    async def sample(self) -> int:
        """Records the versions everyone serves; returns the trainer's step."""
        status = await self.status()
        self.seen.trainer.append(status.version)
        try:
            redis = await connect(self.cfg.redis)
            try:
                version = await redis.hget(f"arlo:{self.cfg.run_id}:weights", "version")
            finally:
                await redis.aclose()
            if version is not None:
                self.seen.pointer.append(int(version))
        except (OSError, ConnectionError):
            pass  # Redis is being restarted
        child = self.cluster.supervisor.children["inference"]
        try:
            async with make_channel(self.cfg.inference.server.address, token=self.cluster.token) as ch:
                info = await inference_pb2_grpc.InferenceStub(ch).GetModelInfo(
                    inference_pb2.GetModelInfoRequest(), timeout=2)
            self.seen.inference.setdefault(child.process.pid, []).append(info.policy_version)
        except grpc.aio.AioRpcError:
            pass  # down, or restarting
        return status.step

    async def steps(self, n: int, timeout_s: float = 240.0) -> float:
        """Waits for `n` more trainer steps, restarting dead children meanwhile; returns the wait."""
        started = time.monotonic()
        first = await self.sample()
        while (await self.sample()) - first < n:
            self.cluster.supervisor.check()
            assert time.monotonic() - started < timeout_s, f"no progress: {self.logs()}"
            await asyncio.sleep(0.25)
        return time.monotonic() - started

    async def kill(self, victim: str) -> None:
        if victim == "redis":
            self.redis.kill9()
            await asyncio.sleep(1.0)
            self.redis.start()
            return
        child = self.cluster.supervisor.children[victim]
        os.killpg(child.process.pid, signal.SIGKILL)
        child.process.wait()
        deadline = time.monotonic() + 120
        self.cluster.supervisor.check()  # restarts it, as `arlo up`'s loop does
        address = getattr(self.cfg, victim).server.address
        while not await asyncio.to_thread(is_serving, address, 0.5):
            assert child.process.poll() is None and time.monotonic() < deadline, self.logs()
            await asyncio.sleep(0.2)

    def logs(self) -> str:
        return "\n".join(f"--- {s.name}\n{s.log_path.read_text(errors='replace')[-1500:]}"
                         for s in self.cluster.supervisor.specs if s.log_path.exists())


def trained_ids(log: Path) -> list[list[str]]:
    steps = []
    for line in log.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "trajectory_ids" in record:
            steps.append(record["trajectory_ids"])
    return steps


async def stream_accounting(cfg, trained: list[list[str]], dropped_reported: int, consumed: int) -> dict:
    redis = await connect(cfg.redis)
    key = f"arlo:{cfg.run_id}:traj"
    try:
        entries = await redis.xrange(key)
        pending = {text(p["message_id"]) for p in await redis.xpending_range(key, "trainer", "-", "+", 100_000)}
        group = next(g for g in await redis.xinfo_groups(key) if text(g["name"]) == "trainer")
        last = parse_stream_id(text(group["last-delivered-id"]))
        dead = await redis.xlen(f"arlo:{cfg.run_id}:traj:dead")
    finally:
        await redis.aclose()
    trained_once = Counter(t for step in trained for t in step)
    queued, done_with, undecodable = [], [], 0
    produced: list[str] = []
    for entry_id, fields in entries:
        eid = text(entry_id)
        try:
            traj_id = decode(fields).id
        except MalformedEntry:
            undecodable += 1
            continue
        produced.append(traj_id)
        (queued if eid in pending or parse_stream_id(eid) > last else done_with).append(traj_id)
    # Of the entries the trainer finished with, one per trained id was trained; the rest were dropped.
    unclaimed = Counter(trained_once)
    dropped = 0
    for traj_id in done_with:
        if unclaimed[traj_id]:
            unclaimed[traj_id] -= 1
        else:
            dropped += 1
    return {"entries": len(entries), "produced_ids": len(set(produced)), "trained": sum(trained_once.values()),
            "trained_more_than_once": [t for t, n in trained_once.items() if n > 1],
            "trained_not_produced": sorted(set(trained_once) - set(produced)),
            "trained_not_finished": sum(unclaimed.values()), "dropped": dropped, "dropped_reported": dropped_reported,
            "consumed_reported": consumed, "queued": len(queued), "undecodable": undecodable, "dead_letters": dead}


def test_kill9_of_each_service_and_a_redis_restart_lose_nothing(tmp_path: Path) -> None:
    redis = PersistentRedis(tmp_path / "redis")
    redis.workdir.mkdir()
    redis.start()
    server = {"grace_s": 0.5}
    cfg = load_config(overrides={
        "run_id": "faults", "redis": {"url": redis.url},
        "inference": {"server": server, "max_n": 4, "max_tokens": 16, "max_batch": 16, "weight_poll_s": 0.5},
        # Staleness high: a restarted replica serves its initial weights until its first pull,
        # and the admission gate counts such (stale) groups as accepted (see docs/reliability.md).
        "trainer": {"server": server, "groups_per_step": 2, "read_block_ms": 200, "max_staleness": 1000},
        "env_gateway": {"server": server}, "reward": {"server": server},
        "rollout": {"server": server, "group_size": 2, "concurrent_groups": 4}})
    old_token = os.environ.pop(cfg.auth.token_env, None)
    cluster = prepare_cluster(cfg, home=tmp_path / "home", free_ports=True)
    run = Run(cluster, redis)
    report: dict = {}
    try:
        async def audit_group() -> None:
            r = await connect(cluster.cfg.redis)
            await r.xgroup_create(f"arlo:{cluster.cfg.run_id}:traj", "audit", id="0", mkstream=True)
            await r.aclose()

        asyncio.run(audit_group())
        started = time.monotonic()
        cluster.start(INFRA_SERVICES)
        cluster.start(("rollout",))

        async def drive() -> trainer_pb2.GetStatusResponse:
            async with make_channel(cluster.cfg.trainer.server.address, token=cluster.token) as ch:
                trainer = trainer_pb2_grpc.TrainerStub(ch)
                await trainer.Resume(trainer_pb2.ResumeRequest(), timeout=10)
                await run.steps(STEPS_BETWEEN)
                for victim in VICTIMS:
                    await run.kill(victim)
                    run.seen.recovery_s[victim] = round(await run.steps(STEPS_BETWEEN), 1)
                child = cluster.supervisor.children["rollout"]
                child.process.terminate()  # no new entries while the books are checked
                child.process.wait(timeout=30)
                await trainer.Pause(trainer_pb2.PauseRequest(), timeout=60)
                # Acknowledgements wait for a checkpoint covering their step (local runs checkpoint
                # by default): one now, so the books close on everything trained.
                await trainer.SaveCheckpoint(trainer_pb2.SaveCheckpointRequest(), timeout=120)
                return await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)

        final = asyncio.run(drive())
        steps = trained_ids(cluster.home / "logs" / "trainer.log")
        books = asyncio.run(stream_accounting(cluster.cfg, steps, final.trajectories_dropped,
                                              final.trajectories_consumed))
        restarts = {name: c.restarts for name, c in cluster.supervisor.children.items()}
        report = {"wall_s": round(time.monotonic() - started, 1), "steps": final.step, "version": final.version,
                  "recovery_s": run.seen.recovery_s, "restarts": restarts, **books,
                  "pointer_versions_seen": len(run.seen.pointer),
                  "inference_processes": len(run.seen.inference)}
    finally:
        cluster.stop(grace_s=5)
        redis.stop()
        if old_token is not None:
            os.environ[cfg.auth.token_env] = old_token
    if os.environ.get("ARLO_FAULT_REPORT"):
        Path(os.environ["ARLO_FAULT_REPORT"]).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))

    # Every fault was survived by a restart, and the run kept taking steps.
    assert restarts == {"env_gateway": 1, "reward": 1, "inference": 1, "trainer": 0, "rollout": 1}, report
    assert final.step >= STEPS_BETWEEN * (len(VICTIMS) + 1)
    # Versions never go backwards: the pointer, the trainer, and each inference process.
    assert run.seen.pointer == sorted(run.seen.pointer) and run.seen.trainer == sorted(run.seen.trainer)
    assert all(v == sorted(v) for v in run.seen.inference.values()), run.seen.inference
    assert len(run.seen.inference) == 2  # the first replica and its replacement were both seen serving
    # The books: trained exactly once, dropped with a counted reason, or still queued in Redis.
    assert books["undecodable"] == 0 and books["dead_letters"] == 0
    assert books["trained_more_than_once"] == [] and books["trained_not_produced"] == []
    assert books["trained_not_finished"] == 0
    assert books["trained"] == final.trajectories_consumed
    assert books["dropped"] == final.trajectories_dropped
    assert books["trained"] + books["dropped"] + books["queued"] == books["entries"]
