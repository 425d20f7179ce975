"""Service heartbeats: each instance keeps a short-lived status hash that `arlo status` lists.

The hash expires `ttl_s` after the last beat, so a crashed instance disappears on its own
instead of being reported alive forever.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from arlo.coord.client import cancel_safe, text
from arlo.coord.keys import Keys

log = logging.getLogger(__name__)

Field = str | int | float


class Heartbeat:
    def __init__(self, redis: Redis, run_id: str, *, service: str, instance: str, ttl_s: float = 15.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self._redis = redis
        self._key = Keys(run_id).status(service, instance)
        self._ttl_ms = max(1, int(ttl_s * 1000))

    @property
    def key(self) -> str:
        return self._key

    @cancel_safe
    async def beat(self, **fields: Field) -> None:
        """Writes `fields` plus "ts" (unix time) and pushes the expiry out by ttl_s."""
        mapping: dict[FieldT, EncodableT] = {name: _encode(value) for name, value in fields.items()}
        mapping["ts"] = repr(time.time())
        # One transaction, so the hash never exists without an expiry.
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._key, mapping=mapping)
        pipe.pexpire(self._key, self._ttl_ms)
        await pipe.execute()

    async def run(self, interval_s: float, fields: Callable[[], Mapping[str, Field]]) -> None:
        """Beats every `interval_s` until cancelled; Redis errors are logged, never fatal."""
        if not 0 < interval_s < self._ttl_ms / 1000:
            raise ValueError(f"interval_s: must be in (0, ttl_s={self._ttl_ms / 1000}), got {interval_s}")
        while True:
            try:
                await self.beat(**fields())
            except (RedisError, OSError) as e:
                log.warning("heartbeat %s failed: %s", self._key, e)
            await asyncio.sleep(interval_s)


def _encode(value: Field) -> str:
    # redis-py rejects bool; a bool is an int here ("1"/"0"), as counters and flags share hashes.
    if isinstance(value, bool):
        return str(int(value))
    if isinstance(value, int | float | str):
        return str(value)
    raise TypeError(f"heartbeat field value must be str, int or float, got {type(value).__name__}")


@cancel_safe
async def read_statuses(redis: Redis, run_id: str) -> list[dict[str, str]]:
    """Every live status hash of a run, each with "service" and "instance" added, sorted by them."""
    keys = Keys(run_id)
    names = [text(k) async for k in redis.scan_iter(match=keys.status_pattern, count=200, _type="HASH")]
    if not names:
        return []
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    hashes = await pipe.execute()
    out: list[dict[str, str]] = []
    for name, raw in zip(names, hashes, strict=True):
        if not raw:
            continue  # expired between SCAN and HGETALL
        # Service names hold no ':' (Keys.status checks), instances may ("host:port").
        service, _, instance = name[len(keys.status_prefix):].partition(":")
        status = {text(k): text(v) for k, v in raw.items()}
        status["service"], status["instance"] = service, instance
        out.append(status)
    out.sort(key=lambda s: (s["service"], s["instance"]))
    return out
