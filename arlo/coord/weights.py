"""The weight-version pointer: which policy version is newest, where to pull it, its checksum.

The pointer only moves forward (a Lua compare-and-set), so a late or restarted trainer can
never make inference step back to older weights. Each move is announced on a pub/sub
channel; watchers also poll, because pub/sub drops messages while a subscriber is
disconnected.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, get_args

from redis.asyncio import Redis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from arlo.coord.client import cancel_safe, text
from arlo.coord.keys import Keys
from arlo.coord.lease import FENCE_LUA, UNFENCED_TOKEN, Fence, fenced_result
from arlo.model.weight_delta import PayloadKind
from arlo.proto.v1 import common_pb2

log = logging.getLogger(__name__)

# Versions are compared as Lua numbers (doubles): exact up to 2^53, far beyond any run.
# Both run behind the trainer lease's fence (arlo/coord/lease.py): KEYS[1]/ARGV[1] are the fence's.
_PUBLISH_LUA = FENCE_LUA + """
local cur = redis.call('HGET', KEYS[2], 'version')
if cur and tonumber(cur) >= tonumber(ARGV[2]) then return 0 end
redis.call('HSET', KEYS[2], 'version', ARGV[2], 'source', ARGV[3], 'sha256', ARGV[4], 'time', ARGV[5],
           'payload', ARGV[7], 'base_version', ARGV[8], 'full_version', ARGV[9], 'storage', ARGV[10],
           'scope', ARGV[11])
redis.call('PUBLISH', ARGV[6], ARGV[2])
return 1
"""

# The recorder's token (the fence's, ARGV[1]) is kept with the record; recording the version already
# recorded (a restarted trainer adopting the checkpoint it restored) changes only that.
_CHECKPOINT_LUA = FENCE_LUA + """
local cur = redis.call('HGET', KEYS[2], 'checkpoint_version')
if cur and tonumber(cur) > tonumber(ARGV[2]) then return 0 end
if cur and tonumber(cur) == tonumber(ARGV[2]) then
  redis.call('HSET', KEYS[2], 'checkpoint_writer', ARGV[1])
  return 0
end
redis.call('HSET', KEYS[2], 'checkpoint_version', ARGV[2], 'checkpoint_uri', ARGV[3], 'checkpoint_writer', ARGV[1])
return 1
"""

@dataclass(frozen=True, kw_only=True, slots=True)
class WeightPointerState:
    version: int
    """0 until the first publish (the hash may hold only a checkpoint)."""
    source: str
    sha256: str
    checkpoint_version: int
    checkpoint_uri: str
    time: float
    payload: PayloadKind = "full"
    """How `version` was published: "full", or "delta" (the elements changed since base_version)."""
    base_version: int = 0
    """The version a delta applies onto; 0 for a full payload."""
    full_version: int = 0
    """The newest version at or before `version` published full (0: `version` itself): a replica
    holding an older version starts there and applies the deltas after it in order."""
    storage: str = ""
    """Where each version is written once (`file:///dir`); empty: pulled from `source`."""
    scope: WeightScope = "model"
    """What the payload holds: the whole policy, or a LoRA run's "adapters" alone (the reader
    applies them onto the base it holds)."""
    checkpoint_writer: str = ""
    """The lease token of the trainer that recorded `checkpoint_version` (empty: recorded unfenced,
    or before writers were recorded); see services/trainer/core/lineage.py. Not in the contract."""

    @property
    def chain_start(self) -> int:
        """The full version a replica with nothing newer starts from."""
        return self.version if self.payload == "full" else (self.full_version or self.version)

    def to_proto(self) -> common_pb2.WeightVersion:
        return common_pb2.WeightVersion(
            version=self.version, source=self.source, sha256=self.sha256,
            checkpoint_version=self.checkpoint_version, checkpoint_uri=self.checkpoint_uri, time=self.time,
            payload=_PAYLOAD_PROTO[self.payload], base_version=self.base_version, full_version=self.full_version,
            storage=self.storage, scope=self.scope)

    @classmethod
    def from_proto(cls, msg: common_pb2.WeightVersion) -> WeightPointerState:
        return cls(version=msg.version, source=msg.source, sha256=msg.sha256,
                   checkpoint_version=msg.checkpoint_version, checkpoint_uri=msg.checkpoint_uri, time=msg.time,
                   payload=_PAYLOAD_KIND[msg.payload], base_version=msg.base_version,
                   full_version=msg.full_version, storage=msg.storage, scope=_scope(msg.scope))

    @classmethod
    def from_hash(cls, raw: Mapping[Any, Any]) -> WeightPointerState:
        h = {text(k): text(v) for k, v in raw.items()}
        payload = h.get("payload") or "full"
        if payload not in _PAYLOAD_PROTO:
            raise ValueError(f"payload {payload!r} is not one of {sorted(_PAYLOAD_PROTO)}")
        return cls(version=int(h.get("version") or 0), source=h.get("source", ""), sha256=h.get("sha256", ""),
                   checkpoint_version=int(h.get("checkpoint_version") or 0),
                   checkpoint_uri=h.get("checkpoint_uri", ""), time=float(h.get("time") or 0.0),
                   payload=payload, base_version=int(h.get("base_version") or 0),  # type: ignore[arg-type]
                   full_version=int(h.get("full_version") or 0), storage=h.get("storage", ""),
                   scope=_scope(h.get("scope", "")), checkpoint_writer=h.get("checkpoint_writer", ""))


WeightScope = Literal["model", "adapters"]
SCOPES: tuple[WeightScope, ...] = get_args(WeightScope)


def _scope(raw: str) -> WeightScope:
    if not raw:
        return "model"  # written before scopes existed: the whole policy
    if raw not in SCOPES:
        raise ValueError(f"scope {raw!r} is not one of {list(SCOPES)}")
    return raw  # type: ignore[return-value]


_PAYLOAD_PROTO: dict[str, int] = {"full": common_pb2.WEIGHT_PAYLOAD_FULL, "delta": common_pb2.WEIGHT_PAYLOAD_DELTA}
_PAYLOAD_KIND: dict[int, PayloadKind] = {v: k for k, v in _PAYLOAD_PROTO.items()}  # type: ignore[misc]
_PAYLOAD_KIND[common_pb2.WEIGHT_PAYLOAD_UNSPECIFIED] = "full"  # unset: a version from before payload kinds


class WeightPointer:
    def __init__(self, redis: Redis, run_id: str, *, fence: Fence | None = None) -> None:
        """`fence`: the trainer's lease; its publishes and checkpoint records are refused
        (LeaseLost) while another trainer holds the run."""
        self._redis = redis
        self._keys = Keys(run_id)
        self._fence = fence or Fence(self._keys.trainer_holder, UNFENCED_TOKEN)
        # register_script re-sends the script after NOSCRIPT (a restarted or flushed Redis).
        self._publish = redis.register_script(_PUBLISH_LUA)
        self._checkpoint = redis.register_script(_CHECKPOINT_LUA)

    @cancel_safe
    async def publish(self, version: int, *, source: str, sha256: str, payload: PayloadKind = "full",
                      base_version: int = 0, full_version: int = 0, storage: str = "",
                      scope: WeightScope = "model") -> bool:
        """Moves the pointer to `version` if it is newer; True when moved, False when stale.
        `payload` and the rest: how the version was published (WeightPointerState)."""
        if version < 1:
            raise ValueError(f"version: must be >= 1, got {version}")
        if payload not in _PAYLOAD_PROTO:
            raise ValueError(f"payload: must be one of {sorted(_PAYLOAD_PROTO)}, got {payload!r}")
        if scope not in SCOPES:
            raise ValueError(f"scope: must be one of {list(SCOPES)}, got {scope!r}")
        if payload == "delta" and not 0 < full_version <= base_version < version:
            raise ValueError(f"a delta needs 0 < full_version <= base_version < version, got {full_version}, "
                             f"{base_version}, {version}")
        moved = await self._publish(
            keys=self._fence.keys(self._keys.weights),
            args=self._fence.args(str(version), source, sha256, repr(time.time()), self._keys.weights_events, payload,
                                  str(base_version), str(full_version), storage, scope))
        return bool(fenced_result(moved, f"publishing version {version}", self._fence) == 1)

    @cancel_safe
    async def announce_served(self, version: int) -> None:
        """An inference replica now serves `version`: admission gates waiting for it re-check."""
        await self._redis.publish(self._keys.admission_events, f"served:{version}")

    @cancel_safe
    async def set_checkpoint(self, version: int, uri: str) -> bool:
        """Records a complete checkpoint if it is newer than the recorded one (True), with this
        trainer's token as its recorder; the version already recorded is adopted (False)."""
        if version < 1:
            raise ValueError(f"version: must be >= 1, got {version}")
        done = await self._checkpoint(keys=self._fence.keys(self._keys.weights), args=self._fence.args(str(version), uri))
        return bool(fenced_result(done, f"recording checkpoint {version}", self._fence) == 1)

    @cancel_safe
    async def check_fence(self, what: str) -> None:
        """Raises LeaseLost when another trainer has taken the run: for writes outside Redis (a
        checkpoint, a version in shared weight storage), which no script can fence: checked before
        they start."""
        holder = await self._redis.get(self._fence.key)
        if self._fence.token and holder is not None and text(holder) != self._fence.token:
            fenced_result(-1, what, self._fence)

    @cancel_safe
    async def get(self) -> WeightPointerState | None:
        raw = await self._redis.hgetall(self._keys.weights)
        return WeightPointerState.from_hash(raw) if raw else None

    @cancel_safe
    async def wait_for_newer(self, version: int, timeout_s: float, poll_s: float = 2.0, *,
                             or_older: bool = False) -> WeightPointerState | None:
        """The pointer once its version exceeds `version` (`or_older`: or falls below it, which
        only an out-of-band write does: an operator's repair, a wiped Redis); None after `timeout_s`.

        Wakes on the pub/sub event and re-reads the hash at least every `poll_s` (events
        are lost while disconnected). Redis errors are logged and waited out until the
        deadline; the client's own retries may stretch one call past it.
        """
        if poll_s <= 0:
            raise ValueError(f"poll_s: must be > 0, got {poll_s}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pubsub = self._redis.pubsub(ignore_subscribe_messages=True)
        try:
            # Subscribe before reading, so a publish between the read and the wait still wakes us.
            subscribed = await self._subscribe(pubsub)
            while True:
                state = await self._get_logged()
                if state is not None and (state.version > version or or_older and state.version < version):
                    return state
                remaining = deadline - loop.time()
                if remaining <= 0:
                    return None
                subscribed = await self._wait_event(pubsub, subscribed, min(poll_s, remaining))
        finally:
            await _close(pubsub)

    # -- internals --------------------------------------------------------------------------

    async def _subscribe(self, pubsub: PubSub) -> bool:
        try:
            await pubsub.subscribe(self._keys.weights_events)
            return True
        except (RedisError, OSError) as e:
            log.warning("cannot subscribe to %s (%s); polling only", self._keys.weights_events, e)
            return False

    async def _get_logged(self) -> WeightPointerState | None:
        try:
            return await self.get()
        except (RedisError, OSError) as e:
            log.warning("reading weight pointer failed: %s", e)
            return None
        except ValueError as e:  # a field that is not a number: wait for a good publish, do not crash
            log.warning("weight pointer %s is malformed (%s); ignoring it", self._keys.weights, e)
            return None

    async def _wait_event(self, pubsub: PubSub, subscribed: bool, wait_s: float) -> bool:
        """Waits up to `wait_s` for any event; returns whether the subscription is still usable."""
        if not subscribed:
            await asyncio.sleep(wait_s)
            return await self._subscribe(pubsub)
        try:
            # Any message (or the timeout) just triggers a re-read of the hash, which is
            # the source of truth.
            await pubsub.get_message(timeout=wait_s)
            return True
        except (RedisError, OSError) as e:
            log.warning("weight events: %s; polling", e)
            return False


async def _close(pubsub: PubSub) -> None:
    try:
        await pubsub.aclose()
    except (RedisError, OSError) as e:
        log.debug("closing pubsub: %s", e)
