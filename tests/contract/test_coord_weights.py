"""WeightPointer against a real Redis: forward-only moves, announcements, waiting, script reloads."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from redis.asyncio import Redis

from arlo.config import RedisConfig
from arlo.coord import Keys, WeightPointer, WeightPointerState, connect, delete_run
from arlo.coord.lease import Fence

SHA = "0" * 64


@pytest.fixture
async def r(redis_url: str, run_id: str) -> AsyncIterator[Redis]:
    client = await connect(RedisConfig(url=redis_url))
    yield client
    await delete_run(client, run_id)
    await client.aclose()


async def subscribers(r: Redis, channel: str) -> int:
    return int(dict(await r.pubsub_numsub(channel))[channel.encode()])


async def until(cond: Callable[[], Awaitable[bool]], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await cond():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


async def test_pointer_only_moves_forward(r: Redis, run_id: str) -> None:
    wp = WeightPointer(r, run_id)
    assert await wp.get() is None
    assert await wp.publish(3, source="grpc://a:1", sha256="3" * 64)
    assert not await wp.publish(2, source="grpc://b:1", sha256="2" * 64)
    assert not await wp.publish(3, source="grpc://b:1", sha256="x" * 64)
    state = await wp.get()
    assert state is not None
    assert (state.version, state.source, state.sha256) == (3, "grpc://a:1", "3" * 64)
    assert abs(state.time - time.time()) < 60
    assert await wp.publish(4, source="grpc://b:1", sha256=SHA)
    with pytest.raises(ValueError):
        await wp.publish(0, source="s", sha256=SHA)


async def test_checkpoint_only_moves_forward_and_survives_publish(r: Redis, run_id: str) -> None:
    wp = WeightPointer(r, run_id)
    assert await wp.set_checkpoint(2, "file:///ckpt/2")
    assert not await wp.set_checkpoint(1, "file:///ckpt/1")
    assert not await wp.set_checkpoint(2, "file:///ckpt/other")
    state = await wp.get()
    assert state is not None and state.version == 0  # a checkpoint-only pointer
    assert await wp.publish(5, source="grpc://a:1", sha256=SHA)
    state = await wp.get()
    assert state is not None
    assert (state.version, state.checkpoint_version, state.checkpoint_uri) == (5, 2, "file:///ckpt/2")
    assert WeightPointerState.from_proto(state.to_proto()) == state


async def test_a_checkpoint_record_names_its_recorder_and_a_restart_adopts_it(r: Redis, run_id: str) -> None:
    """The recorder's lease token tells the run's checkpoints from a fenced-out trainer's
    (services/trainer/core/lineage.py): a successor re-recording the version it restored becomes
    the recorder, and nothing else of the record changes."""
    holder = Keys(run_id).trainer_holder
    await r.set(holder, "first")
    first = WeightPointer(r, run_id, fence=Fence(holder, "first"))
    assert await first.set_checkpoint(3, "file:///ckpt/3")
    state = await first.get()
    assert state is not None and (state.checkpoint_version, state.checkpoint_writer) == (3, "first")
    await r.set(holder, "second")
    second = WeightPointer(r, run_id, fence=Fence(holder, "second"))
    assert not await second.set_checkpoint(3, "file:///elsewhere/3")  # adopted, not recorded anew
    assert not await second.set_checkpoint(2, "file:///ckpt/2")
    state = await second.get()
    assert state is not None
    assert (state.checkpoint_version, state.checkpoint_uri, state.checkpoint_writer) == (3, "file:///ckpt/3", "second")


async def test_publish_announces_the_version(r: Redis, run_id: str) -> None:
    """A move is announced on the channel wait_for_newer listens to; a stale publish is not."""
    wp = WeightPointer(r, run_id)
    channel = Keys(run_id).weights_events
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(channel)
    try:
        await until(lambda: _has_subscriber(r, channel))
        assert await wp.publish(7, source="s", sha256=SHA)
        assert not await wp.publish(6, source="s", sha256=SHA)  # stale: no event
        assert await wp.publish(8, source="s", sha256=SHA)
        announced = []
        deadline = time.monotonic() + 5
        while len(announced) < 2 and time.monotonic() < deadline:
            message = await pubsub.get_message(timeout=1.0)
            if message is not None:
                announced.append(int(message["data"]))
        assert announced == [7, 8]
    finally:
        await pubsub.aclose()


async def _has_subscriber(r: Redis, channel: str) -> bool:
    return await subscribers(r, channel) > 0


async def _no_subscriber(r: Redis, channel: str) -> bool:
    return await subscribers(r, channel) == 0


async def test_wait_for_newer_wakes_on_the_event(r: Redis, run_id: str) -> None:
    wp = WeightPointer(r, run_id)
    await wp.publish(1, source="s", sha256=SHA)
    channel = Keys(run_id).weights_events

    async def publish_later() -> None:
        await until(lambda: _has_subscriber(r, channel))
        await wp.publish(2, source="grpc://new:1", sha256=SHA)

    started = time.monotonic()
    # Polling every 60 s: only the event can wake it in time.
    waiter = asyncio.ensure_future(wp.wait_for_newer(1, timeout_s=30, poll_s=60))
    await publish_later()
    state = await asyncio.wait_for(waiter, 10)
    assert state is not None and state.version == 2 and state.source == "grpc://new:1"
    assert time.monotonic() - started < 10
    await until(lambda: _no_subscriber(r, channel))


async def test_wait_for_newer_polls_when_no_event_comes(r: Redis, run_id: str) -> None:
    wp = WeightPointer(r, run_id)

    async def write_without_event() -> None:
        await asyncio.sleep(0.2)
        await r.hset(Keys(run_id).weights, mapping={"version": 9, "source": "s", "sha256": SHA, "time": 1.0})

    writer = asyncio.ensure_future(write_without_event())
    started = time.monotonic()
    state = await wp.wait_for_newer(0, timeout_s=10, poll_s=0.1)
    await writer
    assert state is not None and state.version == 9
    assert time.monotonic() - started < 5


async def test_wait_for_newer_returns_current_or_times_out(r: Redis, run_id: str) -> None:
    wp = WeightPointer(r, run_id)
    assert await wp.wait_for_newer(0, timeout_s=0.2, poll_s=0.05) is None
    await wp.publish(4, source="s", sha256=SHA)
    state = await wp.wait_for_newer(2, timeout_s=0.5)
    assert state is not None and state.version == 4
    started = time.monotonic()
    assert await wp.wait_for_newer(4, timeout_s=0.3, poll_s=0.1) is None
    assert 0.25 < time.monotonic() - started < 3


async def test_scripts_survive_script_flush(r: Redis, run_id: str) -> None:
    wp = WeightPointer(r, run_id)
    assert await wp.publish(1, source="s", sha256=SHA)
    await r.script_flush()
    assert await wp.publish(2, source="s", sha256=SHA)
    assert not await wp.publish(1, source="s", sha256=SHA)
    await r.script_flush()
    assert await wp.set_checkpoint(2, "u")
    state = await wp.get()
    assert state is not None and (state.version, state.checkpoint_version) == (2, 2)
