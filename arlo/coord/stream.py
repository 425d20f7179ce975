"""The trajectory stream: rollout workers XADD, the trainer XREADGROUPs and XACKs after use.

Delivery is at least once: entries are acknowledged only after the step that used them,
a dead consumer's entries are reclaimed with XAUTOCLAIM, and the trainer de-duplicates by
trajectory id. Entries that cannot be decoded are moved to `traj:dead` and acknowledged,
so one bad producer can never wedge the trainer in a redelivery loop.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any

from redis.asyncio import Redis
from redis.exceptions import ResponseError, WatchError

from arlo.config.base import longest_block_ms
from arlo.coord import codec
from arlo.coord.client import cancel_safe, decodes_responses, socket_timeout_s, text
from arlo.coord.keys import Keys
from arlo.coord.lease import FENCE_LUA, UNFENCED_TOKEN, Fence, fenced_result
from arlo.coord.records import count_dropped_stale, settle_in_flight
from arlo.proto.v1 import common_pb2

log = logging.getLogger(__name__)

# The dead-letter stream is for inspection only, so capping it (approximately) loses nothing
# the run needs and keeps a flood of garbage from filling memory.
DEAD_MAXLEN = 10_000

# XACK and the count of acknowledged-but-not-trimmed entries move together, so the backlog
# fallback (XLEN - acked) stays exact.
_ACK_LUA = FENCE_LUA + """
local n = redis.call('XACK', KEYS[2], ARGV[2], unpack(ARGV, 3))
if n > 0 then redis.call('INCRBY', KEYS[3], n) end
return n
"""
"""Behind the trainer lease's fence (arlo/coord/lease.py): KEYS[1]/ARGV[1] are the fence's."""

_MARK_TRAINED_LUA = FENCE_LUA + """
for i = 2, #KEYS do redis.call('SET', KEYS[i], 1, 'EX', ARGV[2]) end
return #KEYS - 1
"""
"""`seen:` markers behind the trainer lease's fence: a trainer that lost the run must not mark as
trained what its successor has not trained (the successor's intake would drop them as repeats)."""

_TRIM_LUA = """
local n = redis.call('XTRIM', KEYS[1], 'MINID', ARGV[1])
if n > 0 then
  local left = redis.call('DECRBY', KEYS[2], n)
  if left < 0 then redis.call('SET', KEYS[2], 0) end
end
return n
"""


class BacklogFull(Exception):
    """The stream already holds `limit` or more unconsumed entries; the producer should back off."""

    def __init__(self, backlog: int, limit: int) -> None:
        super().__init__(f"trajectory backlog {backlog} >= limit {limit}")
        self.backlog = backlog
        self.limit = limit


@dataclass(frozen=True, kw_only=True, slots=True)
class StreamEntry:
    entry_id: str
    trajectory: common_pb2.Trajectory


class TrajectoryStream:
    """One consumer (or producer) of a run's trajectory stream."""

    def __init__(self, redis: Redis, run_id: str, *, consumer: str, group: str = "trainer",
                 max_backlog: int = 4096, fence: Fence | None = None) -> None:
        """`fence`: the trainer's lease; its acknowledgements are refused (LeaseLost) while another
        trainer holds the run."""
        if decodes_responses(redis):
            raise ValueError("TrajectoryStream needs a client with decode_responses=False (payloads are bytes)")
        if not consumer or not group:
            raise ValueError("consumer and group must be non-empty")
        if max_backlog < 1:
            raise ValueError(f"max_backlog: must be >= 1, got {max_backlog}")
        self._redis = redis
        self._keys = Keys(run_id)
        self._fence = fence or Fence(self._keys.trainer_holder, UNFENCED_TOKEN)
        self._consumer = consumer
        self._group = group
        self._max_backlog = max_backlog
        self._ack_script = redis.register_script(_ACK_LUA)
        self._trim_script = redis.register_script(_TRIM_LUA)
        self._mark_script = redis.register_script(_MARK_TRAINED_LUA)
        self.malformed = 0
        """Entries moved to the dead-letter stream by this instance."""
        self.duplicates = 0
        """Entries dropped by filter_unseen (already trained, or repeated in a batch)."""
        self.groups_lost = 0
        """Times the consumer group was found missing (NOGROUP) and recreated: entries were lost."""

    @property
    def keys(self) -> Keys:
        return self._keys

    @property
    def max_backlog(self) -> int:
        return self._max_backlog

    @cancel_safe
    async def ensure_group(self) -> None:
        """Creates the stream and the group reading from the start; a no-op when they exist."""
        try:
            await self._redis.xgroup_create(self._keys.traj, self._group, id="0", mkstream=True)
        except ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    @cancel_safe
    async def count_stale(self, n: int) -> None:
        """Records `n` trajectories dropped as stale, for the rollout's admission budget."""
        await count_dropped_stale(self._redis, self._keys.run_id, n)

    async def settle_in_flight(self, *, arrived: Collection[str], floor: int) -> set[str]:
        """Unmarks the groups the trainer holds whole; the ids still in flight on `floor` (records.py)."""
        return await settle_in_flight(self._redis, self._keys.run_id, arrived=arrived, floor=floor)

    @cancel_safe
    async def length(self) -> int:
        return int(await self._redis.xlen(self._keys.traj))

    @cancel_safe
    async def backlog(self) -> int:
        """Entries the group has not finished with: never delivered (lag) plus delivered, unacked."""
        group = await self._group_info(self._group)
        if group is None:
            return await self.length()  # no consumer yet: everything is unread
        lag = group.get("lag")
        if lag is not None:
            return int(lag) + int(group["pending"])
        # Redis 6.2 has no lag, and 7.x reports None after deletions past the read point.
        pipe = self._redis.pipeline(transaction=False)
        pipe.xlen(self._keys.traj)
        pipe.get(self._keys.traj_acked)
        xlen, acked = await pipe.execute()
        return max(0, int(xlen) - int(acked or 0))

    @cancel_safe
    async def add(self, traj: common_pb2.Trajectory) -> str:
        """Appends a trajectory; raises BacklogFull instead of letting unread data pile up.

        The check is a soft bound: concurrent producers may each pass it, so the stream can
        exceed the limit by at most one entry per producer. MAXLEN is never used, because it
        drops entries nobody has read.
        """
        fields = codec.encode(traj)
        backlog = await self.backlog()
        if backlog >= self._max_backlog:
            raise BacklogFull(backlog, self._max_backlog)
        return text(await self._redis.xadd(self._keys.traj, fields))

    @cancel_safe
    async def add_group(self, trajs: Sequence[common_pb2.Trajectory]) -> list[str]:
        """Appends a whole GRPO group in one MULTI/EXEC; raises BacklogFull like `add`.

        A producer killed mid-write then leaves all of the group or none of it, never a part
        that the trainer could only hold until it gives up on it.
        """
        if not trajs:
            return []
        fields = [codec.encode(t) for t in trajs]
        backlog = await self.backlog()
        if backlog >= self._max_backlog:
            raise BacklogFull(backlog, self._max_backlog)
        pipe = self._redis.pipeline(transaction=True)
        for f in fields:
            pipe.xadd(self._keys.traj, f)
        return [text(entry_id) for entry_id in await pipe.execute()]

    @cancel_safe
    async def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        """Up to `count` new entries for this consumer, waiting at most `block_ms` (0: no wait).

        `block_ms` must stay under the socket timeout, or the client times out first and
        retries the read. Unlike Redis, 0 means "do not block", never "block forever".
        """
        if count < 1:
            raise ValueError(f"count: must be >= 1, got {count}")
        self._check_block(block_ms)
        reply = await self._with_group(lambda: self._redis.xreadgroup(
            self._group, self._consumer, {self._keys.traj: ">"}, count=count, block=block_ms or None))
        return await self._accept(_stream_entries(reply))

    @cancel_safe
    async def read_own_pending(self, count: int, after: str = "0-0") -> tuple[list[StreamEntry], str | None]:
        """This consumer's delivered but unacknowledged entries with ids above `after`.

        A restarted trainer (same consumer name) re-reads them before new ones. Returns the
        entries and the id to continue from, or None once there are no more.
        """
        if count < 1:
            raise ValueError(f"count: must be >= 1, got {count}")
        reply = await self._with_group(lambda: self._redis.xreadgroup(
            self._group, self._consumer, {self._keys.traj: after}, count=count))
        raw = _stream_entries(reply)
        if not raw:
            return [], None
        # An entry deleted while pending comes back without fields; _accept dead-letters and acks it.
        return await self._accept(raw), text(raw[-1][0])

    @cancel_safe
    async def claim_stale(self, min_idle_ms: int, count: int = 100) -> list[StreamEntry]:
        """Takes over up to `count` entries another consumer was given but did not ack in `min_idle_ms`."""
        if count < 1 or min_idle_ms < 0:
            raise ValueError(f"count must be >= 1 and min_idle_ms >= 0, got {count}, {min_idle_ms}")
        claimed: list[tuple[Any, Any]] = []
        cursor = "0-0"
        while len(claimed) < count:
            reply = await self._with_group(lambda c=cursor: self._redis.xautoclaim(
                self._keys.traj, self._group, self._consumer, min_idle_ms,
                start_id=c, count=count - len(claimed)))
            if not reply:
                break
            # 6.2 replies [cursor, entries]; 7.x adds the ids of deleted entries, which
            # Redis has already dropped from the pending list.
            cursor, entries = text(reply[0]), reply[1] or []
            claimed.extend(entries)
            if cursor == "0-0":
                break
        return await self._accept(claimed)

    @cancel_safe
    async def ack(self, entry_ids: Sequence[str]) -> int:
        """Acknowledges entries after the step that used them; acked entries are then trimmed."""
        if not entry_ids:
            return 0
        acked = await self._ack_script(keys=self._fence.keys(self._keys.traj, self._keys.traj_acked),
                                       args=self._fence.args(self._group, *entry_ids))
        n = int(fenced_result(acked, f"acknowledging {len(entry_ids)} entries", self._fence))  # type: ignore[call-overload]
        await self.trim_acked()
        return n

    @cancel_safe
    async def trim_acked(self) -> int:
        """Deletes entries every group has acknowledged, so the stream does not grow forever."""
        groups = await self._groups()
        if not groups:
            return 0
        floors = []
        for group in groups:
            if int(group["pending"]) > 0:
                summary = await self._redis.xpending(self._keys.traj, group["name"])
                floors.append(text(summary["min"]))
            else:
                # Everything up to the last delivered id is acked; keeping that one entry
                # avoids stream-id arithmetic.
                floors.append(text(group["last-delivered-id"]))
        floor = min(floors, key=codec.parse_stream_id)
        if floor == "0-0":
            return 0
        return int(await self._trim_script(keys=[self._keys.traj, self._keys.traj_acked], args=[floor]))

    @cancel_safe
    async def filter_unseen(self, entries: Sequence[StreamEntry]) -> list[StreamEntry]:
        """Drops entries already trained on, and repeats within the batch; the dropped ones are acked.

        Acking them here is safe (their trajectory was or will be trained via the kept entry)
        and keeps them from being reclaimed forever.
        """
        if not entries:
            return []
        pipe = self._redis.pipeline(transaction=False)
        for e in entries:
            pipe.exists(self._keys.seen(e.trajectory.id))
        seen = await pipe.execute()
        keep: list[StreamEntry] = []
        dropped: list[str] = []
        ids_in_batch: set[str] = set()
        for entry, was_seen in zip(entries, seen, strict=True):
            if was_seen or entry.trajectory.id in ids_in_batch:
                dropped.append(entry.entry_id)
            else:
                keep.append(entry)
                ids_in_batch.add(entry.trajectory.id)
        if dropped:
            self.duplicates += len(dropped)
            log.info("dropped %d duplicate trajectory entries", len(dropped))
            await self.ack(dropped)
        return keep

    @cancel_safe
    async def mark_trained(self, traj_ids: Sequence[str], ttl_s: int = 7 * 24 * 3600) -> None:
        """Records trajectories as trained. Call before ack: a crash in between then costs nothing."""
        if not traj_ids:
            return
        marked = await self._mark_script(keys=self._fence.keys(*(self._keys.seen(t) for t in traj_ids)),
                                         args=self._fence.args(str(ttl_s)))
        fenced_result(marked, f"marking {len(traj_ids)} trajectories trained", self._fence)

    # -- internals --------------------------------------------------------------------------

    def _check_block(self, block_ms: int) -> None:
        if block_ms < 0:
            raise ValueError(f"block_ms: must be >= 0, got {block_ms}")
        timeout = socket_timeout_s(self._redis)
        if timeout is not None and block_ms > longest_block_ms(timeout):
            raise ValueError(f"block_ms {block_ms} must stay well below the socket timeout ({timeout} s)")

    async def _with_group(self, call: Any) -> Any:
        """Runs a group command, recreating the group once if it vanished (e.g. a Redis restart without persistence)."""
        try:
            return await call()
        except ResponseError as e:
            if "NOGROUP" not in str(e):
                raise
            self.groups_lost += 1
            # Not silent: what the stream held (unread entries, and those delivered but not yet
            # acknowledged) went with it and is never trained; the run goes on from what comes next.
            log.error("consumer group %s of %s vanished (Redis restarted without persistence, or its keys "
                      "were deleted): every entry the stream held is lost to this run; recreating the group "
                      "(%d time(s) so far)", self._group, self._keys.traj, self.groups_lost)
            await self.ensure_group()
            return await call()

    async def _accept(self, raw: Sequence[tuple[Any, Any]]) -> list[StreamEntry]:
        good: list[StreamEntry] = []
        bad: list[tuple[str, Any, str]] = []
        for entry_id, fields in raw:
            if entry_id is None:
                continue  # 6.2 reports an entry deleted while pending as nil
            eid = text(entry_id)
            try:
                good.append(StreamEntry(entry_id=eid, trajectory=codec.decode(fields or {})))
            except codec.MalformedEntry as e:
                bad.append((eid, fields or {}, e.reason))
        if bad:
            await self._dead_letter(bad)
            self.malformed += len(bad)
        return good

    @cancel_safe
    async def dead_letter(self, items: Sequence[tuple[str, common_pb2.Trajectory, str]]) -> None:
        """Moves decoded entries the trainer refuses (entry id, trajectory, reason) to `traj:dead`,
        acknowledged in the same transaction. The caller counts them by its own reasons."""
        if items:
            await self._dead_letter([(eid, codec.encode(traj), reason[:512]) for eid, traj, reason in items])

    async def _dead_letter(self, bad: Sequence[tuple[str, Any, str]]) -> None:
        # One transaction: an entry is either still pending or both copied and acked. Behind the
        # fence as a whole: the holder key is WATCHed, so a trainer that lost the run adds no copy
        # either (the ack's own fence check comes after the XADDs inside the MULTI).
        what = f"dead-lettering {len(bad)} entries"
        async with self._redis.pipeline(transaction=True) as pipe:
            if self._fence.token:
                await pipe.watch(self._fence.key)
                holder = await pipe.get(self._fence.key)
                if holder is not None and text(holder) != self._fence.token:
                    fenced_result(-1, what, self._fence)
                pipe.multi()
            for eid, fields, reason in bad:
                log.warning("trajectory entry %s refused (%s); moved to %s", eid, reason, self._keys.traj_dead)
                dead = codec.dead_fields(fields, reason=reason, entry_id=eid, consumer=self._consumer)
                pipe.xadd(self._keys.traj_dead, dead, maxlen=DEAD_MAXLEN, approximate=True)
            await self._ack_script(keys=self._fence.keys(self._keys.traj, self._keys.traj_acked),
                                   args=self._fence.args(self._group, *(eid for eid, _, _ in bad)), client=pipe)
            try:
                results = await pipe.execute()
            except WatchError:  # the run was acquired by another trainer between the check and EXEC
                fenced_result(-1, what, self._fence)
                raise
        fenced_result(results[-1], what, self._fence)

    async def _groups(self) -> list[dict[str, Any]]:
        try:
            groups = await self._redis.xinfo_groups(self._keys.traj)
        except ResponseError as e:
            if "no such key" in str(e).lower():
                return []
            raise
        return [{**g, "name": text(g["name"])} for g in groups]

    async def _group_info(self, name: str) -> dict[str, Any] | None:
        return next((g for g in await self._groups() if g["name"] == name), None)


def _stream_entries(reply: Any) -> list[tuple[Any, Any]]:
    """The entries of a one-stream XREADGROUP reply (a list on RESP2, a dict on RESP3)."""
    if not reply:
        return []
    if isinstance(reply, dict):  # RESP3: {stream: [[entries]]}
        return [e for value in reply.values() for chunk in value for e in chunk]
    return [e for _, entries in reply for e in entries]
