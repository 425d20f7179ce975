"""A real trainer service (gRPC server and training loop) in the test's process, over a real Redis."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from arlo.background import TaskGroup
from arlo.config import RunConfig
from arlo.coord import connect, delete_run
from services.trainer.__main__ import start_trainer
from services.trainer.loop import TrainingLoop


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
