"""A client from `connect` survives a Redis restart: calls made while it is down succeed once it is back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest
from redis.asyncio import Redis

from arlo.app.redis_server import LocalRedis, host_port, start_local_redis
from arlo.config import RedisConfig
from arlo.coord import TrajectoryStream, WeightPointer, connect
from arlo.proto.v1 import common_pb2


async def until_subscribed(client: Redis, channel: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not dict(await client.pubsub_numsub(channel)).get(channel.encode()):
        assert time.monotonic() < deadline, f"nobody subscribed to {channel}"
        await asyncio.sleep(0.01)


@pytest.fixture
def server() -> Iterator[list[LocalRedis]]:
    """Our own redis-server (the shared one must not be killed); a list so the test can replace it."""
    servers = [start_local_redis()]
    yield servers
    for s in servers:
        s.stop()


async def test_calls_succeed_after_a_restart(server: list[LocalRedis], run_id: str) -> None:
    url = server[0].url
    _, port = host_port(url)
    client = await connect(RedisConfig(url=url, socket_timeout_s=2.0, reconnect_max_s=0.5))
    try:
        stream = TrajectoryStream(client, run_id, consumer="c")
        pointer = WeightPointer(client, run_id)
        await stream.ensure_group()
        await stream.add(common_pb2.Trajectory(id="before"))
        assert await pointer.publish(1, source="s", sha256="0" * 64)
        # A watcher like inference's, waiting across the restart (poll_s bounds its re-reads).
        waiter = asyncio.ensure_future(pointer.wait_for_newer(1, timeout_s=60, poll_s=1.0))
        await until_subscribed(client, stream.keys.weights_events)

        server[0].process.kill()  # a crash, not a clean shutdown
        server[0].process.wait()

        async def restart() -> None:
            await asyncio.sleep(0.5)
            server.append(await asyncio.to_thread(start_local_redis, port))

        restarter = asyncio.ensure_future(restart())
        # Issued while Redis is down: the client's retries carry it over the restart.
        assert await asyncio.wait_for(client.ping(), 30)
        await restarter

        # The new server is empty (no persistence): the group is recreated on demand and the
        # pointer's script is reloaded into the new script cache.
        assert await stream.read(count=10, block_ms=100) == []
        await stream.add(common_pb2.Trajectory(id="after"))
        assert [e.trajectory.id for e in await stream.read(count=10, block_ms=100)] == ["after"]
        # The watcher resubscribes on the new server; events sent before that are lost.
        await until_subscribed(client, stream.keys.weights_events)
        assert await pointer.publish(2, source="s", sha256="0" * 64)
        state = await pointer.get()
        assert state is not None and state.version == 2
        newer = await asyncio.wait_for(waiter, 10)
        assert newer is not None and newer.version == 2
    finally:
        await client.aclose()
