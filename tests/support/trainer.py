"""A real trainer service (gRPC server and training loop) in the test's process, over a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from arlo.background import TaskGroup
from arlo.config import RunConfig, load_config
from arlo.coord import connect, delete_run
from services.trainer.__main__ import start_trainer
from services.trainer.loop import TrainingLoop


def trainer_config(redis_url: str, run_id: str, *, trainer: dict[str, Any] | None = None,
                   rollout: dict[str, Any] | None = None) -> RunConfig:
    """A trainer on free ports, auth off, stepping on every group (`trainer`, `rollout`: more settings)."""
    return load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url}, "auth": {"disabled": True},
        "trainer": {"server": {"port": 0, "metrics_port": -1, "grace_s": 0.2}, "groups_per_step": 1,
                    "read_block_ms": 50, **(trainer or {})},
        "rollout": rollout or {}})


@asynccontextmanager
async def trainer_service(cfg: RunConfig) -> AsyncIterator[tuple[Any, TrainingLoop, Any]]:
    """(the running server, its loop, a Redis client); stopped and the run's keys deleted after."""
    redis = await connect(cfg.redis)
    tasks = TaskGroup()
    running, loop = await start_trainer(cfg, tasks)
    try:
        yield running, loop, redis
    finally:
        await tasks.cancel_all()
        await loop.close()
        await running.stop(0.1)
        await delete_run(redis, cfg.run_id)
        await redis.aclose()
