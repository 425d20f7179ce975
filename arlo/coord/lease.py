"""One trainer per run: a lease in Redis, renewed while the trainer lives, and a fence on its writes.

A second trainer with the same run id (and checkpoint directory) used to be accepted: both read
as one consumer, trained the same trajectories into two lineages, wrote one checkpoint directory,
and the run stalled (issue 33, item 9). Now a trainer takes `arlo:{run}:trainer:lease` before it
restores anything:

- The key holds a random token, the holder (`host:pid`) and a renewal count, and expires after
  `ttl_s` unless renewed (every third of it). A starter that finds it held watches the count:
  a holder that renews is alive, and the starter is refused (`LeaseHeld`, within about a third
  of the ttl); a lease that expires is taken. A holder on this host whose pid is gone (kill -9,
  then the supervisor's restart) is taken over at once, not after the ttl.
- The fence: every acquisition also writes its token to `arlo:{run}:trainer:holder`, which
  never expires. The pointer's publish and checkpoint record, the stream's acknowledgement and
  its `seen:` markers run in Lua that refuses the write (`LeaseLost`) unless that key holds the
  writer's token. A trainer paused past its ttl (SIGSTOP, a long GC, a partition) that wakes after
  a successor took the run, even one that has stopped since, can therefore move nothing; its
  renewal finds the loss too, and it stops.
- Files, which no script can fence (a checkpoint, a version in shared weight storage), are
  written only after a check of the holder key; a checkpoint written all the same (taken over
  mid-write) has its record refused, and is then moved to `set-aside/` unless the successor
  recorded that very version (services/trainer/saves.py).
A lease that expired with no successor (a Redis outage longer than the ttl) is taken back by its
holder's next renewal, since the holder key still names it; its writes meanwhile are allowed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

from arlo.background import MustRestart
from arlo.coord.client import cancel_safe, text
from arlo.coord.keys import Keys
from arlo.process_namespace import pid_gone, process_namespace

log = logging.getLogger(__name__)

FENCE_LUA = """
local holder = redis.call('GET', KEYS[1])
if ARGV[1] ~= '' and holder and holder ~= ARGV[1] then return -1 end
"""
"""Prepended to a fenced script: KEYS[1] is the holder key, ARGV[1] the writer's token ('' =
unfenced); the script's own keys and arguments start at index 2. Returns -1 when the run was
acquired by another token since (a key nobody has acquired lets every write through)."""

_ACQUIRE_LUA = """
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] and holder ~= ARGV[4] then
  return {0, redis.call('HGET', KEYS[1], 'owner') or '', redis.call('HGET', KEYS[1], 'renewals') or '0',
          redis.call('HGET', KEYS[1], 'ns') or ''}
end
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token', ARGV[1], 'owner', ARGV[2], 'renewals', 0, 'since', ARGV[5], 'ns', ARGV[6])
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('SET', KEYS[2], ARGV[1])
return {1, ARGV[2], '0', ARGV[6]}
"""
"""Takes the lease when free, already ours, or held by ARGV[4] (a dead holder's token being taken
over); the holder key (KEYS[2]) then names the new token, for good."""

_RENEW_LUA = """
local holder = redis.call('HGET', KEYS[1], 'token')
if holder and holder ~= ARGV[1] then return 0 end
if not holder then
  if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'owner', ARGV[2], 'renewals', 0, 'since', ARGV[4], 'ns', ARGV[5])
else
  redis.call('HINCRBY', KEYS[1], 'renewals', 1)
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
return 1
"""
"""Extends our lease; one that expired is ours again only if nobody acquired the run since."""

_RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class LeaseHeld(RuntimeError):
    """Another live trainer holds the run: this one must not start."""


class LeaseLost(MustRestart):
    """Another trainer took the run while this one could not renew: this process stops."""


@dataclass(frozen=True, slots=True)
class Fence:
    """What a fenced write sends: the lease key and the writer's token."""

    key: str
    token: str

    def keys(self, *keys: str) -> list[str]:
        return [self.key, *keys]

    def args(self, *args: str) -> list[str]:
        return [self.token, *args]


UNFENCED_TOKEN = ""


def fenced_result(result: object, what: str, fence: Fence | None) -> object:
    """A fenced script's result, or LeaseLost when the fence refused the write."""
    if isinstance(result, int) and result == -1 and fence is not None:
        raise LeaseLost(f"{what} refused: another trainer holds {fence.key} (this one was paused or cut off "
                        "past its lease); stopping so that one lineage trains the run")
    return result


class TrainerLease:
    def __init__(self, redis: Redis, run_id: str, *, ttl_s: float = 10.0, owner: str = "") -> None:
        if ttl_s <= 0:
            raise ValueError(f"ttl_s: must be > 0, got {ttl_s}")
        self._redis = redis
        keys = Keys(run_id)
        self.key, self.holder_key = keys.trainer_lease, keys.trainer_holder
        self.ttl_s = ttl_s
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.namespace = process_namespace()
        self.token = uuid.uuid4().hex
        self.fence = Fence(self.holder_key, self.token)
        self._acquire = redis.register_script(_ACQUIRE_LUA)
        self._renew = redis.register_script(_RENEW_LUA)
        self._release = redis.register_script(_RELEASE_LUA)

    @property
    def renew_every_s(self) -> float:
        return self.ttl_s / 3

    @cancel_safe
    async def acquire(self) -> None:
        """Takes the lease, waiting at most one ttl (and a renewal) to see whether its holder lives."""
        deadline = time.monotonic() + self.ttl_s + self.renew_every_s
        first_seen: tuple[str, str] | None = None
        dead_token, dead_owner = "", ""
        while True:
            taken, owner, renewals, namespace = await self._acquire(
                keys=[self.key, self.holder_key],
                args=[self.token, self.owner, str(round(self.ttl_s * 1000)), dead_token, repr(time.time()),
                      self.namespace])
            owner, renewals, namespace = text(owner), text(renewals), text(namespace)
            if int(taken):
                if dead_token:
                    log.warning("took over the trainer lease of %s (a process of this host and pid namespace "
                                "that is gone)", dead_owner)
                return
            if self.namespace and namespace == self.namespace and _gone_from_this_host(owner):
                dead_token, dead_owner = text(await self._redis.hget(self.key, "token") or b""), owner
                continue
            if first_seen is not None and (owner != first_seen[0] or renewals != first_seen[1]):
                raise LeaseHeld(self._held_message(owner, "it renews its lease"))
            first_seen = first_seen or (owner, renewals)
            if time.monotonic() > deadline:
                raise LeaseHeld(self._held_message(owner, f"its lease has not expired in {self.ttl_s:.0f}s"))
            await asyncio.sleep(min(self.renew_every_s / 2, max(deadline - time.monotonic(), 0.01)))

    def _held_message(self, owner: str, why: str) -> str:
        return (f"another trainer ({owner}) is training this run ({why}); a second trainer with the same run_id "
                f"is refused. Stop it first, or give this one another run_id (lease {self.key})")

    @cancel_safe
    async def renew(self) -> None:
        """Raises LeaseLost when another trainer holds the lease now."""
        ok = await self._renew(keys=[self.key, self.holder_key],
                               args=[self.token, self.owner, str(round(self.ttl_s * 1000)), repr(time.time()),
                                     self.namespace])
        if not int(ok):
            holder = text(await self._redis.hget(self.key, "owner") or b"?")
            raise LeaseLost(f"the trainer lease {self.key} is held by {holder} now (this trainer could not "
                            f"renew it within {self.ttl_s:.0f}s); stopping so that one lineage trains the run")

    async def keep_renewed(self) -> None:
        """The renewal loop (a background task; LeaseLost stops the process). A Redis error is
        retried at a tenth of the ttl, not with a growing backoff: a few errors over a long run
        must not leave the lease to lapse."""
        while True:
            try:
                await self.renew()
            except (RedisError, OSError) as e:
                log.warning("could not renew the trainer lease (%s); retrying", e)
                await asyncio.sleep(self.ttl_s / 10)
                continue
            await asyncio.sleep(self.renew_every_s)

    @cancel_safe
    async def release(self) -> None:
        """Gives the lease back (a clean stop), so the next trainer starts at once."""
        await self._release(keys=[self.key], args=[self.token])  # the holder key keeps naming us: fenced as before


async def lease_holder(redis: Redis, run_id: str) -> str:
    """Who holds the run's trainer lease ("host:pid", "" when nobody does): `arlo status` shows it."""
    return text(await redis.hget(Keys(run_id).trainer_lease, "owner") or b"")


def _gone_from_this_host(owner: str) -> bool:
    """Whether `owner` ("host:pid", of this boot and pid namespace) names a process that no longer exists."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit() or int(pid) == os.getpid():
        return False
    return pid_gone(int(pid))
