"""Service heartbeats: each instance keeps a short-lived status hash that `arlo status` lists.

The hash expires `ttl_s` after the last beat, so a crashed instance disappears on its own
instead of being reported alive forever.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from collections.abc import Callable, Mapping

from redis.asyncio import Redis
from redis.exceptions import RedisError
from redis.typing import EncodableT, FieldT

from arlo.coord.client import cancel_safe, text
from arlo.coord.keys import Keys

log = logging.getLogger(__name__)

Field = str | int | float


def instance_id() -> str:
    """This process among its service's instances (its heartbeat, its admission counters): host
    and pid, so two replicas on one host, or a process and its restart, are never one instance."""
    return f"{socket.gethostname()}-{os.getpid()}"


class Heartbeat:
    def __init__(self, redis: Redis, run_id: str, *, service: str, instance: str, ttl_s: float = 15.0) -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self._redis = redis
        keys = Keys(run_id)
        self._key = keys.status(service, instance)
        self._index = keys.statuses
        self._ttl_ms = max(1, int(ttl_s * 1000))

    @property
    def key(self) -> str:
        return self._key

    @cancel_safe
    async def beat(self, **fields: Field) -> None:
        """Writes `fields` plus "ts" (unix time) and pushes the expiry out by ttl_s."""
        mapping: dict[FieldT, EncodableT] = {name: _encode(value) for name, value in fields.items()}
        mapping["ts"] = repr(time.time())
        # One transaction, so the hash never exists without an expiry nor unlisted.
        pipe = self._redis.pipeline(transaction=True)
        pipe.hset(self._key, mapping=mapping)
        pipe.pexpire(self._key, self._ttl_ms)
        pipe.sadd(self._index, self._key)
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


_UNLIST_GONE_LUA = """
for i = 2, #KEYS do
  if redis.call('EXISTS', KEYS[i]) == 0 then redis.call('SREM', KEYS[1], KEYS[i]) end
end
return 0
"""


@cancel_safe
async def read_statuses(redis: Redis, run_id: str, service: str = "") -> list[dict[str, str]]:
    """Every live status hash of a run (of `service` only, when given), each with "service" and
    "instance" added, sorted by them.

    Two round trips whatever the keyspace holds (the admission gate reads this before a group
    starts): the index of status keys, then the hashes. A key whose hash expired (its instance
    died) leaves the index; a live instance's next beat puts back one removed in a race."""
    if ":" in service:
        raise ValueError(f"service {service!r}: must contain no ':'")
    keys = Keys(run_id)
    names = sorted(text(k) for k in await redis.smembers(keys.statuses))
    if service:  # only its hashes fetched and parsed: the admission gate reads the rollouts' before each check
        prefix = f"{keys.status_prefix}{service}:"
        names = [name for name in names if name.startswith(prefix)]
    if not names:
        return []
    pipe = redis.pipeline(transaction=False)
    for name in names:
        pipe.hgetall(name)
    hashes = await pipe.execute()
    gone = [name for name, raw in zip(names, hashes, strict=True) if not raw]
    if gone:  # only those still gone: one beaten again since the read stays listed
        await redis.eval(_UNLIST_GONE_LUA, 1 + len(gone), keys.statuses, *gone)
    out: list[dict[str, str]] = []
    for name, raw in zip(names, hashes, strict=True):
        if not raw:
            continue  # expired: its instance stopped beating
        # Service names hold no ':' (Keys.status checks), instances may ("host:port").
        service, _, instance = name[len(keys.status_prefix):].partition(":")
        status = {text(k): text(v) for k, v in raw.items()}
        status["service"], status["instance"] = service, instance
        out.append(status)
    out.sort(key=lambda s: (s["service"], s["instance"]))
    return out
