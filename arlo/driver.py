"""Driving a training run against running services, and reading a run's status.

The CLI's async core: it talks to services only through their gRPC contracts and to Redis
only through arlo.coord, so it works the same against local processes and a cluster.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from arlo.config import RunConfig, TlsConfig
from arlo.coord import TrajectoryStream, WeightPointer, connect
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel
from arlo.supervisor import is_serving

ProgressFn = Callable[[int, int | None, dict[str, float]], None]


@dataclass
class TrainReport:
    steps: int = 0
    trainer_version: int = 0
    pointer_version: int = 0
    inference_versions: dict[str, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out["reward_start"] = self.rewards[0] if self.rewards else None
        out["reward_end"] = self.rewards[-1] if self.rewards else None
        return out


class Stalled(RuntimeError):
    """The trainer took no step for too long; the services' logs say why."""


class NotRunning(RuntimeError):
    """A service the command needs does not answer health checks."""


def require_serving(cfg: RunConfig, names: tuple[str, ...]) -> None:
    down = [f"{n} ({getattr(cfg, n).server.address})" for n in names if not is_serving(getattr(cfg, n).server.address)]
    if down:
        raise NotRunning(f"not serving: {', '.join(down)}. Start the services with `arlo up` "
                         f"(or point -c at the config they run with).")


async def run_training(cfg: RunConfig, token: str | None, *, steps: int | None, on_progress: ProgressFn,
                       check_children: Callable[[], object] = lambda: None, poll_s: float = 0.2,
                       stall_s: float = 300.0) -> TrainReport:
    """Resumes the trainer, waits for `steps` more optimizer steps (forever when None), then pauses it."""
    started = time.monotonic()
    report = TrainReport()
    async with make_channel(cfg.trainer.server.address, token=token, tls=cfg.auth.tls) as channel:
        trainer = trainer_pb2_grpc.TrainerStub(channel)
        status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        first_step = last_step = status.step
        await trainer.Resume(trainer_pb2.ResumeRequest(), timeout=10)
        last_progress = time.monotonic()
        try:
            while steps is None or last_step - first_step < steps:
                check_children()
                await asyncio.sleep(poll_s)
                status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
                if time.monotonic() - last_progress > stall_s:
                    raise Stalled(f"no trainer step for {stall_s:.0f}s ({status.trajectories_dropped} trajectories "
                                  f"dropped so far); the service logs say why")
                if status.step != last_step:
                    last_progress = time.monotonic()
                    last_step = status.step
                    report.rewards.append(status.last_reward)
                    on_progress(last_step - first_step, steps, {"loss": status.last_loss, "reward": status.last_reward,
                                                                "version": float(status.version)})
        finally:
            await trainer.Pause(trainer_pb2.PauseRequest(), timeout=60)
        status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)  # final, after the pause
        last_step = status.step
        report.steps = last_step - first_step
        report.trainer_version = status.version
    report.pointer_version, report.inference_versions = await wait_fleet_on_pointer(cfg, token)
    report.wall_s = time.monotonic() - started
    return report


async def wait_fleet_on_pointer(cfg: RunConfig, token: str | None, timeout_s: float = 60.0) -> tuple[int, dict[str, int]]:
    """Waits until every inference replica serves the pointer's version; returns what each serves."""
    redis = await connect(cfg.redis)
    try:
        pointer = await WeightPointer(redis, cfg.run_id).get()
    finally:
        await redis.aclose()
    target = pointer.version if pointer else 0
    deadline = time.monotonic() + timeout_s
    while True:
        versions = await inference_versions(cfg, token)
        if all(v >= target for v in versions.values()) or time.monotonic() > deadline:
            return target, versions
        await asyncio.sleep(0.2)


async def inference_versions(cfg: RunConfig, token: str | None) -> dict[str, int]:
    address = cfg.inference.server.address
    async with make_channel(address, token=token, tls=cfg.auth.tls) as channel:
        info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
            inference_pb2.GetModelInfoRequest(), timeout=5)
    return {address: info.policy_version}


async def collect_status(cfg: RunConfig, token: str | None) -> dict[str, Any]:
    """What `arlo status` shows: per-service health and version, trainer version, queue depth."""
    from arlo.local import SERVICE_SECTIONS

    services = []
    trainer_version = None
    for name in SERVICE_SECTIONS:
        address = getattr(cfg, name).server.address
        healthy = await asyncio.to_thread(is_serving, address, 1.0)
        version = None
        if healthy and name in ("inference", "trainer"):
            version = await _served_version(name, address, token, cfg.auth.tls)
            if name == "trainer":
                trainer_version = version
        services.append({"name": name, "address": address, "healthy": healthy, "weight_version": version})
    redis = await connect(cfg.redis)
    try:
        pointer = await WeightPointer(redis, cfg.run_id).get()
        queue_depth = await TrajectoryStream(redis, cfg.run_id, consumer="status").backlog()
    finally:
        await redis.aclose()
    return {"run_id": cfg.run_id, "services": services,
            "trainer_version": trainer_version if trainer_version is not None else (pointer.version if pointer else 0),
            "pointer_version": pointer.version if pointer else 0, "queue_depth": queue_depth}


async def _served_version(name: str, address: str, token: str | None, tls: TlsConfig) -> int | None:
    try:
        async with make_channel(address, token=token, tls=tls) as channel:
            if name == "inference":
                info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                    inference_pb2.GetModelInfoRequest(), timeout=3)
                return info.policy_version
            status = await trainer_pb2_grpc.TrainerStub(channel).GetStatus(trainer_pb2.GetStatusRequest(), timeout=3)
            return status.version
    except grpc.aio.AioRpcError:
        return None
