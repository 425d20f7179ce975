"""The gateway core: registry + sessions behind reset/step/close. No gRPC here, so the agent
loop's tests can drive it in-process.

`reset`/`step` run the environment in the caller's thread. The servicer uses `reset_async`/
`step_async`, which run environments marked `blocking` (code execution) in a bounded pool of
worker threads, so one slow program never stalls the event loop; cheap environments stay
inline, where a batch of 64 steps costs little more than one.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from arlo.jsonfields import parse_json_object
from services.env_gateway.envs.base import Environment, ResetResult, StepResult
from services.env_gateway.registry import EnvRegistry, EnvSpec
from services.env_gateway.sessions import Session, SessionBusyError, SessionStore

DEFAULT_BLOCKING_WORKERS = 8


class UnknownEnvError(LookupError):
    pass


class InvalidConfigError(ValueError):
    """config_json is not valid, or the environment rejected it."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Started:
    session_id: str
    result: ResetResult


def parse_config_json(text: str) -> dict[str, Any]:
    try:
        return parse_json_object(text, "config_json")
    except ValueError as e:
        raise InvalidConfigError(str(e)) from e


def _reset_env(env: Environment, seed: int, config: dict[str, Any]) -> ResetResult:
    try:
        return env.reset(seed, config)
    except ValueError as e:
        raise InvalidConfigError(str(e)) from e


class Gateway:
    def __init__(self, registry: EnvRegistry, sessions: SessionStore, *,
                 blocking_workers: int = DEFAULT_BLOCKING_WORKERS) -> None:
        self.registry = registry
        self.sessions = sessions
        self._blocking_workers = blocking_workers
        self._executor: ThreadPoolExecutor | None = None

    def _spec(self, env_name: str) -> EnvSpec:
        spec = self.registry.get(env_name)
        if spec is None:
            raise UnknownEnvError(f"unknown environment {env_name!r}; known: {self.registry.names()}")
        return spec

    def reset(self, env_name: str, config_json: str, seed: int) -> Started:
        spec = self._spec(env_name)
        if spec.asynchronous:
            raise TypeError(f"environment {env_name!r} is asynchronous: use reset_async")
        env = self.registry.create(spec)
        result = _reset_env(env, seed, parse_config_json(config_json))
        session = self.sessions.create(env_name, env, blocking=spec.blocking)
        return Started(session_id=session.id, result=result)

    def step(self, session_id: str, action: str) -> StepResult:
        """Raises SessionNotFoundError, EpisodeOverError, or whatever the environment raises."""
        session = self.sessions.get(session_id)
        if session.asynchronous:
            raise TypeError(f"session {session_id!r} is of an asynchronous environment: use step_async")
        return session.env.step(action)

    def close(self, session_id: str) -> bool:
        return self.sessions.close(session_id)

    async def reset_async(self, env_name: str, config_json: str, seed: int,
                          deadline_s: float | None = None) -> Started:
        """`deadline_s`: what is left of the caller's deadline (asynchronous environments heed it)."""
        spec = self._spec(env_name)
        if spec.asynchronous:
            config = parse_config_json(config_json)
            env: Any = self.registry.create(spec)
            try:
                result = await env.reset(seed, config, deadline_s)
            except ValueError as e:
                raise InvalidConfigError(str(e)) from e
            session = self.sessions.create(env_name, env, asynchronous=True)
            return Started(session_id=session.id, result=result)
        if not spec.blocking:
            return self.reset(env_name, config_json, seed)
        config = parse_config_json(config_json)

        def start() -> tuple[Environment, ResetResult]:
            env = self.registry.create(spec)  # may build a shared object (a sandbox) on first use
            return env, _reset_env(env, seed, config)

        env, result = await asyncio.wrap_future(self._pool().submit(start))
        session = self.sessions.create(env_name, env, blocking=True)
        return Started(session_id=session.id, result=result)

    async def step_async(self, session_id: str, action: str, deadline_s: float | None = None) -> StepResult:
        result = self.begin_step(session_id, action, deadline_s)
        return result if isinstance(result, StepResult) else await result

    def begin_step(self, session_id: str, action: str,
                   deadline_s: float | None = None) -> StepResult | asyncio.Future[StepResult]:
        """The result of a cheap step, or a future for a blocking one (already running in a worker)
        or an asynchronous one (a task on this loop, given `deadline_s`).

        StepBatch uses this to run a batch's cheap steps inline and the others concurrently.
        """
        session = self.sessions.get(session_id)
        if session.asynchronous:
            return self._start_async_step(session, action, deadline_s)
        if not session.blocking:
            return session.env.step(action)
        return asyncio.wrap_future(self._submit_step(session, action))

    @staticmethod
    def _start_async_step(session: Session, action: str, deadline_s: float | None) -> asyncio.Future[StepResult]:
        if session.busy:
            raise SessionBusyError(f"session {session.id!r} is still running its previous step; "
                                   "send one step at a time per session")
        session.busy = True
        env: Any = session.env
        task: asyncio.Future[StepResult] = asyncio.ensure_future(env.step(action, deadline_s))
        task.add_done_callback(lambda _: setattr(session, "busy", False))
        return task

    def _submit_step(self, session: Session, action: str) -> Future[StepResult]:
        if session.busy:
            raise SessionBusyError(f"session {session.id!r} is still running its previous step; "
                                   "send one step at a time per session")
        session.busy = True
        future = self._pool().submit(session.env.step, action)
        # Cleared when the step really ends (or is cancelled before it starts), not when the
        # caller stops waiting: an abandoned step may still be running in its thread.
        future.add_done_callback(lambda _: setattr(session, "busy", False))
        return future

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self._blocking_workers, thread_name_prefix="env-step")
        return self._executor

    def shutdown(self) -> None:
        """Stops the worker threads once their steps finish; queued steps are cancelled."""
        if self._executor is not None:
            self._executor.shutdown(wait=False, cancel_futures=True)
            self._executor = None
