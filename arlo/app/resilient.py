"""Calls that ride out a restart or a hang of the service behind them (the driver's RPCs and Redis).

`arlo train` outlives the services it drives: a trainer killed and restarted by the supervisor,
a trainer or Redis stopped for a minute. No single UNAVAILABLE, DEADLINE_EXCEEDED or Redis
ConnectionError may end the run, so every call retries with capped exponential backoff until
`RetryPolicy.outage_s` has passed since its first failure; only then is the last error raised.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import redis.exceptions

from arlo.config import TlsConfig
from arlo.rpc import make_channel

log = logging.getLogger(__name__)
T = TypeVar("T")

RETRYABLE_CODES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})


@dataclass(frozen=True, kw_only=True, slots=True)
class RetryPolicy:
    outage_s: float = 180.0
    """How long a service may stay unreachable (dead, restarting, hung) before the driver gives up."""
    call_timeout_s: float = 10.0
    """Per attempt: a hung server costs this much before the next attempt."""
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0


def retryable(exc: BaseException) -> bool:
    if isinstance(exc, grpc.aio.AioRpcError):
        return exc.code() in RETRYABLE_CODES
    if isinstance(exc, redis.exceptions.AuthenticationError):  # a ConnectionError in redis-py; never heals
        return False
    return isinstance(exc, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError,
                            asyncio.TimeoutError))


async def retry(fn: Callable[[], Awaitable[T]], *, policy: RetryPolicy, what: str,
                on_failure: Callable[[], Awaitable[None]] | None = None, attempt_timeout_s: float | None = None) -> T:
    """`fn()` until it succeeds, or raises a non-retryable error, or `policy.outage_s` passes.

    `attempt_timeout_s` bounds each attempt from outside (a Redis call on a stopped server, whose
    client retries on its own); gRPC calls carry their own deadline."""
    first_failure: float | None = None
    delay = policy.backoff_s
    while True:
        try:
            if attempt_timeout_s is None:
                return await fn()
            return await asyncio.wait_for(fn(), attempt_timeout_s)
        except Exception as e:  # noqa: BLE001 (filtered right below)
            if not retryable(e):
                raise
            now = time.monotonic()
            first_failure = first_failure if first_failure is not None else now
            if now - first_failure > policy.outage_s:
                log.error("%s: still failing after %.0fs; giving up: %s", what, now - first_failure, e)
                raise
            log.warning("%s failed (%s); retrying in %.1fs", what, _describe(e), delay)
            if on_failure is not None:
                await on_failure()
            await asyncio.sleep(delay)
            delay = min(delay * 2, policy.backoff_max_s)


def _describe(e: BaseException) -> str:
    if isinstance(e, grpc.aio.AioRpcError):
        return f"{e.code().name}: {e.details()}"
    return f"{type(e).__name__}: {e}"


class ResilientStub:
    """A gRPC stub whose unary calls retry under a `RetryPolicy`, on a fresh channel after a
    failure (a channel to a killed server backs off its reconnects for up to 2 minutes).

    `async with ResilientStub(TrainerStub, address, ...) as trainer: await trainer.GetStatus(req)`.
    """

    def __init__(self, stub_cls: type, address: str, *, token: str | None, tls: TlsConfig | None,
                 policy: RetryPolicy) -> None:
        self._stub_cls, self._address, self._token, self._tls = stub_cls, address, token, tls
        self.policy = policy
        self._channel: grpc.aio.Channel | None = None
        self._stub: Any = None

    async def __aenter__(self) -> ResilientStub:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._reset()

    def _current(self) -> Any:
        if self._stub is None:
            self._channel = make_channel(self._address, token=self._token, tls=self._tls)
            self._stub = self._stub_cls(self._channel)
        return self._stub

    async def _reset(self) -> None:
        channel, self._channel, self._stub = self._channel, None, None
        if channel is not None:
            await channel.close()

    def __getattr__(self, method: str) -> Callable[..., Awaitable[Any]]:
        async def call(request: Any, timeout: float | None = None, *, policy: RetryPolicy | None = None) -> Any:
            use = policy or self.policy
            per_call = min(timeout or use.call_timeout_s, use.call_timeout_s * 6)
            return await retry(lambda: getattr(self._current(), method)(request, timeout=per_call), policy=use,
                               what=f"{method} on {self._address}", on_failure=self._reset)

        return call


class ResilientCalls:
    """Wraps an object whose async methods talk to Redis (EvalQueue, WeightPointer): each call retries."""

    def __init__(self, target: Any, policy: RetryPolicy, what: str) -> None:
        self._target, self._policy, self._what = target, policy, what

    def __getattr__(self, name: str) -> Callable[..., Awaitable[Any]]:
        method = getattr(self._target, name)

        async def call(*args: Any, **kwargs: Any) -> Any:
            return await retry(lambda: method(*args, **kwargs), policy=self._policy, what=f"{self._what}.{name}",
                               attempt_timeout_s=self._policy.call_timeout_s * 3)

        return call


DEFAULT_RETRY = RetryPolicy()
