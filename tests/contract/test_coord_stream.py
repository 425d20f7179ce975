"""TrajectoryStream against a real Redis: at-least-once delivery, backpressure, dead letters, dedup."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest
from redis.asyncio import Redis

from arlo.config import RedisConfig
from arlo.coord import BacklogFull, Keys, TrajectoryStream, connect, delete_run
from arlo.coord.client import text
from arlo.proto.v1 import common_pb2


@pytest.fixture
async def r(redis_url: str, run_id: str) -> AsyncIterator[Redis]:
    client = await connect(RedisConfig(url=redis_url))
    yield client
    await delete_run(client, run_id)
    await client.aclose()


def traj(traj_id: str) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(id=traj_id, run_id="test", group_id="g", token_ids=[1, 2, 3],
                                 logprobs=[0.0, -0.1, -0.2], loss_mask=[0, 1, 1], policy_versions=[-1, 0, 0])


async def stream(r: Redis, run_id: str, consumer: str = "c1", max_backlog: int = 4096) -> TrajectoryStream:
    s = TrajectoryStream(r, run_id, consumer=consumer, max_backlog=max_backlog)
    await s.ensure_group()
    return s


async def pending(r: Redis, run_id: str) -> int:
    return int((await r.xpending(Keys(run_id).traj, "trainer"))["pending"])


async def test_add_read_ack_round_trip(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id)
    await s.ensure_group()  # idempotent
    ids = [await s.add(traj(f"t{i}")) for i in range(3)]
    got = await s.read(count=10, block_ms=100)
    assert [e.entry_id for e in got] == ids
    assert [e.trajectory for e in got] == [traj(f"t{i}") for i in range(3)]
    assert await s.read(count=10, block_ms=50) == []
    assert await pending(r, run_id) == 3
    assert await s.ack(ids) == 3
    assert await pending(r, run_id) == 0
    assert await s.backlog() == 0
    # Acked entries are trimmed; the last delivered one may stay.
    assert await s.length() <= 1


async def test_read_without_blocking_and_block_bound(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id)
    assert await s.read(count=5, block_ms=0) == []
    with pytest.raises(ValueError, match="socket timeout"):
        await s.read(count=5, block_ms=10_000)  # default socket timeout is 10 s
    with pytest.raises(ValueError):
        await s.read(count=0, block_ms=0)


async def test_unacked_entries_are_reclaimed_by_another_consumer(r: Redis, run_id: str) -> None:
    dead = await stream(r, run_id, consumer="dead")
    alive = await stream(r, run_id, consumer="alive")
    ids = [await dead.add(traj(f"t{i}")) for i in range(2)]
    assert len(await dead.read(count=10, block_ms=100)) == 2  # ... and the consumer dies
    assert await alive.read(count=10, block_ms=50) == []  # not redelivered as new
    assert await alive.claim_stale(min_idle_ms=60_000) == []  # not idle long enough
    await asyncio.sleep(0.1)
    claimed = await alive.claim_stale(min_idle_ms=50)
    assert [e.entry_id for e in claimed] == ids
    assert [e.trajectory.id for e in claimed] == ["t0", "t1"]
    summary = await r.xpending(Keys(run_id).traj, "trainer")
    assert [c["name"] for c in summary["consumers"]] == [b"alive"]
    assert await alive.ack(ids) == 2
    assert await pending(r, run_id) == 0


async def test_claim_stale_loops_the_cursor_up_to_count(r: Redis, run_id: str) -> None:
    dead = await stream(r, run_id, consumer="dead")
    alive = await stream(r, run_id, consumer="alive")
    for i in range(25):
        await dead.add(traj(f"t{i}"))
    assert len(await dead.read(count=100, block_ms=100)) == 25
    await asyncio.sleep(0.05)
    first = await alive.claim_stale(min_idle_ms=10, count=10)
    rest = await alive.claim_stale(min_idle_ms=10, count=100)
    assert len(first) == 10 and len(rest) == 15
    assert {e.trajectory.id for e in first + rest} == {f"t{i}" for i in range(25)}


async def test_claim_stale_skips_entries_deleted_while_pending(r: Redis, run_id: str) -> None:
    dead = await stream(r, run_id, consumer="dead")
    alive = await stream(r, run_id, consumer="alive")
    gone, kept = await dead.add(traj("gone")), await dead.add(traj("kept"))
    await dead.read(count=10, block_ms=100)
    await r.xdel(Keys(run_id).traj, gone)
    await asyncio.sleep(0.05)
    claimed = await alive.claim_stale(min_idle_ms=10)
    assert [e.entry_id for e in claimed] == [kept]
    assert alive.malformed == 0


async def test_backlog_full_refuses_and_drops_nothing(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id, max_backlog=3)
    for i in range(3):
        await s.add(traj(f"t{i}"))
    with pytest.raises(BacklogFull) as info:
        await s.add(traj("t3"))
    assert (info.value.backlog, info.value.limit) == (3, 3)
    assert await s.length() == 3
    got = await s.read(count=10, block_ms=100)
    assert [e.trajectory.id for e in got] == ["t0", "t1", "t2"]
    # Delivered but unacked still counts: the trainer has not used it yet.
    with pytest.raises(BacklogFull):
        await s.add(traj("t3"))
    await s.ack([got[0].entry_id, got[1].entry_id])
    assert await s.backlog() == 1
    await s.add(traj("t3"))
    assert [e.trajectory.id for e in await s.read(count=10, block_ms=100)] == ["t3"]


async def test_backlog_before_any_group_counts_every_entry(r: Redis, run_id: str) -> None:
    producer = TrajectoryStream(r, run_id, consumer="rollout-0", max_backlog=2)
    assert await producer.backlog() == 0
    await producer.add(traj("a"))
    await producer.add(traj("b"))
    with pytest.raises(BacklogFull):
        await producer.add(traj("c"))


async def test_backlog_falls_back_when_redis_reports_no_lag(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id)
    ids = [await s.add(traj(f"t{i}")) for i in range(4)]
    got = await s.read(count=2, block_ms=100)
    await s.ack([got[0].entry_id])
    # Deleting an undelivered entry makes Redis 7 report lag as nil.
    await r.xdel(Keys(run_id).traj, ids[3])
    groups = await r.xinfo_groups(Keys(run_id).traj)
    assert groups[0]["lag"] is None
    # Left: t1 (pending) and t2 (undelivered).
    assert await s.backlog() == 2


async def test_malformed_entries_are_set_aside_once(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id)
    k = Keys(run_id)
    good_a = await s.add(traj("a"))
    await r.xadd(k.traj, {"id": "x", "pb": b"\xff\xfe garbage"})
    await r.xadd(k.traj, {"id": "y"})
    await r.xadd(k.traj, {"something": "else"})
    await r.xadd(k.traj, {"id": "z", "pb": traj("not-z").SerializeToString()})
    good_b = await s.add(traj("b"))
    got = await s.read(count=100, block_ms=100)
    assert [e.entry_id for e in got] == [good_a, good_b]
    assert s.malformed == 4
    dead = await r.xrange(k.traj_dead) or []
    assert len(dead) == 4
    reasons = [text((fields or {})[b"dead:reason"]) for _, fields in dead]
    assert "not a Trajectory" in reasons[0] and "missing" in reasons[1] and "mismatch" in reasons[3]
    assert (dead[0][1] or {})[b"pb"] == b"\xff\xfe garbage"  # raw bytes kept for inspection
    # Only the good entries await an ack; the bad ones never come back.
    assert await pending(r, run_id) == 2
    await asyncio.sleep(0.02)
    assert await s.claim_stale(min_idle_ms=0) == [e for e in got]
    assert await s.read(count=100, block_ms=50) == []
    assert s.malformed == 4


async def test_malformed_entries_found_by_claim_stale(r: Redis, run_id: str) -> None:
    k = Keys(run_id)
    alive = await stream(r, run_id, consumer="alive")
    await r.xadd(k.traj, {"id": "x", "pb": b"\x07"})
    await r.xreadgroup("trainer", "dead", {k.traj: ">"}, count=10)
    await asyncio.sleep(0.02)
    assert await alive.claim_stale(min_idle_ms=10) == []
    assert alive.malformed == 1
    assert await r.xlen(k.traj_dead) == 1
    assert await pending(r, run_id) == 0


async def test_duplicates_are_dropped_across_reads(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id)
    for traj_id in ["t1", "t2", "t1"]:  # a producer retry wrote t1 twice
        await s.add(traj(traj_id))
    batch = await s.filter_unseen(await s.read(count=10, block_ms=100))
    assert [e.trajectory.id for e in batch] == ["t1", "t2"]
    assert s.duplicates == 1
    await s.mark_trained([e.trajectory.id for e in batch])
    await s.ack([e.entry_id for e in batch])
    await s.add(traj("t2"))  # redelivered after the step
    assert await s.filter_unseen(await s.read(count=10, block_ms=100)) == []
    assert s.duplicates == 2
    assert await pending(r, run_id) == 0  # dropped duplicates were acked
    ttl = await r.ttl(Keys(run_id).seen("t1"))
    assert 0 < ttl <= 7 * 24 * 3600


async def test_group_is_recreated_when_it_vanished(r: Redis, run_id: str, caplog: pytest.LogCaptureFixture) -> None:
    s = await stream(r, run_id)
    await s.add(traj("lost"))
    await r.delete(Keys(run_id).traj)  # e.g. Redis restarted without persistence
    assert await s.read(count=10, block_ms=0) == []
    # Reported, not silent (issue 33 item 17b): the entry written before the wipe is gone.
    assert s.groups_lost == 1 and any(rec.levelname == "ERROR" and "is lost to this run" in rec.getMessage()
                                      for rec in caplog.records)
    await s.add(traj("t"))
    assert [e.trajectory.id for e in await s.read(count=10, block_ms=100)] == ["t"]


async def test_rejects_a_decoding_client(redis_url: str, run_id: str) -> None:
    client = Redis.from_url(redis_url, decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses"):
            TrajectoryStream(client, run_id, consumer="c")
    finally:
        await client.aclose()


async def test_a_reading_loop_always_stops_when_cancelled(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id)

    async def consume_forever() -> None:
        while True:
            await s.read(count=10, block_ms=0)

    for i in range(60):
        task = asyncio.ensure_future(consume_forever())
        await asyncio.sleep(0.001 + (i % 7) * 0.0007)
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=2)
        assert done, f"reading loop ignored cancel #{i}"


async def test_add_group_writes_the_whole_group_or_nothing(r: Redis, run_id: str) -> None:
    s = await stream(r, run_id, max_backlog=3)
    ids = await s.add_group([traj("a0"), traj("a1")])
    assert len(ids) == 2 and await s.length() == 2
    await s.add(traj("b0"))
    with pytest.raises(BacklogFull):
        await s.add_group([traj("c0"), traj("c1")])
    assert await s.length() == 3  # none of the refused group went in
    got = await s.read(count=10, block_ms=100)
    assert [e.entry_id for e in got][:2] == ids and [e.trajectory.id for e in got] == ["a0", "a1", "b0"]
    assert await s.add_group([]) == []
