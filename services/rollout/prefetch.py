"""Resets started before admission, so an episode's Reset is off the step's critical path.

A group waits at the admission gate for the version it may be generated with; in synchronous
mode every group of the next batch waits there while the trainer trains, then all start at once
and their Resets queue at the env gateway: the last episode's Reset took 30 ms of a 131 ms step
at issue 17's 76k workload, 33 ms of 295 ms at 596k (bench/step_anatomy.py). A Reset needs no
weights, so the worker starts its group's Resets before the gate (`PrefetchedEnv`); the episode's
own `reset` then finds its session ready.

A prefetched session is used once, by the first `reset` with the same arguments (an episode's
retry resets afresh), and only while younger than `max_age_s` (inside the gateway's session
idle timeout: a long wait at the gate would otherwise hand the episode a session the gateway
has reaped; an older one is closed in the background and the episode resets at once). If the
gateway lost it all the same (a restart while the group waited), the first Step's NOT_FOUND is
retryable: the episode starts again with a fresh Reset instead of masking its group. One never
used is closed (`release`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from services.rollout.agent import EnvClient
from services.rollout.types import BackendError, ResetResult, RetryableError, StepResult

log = logging.getLogger(__name__)

MAX_AGE_S = 60.0


class PrefetchedEnv:
    """An EnvClient whose first `reset(env_name, config_json, seed)` is one started at construction."""

    def __init__(self, env: EnvClient, env_name: str, config_json: str, seed: int, *,
                 max_age_s: float = MAX_AGE_S) -> None:
        self.env = env
        self._key = (env_name, config_json, seed)
        self._deadline = time.monotonic() + max_age_s
        self._reset: asyncio.Task[ResetResult] | None = asyncio.create_task(
            env.reset(env_name, config_json, seed), name="prefetched-reset")
        self._closing: asyncio.Task[None] | None = None
        self._unstepped = ""  # the prefetched session, until its first Step

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        task, self._reset = self._reset, None
        if task is not None:
            if (env_name, config_json, seed) == self._key and time.monotonic() <= self._deadline:
                result = await task  # its failure is the episode's Reset failure (retried as one)
                self._unstepped = result.session_id
                return result
            self._closing = asyncio.create_task(_close_result(self.env, task), name="prefetched-close")
        return await self.env.reset(env_name, config_json, seed)

    async def step(self, session_id: str, action: str) -> StepResult:
        prefetched, self._unstepped = session_id == self._unstepped, ""
        try:
            return await self.env.step(session_id, action)
        except BackendError as e:
            if prefetched and e.code == "NOT_FOUND" and not isinstance(e, RetryableError):
                raise RetryableError(e.service, e.code, f"the prefetched session is gone: {e.message}") from e
            raise

    async def close(self, session_id: str) -> None:
        await self.env.close(session_id)

    async def release(self) -> None:
        """Closes the prefetched session if no episode took it (the group never ran, or its
        episode did not reset). Best effort, like `close`."""
        task, self._reset = self._reset, None
        if task is not None:
            await _close_result(self.env, task)
        if self._closing is not None:
            await self._closing


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
