"""Connecting to Redis so that a Redis restart is survived, and small reply helpers."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any, ParamSpec, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff

from arlo.config import RedisConfig

P = ParamSpec("P")
R = TypeVar("R")

# With the backoff capped at reconnect_max_s (default 5 s) this rides out roughly 30 s of
# outage (0.1+0.2+...+3.2 then the cap) before a call gives up: long enough for a Redis pod
# restart, short enough that a dead Redis surfaces as an error rather than a hang.
RETRIES = 12
BACKOFF_BASE_S = 0.05
# A pooled connection idle this long is PINGed before use, so one broken by a restart is
# replaced up front instead of failing the first command.
HEALTH_CHECK_INTERVAL_S = 15


async def connect(cfg: RedisConfig, *, retries: int = RETRIES) -> aioredis.Redis:
    """A client that retries ConnectionError/TimeoutError with capped exponential backoff.

    Responses stay bytes (trajectories are protobuf bytes). The first PING is awaited so a
    wrong URL fails here, after the retries, not at the first real call. `retries=0`: a look
    from outside (`arlo status`) that says at once that Redis is down instead of riding it out.
    """
    client: aioredis.Redis = aioredis.from_url(
        cfg.url,
        socket_timeout=cfg.socket_timeout_s,
        socket_connect_timeout=cfg.socket_timeout_s,
        health_check_interval=HEALTH_CHECK_INTERVAL_S,
        retry=Retry(ExponentialBackoff(cap=cfg.reconnect_max_s, base=BACKOFF_BASE_S), retries),
    )
    try:
        await client.ping()
        reraise_lost_cancel()
    except BaseException:
        await client.aclose()
        raise
    return client


def socket_timeout_s(redis: aioredis.Redis) -> float | None:
    """The client's socket timeout (None: reads never time out)."""
    value = redis.connection_pool.connection_kwargs.get("socket_timeout")
    return None if value is None else float(value)


def decodes_responses(redis: aioredis.Redis) -> bool:
    return bool(redis.connection_pool.connection_kwargs.get("decode_responses", False))


def text(value: Any) -> str:
    """A reply value as str, whether the client decodes responses or not."""
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace")
    return str(value)


def reraise_lost_cancel() -> None:
    """Raises CancelledError if this task was cancelled but the cancellation got swallowed.

    On Python 3.11, asyncio.wait_for returns the result instead of raising when the task is
    cancelled just as the awaited operation completes, and redis-py sends every command
    through wait_for: measured here, one cancel in five of a task looping on SET was lost
    and the loop ran on forever. The task still counts the request (`cancelling()`), so it
    can be honoured after the call.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def cancel_safe(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
    """Makes an async function honour a cancellation redis-py swallowed (see reraise_lost_cancel)."""

    @functools.wraps(fn)
    async def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        result = await fn(*args, **kwargs)
        reraise_lost_cancel()
        return result

    return wrapper
