"""The durable task cursor: group seeds 0, 1, 2, ... from a Redis counter, at least once each.

A dataset environment maps seed s to task order_e[s % n] of epoch e = s // n, so counting seeds
gives every task once per epoch. `next()` hands out a seed and records it as pending (a sorted
set scored by Redis time); `done(seed)` clears it once its group is written. A seed pending
longer than the lease (its worker died mid-group) is handed out again before any new one, so a
restart of any worker neither skips a task nor repeats one beyond at-least-once.
"""

from __future__ import annotations

from redis.asyncio import Redis

from arlo.coord.client import cancel_safe
from arlo.coord.keys import Keys

# Atomic: reclaim the oldest expired seed, else take the next one. Redis's own clock, so
# workers on hosts with skewed clocks agree on what is expired.
_NEXT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1e6
local stale = redis.call('ZRANGEBYSCORE', KEYS[2], '-inf', now - tonumber(ARGV[1]), 'LIMIT', 0, 1)
if #stale > 0 then
  redis.call('ZADD', KEYS[2], now, stale[1])
  return stale[1]
end
local seed = redis.call('INCR', KEYS[1]) - 1
redis.call('ZADD', KEYS[2], now, seed)
return seed
"""


class TaskCursor:
    """Seeds for one rollout.envs entry (`env_key`: its label, or its env name)."""

    def __init__(self, redis: Redis, run_id: str, env_key: str, *, lease_s: float) -> None:
        keys = Keys(run_id)
        self._redis = redis
        self._cursor, self._pending = keys.tasks_cursor(env_key), keys.tasks_pending(env_key)
        self._lease_s = lease_s
        self._script = redis.register_script(_NEXT)

    @cancel_safe
    async def next(self) -> int:
        return int(await self._script(keys=[self._cursor, self._pending], args=[self._lease_s]))

    @cancel_safe
    async def done(self, seed: int) -> None:
        await self._redis.zrem(self._pending, seed)

    async def position(self) -> int:
        """Seeds handed out so far (new ones; re-issued ones are not counted twice)."""
        value = await self._redis.get(self._cursor)
        return int(value or 0)
