"""Resets started before admission, so an episode's Reset is off the step's critical path.

A group waits at the admission gate for the version it may be generated with; in synchronous
mode every group of the next batch waits there while the trainer trains, then all start at once
and their Resets queue at the env gateway: the last episode's Reset took 30 ms of a 131 ms step
at issue 17's 76k workload, 33 ms of 295 ms at 596k (bench/step_anatomy.py). A Reset needs no
weights, so the worker starts its group's Resets before the gate (`PrefetchedEnv`); the episode's
own `reset` then finds its session ready.

A prefetched session is used once, by the first `reset` with the same arguments (an episode's
retry resets afresh), and only while younger than `MAX_AGE_S` (well inside the gateway's
session idle timeout, 600 s by default: a long wait at the gate would otherwise hand the
episode a session the gateway has reaped). One never used is closed (`release`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.rollout.agent import EnvClient
from services.rollout.types import ResetResult, StepResult

log = logging.getLogger(__name__)

MAX_AGE_S = 60.0


class PrefetchedEnv:
    """An EnvClient whose first `reset(env_name, config_json, seed)` is one started at construction."""

    def __init__(self, env: EnvClient, env_name: str, config_json: str, seed: int) -> None:
        self.env = env
        self._key = (env_name, config_json, seed)
        self._started = time.monotonic()
        self._reset: asyncio.Task[ResetResult] | None = asyncio.create_task(
            env.reset(env_name, config_json, seed), name="prefetched-reset")

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        task, self._reset = self._reset, None
        if task is not None:
            if (env_name, config_json, seed) == self._key and time.monotonic() - self._started <= MAX_AGE_S:
                return await task  # its failure is the episode's Reset failure (retried as one)
            await _close_result(self.env, task)
        return await self.env.reset(env_name, config_json, seed)

    async def step(self, session_id: str, action: str) -> StepResult:
        return await self.env.step(session_id, action)

    async def close(self, session_id: str) -> None:
        await self.env.close(session_id)

    async def release(self) -> None:
        """Closes the prefetched session if no episode took it (the group never ran, or its
        episode did not reset). Best effort, like `close`."""
        task, self._reset = self._reset, None
        if task is not None:
            await _close_result(self.env, task)


async def _close_result(env: EnvClient, task: asyncio.Task[ResetResult]) -> None:
    try:
        result = await task
    except asyncio.CancelledError:
        raise
    except Exception as e:  # it never opened a session: nothing to close
        log.debug("an unused prefetched Reset failed: %s", e)
        return
    with contextlib.suppress(Exception):
        await env.close(result.session_id)
