"""Unauthenticated health Watch streams are bounded per client host and in total (issue 16: ~8,000
of them grew a service by 200 MiB for good). A real reward server on an ephemeral port."""

from __future__ import annotations

import asyncio

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arlo.config import AuthConfig, ServerConfig
from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
from arlo.rpc import ServiceBinding, start_server

SERVING = health_pb2.HealthCheckResponse.SERVING


async def start(**server_kw):
    from services.reward.registry import default_registry
    from services.reward.scoring import Scorer
    from services.reward.server import RewardServicer

    servicer = RewardServicer(default_registry(), Scorer(timeout_s=5.0))
    name = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name
    return await start_server("test", ServerConfig(port=0, metrics_port=-1, **server_kw), AuthConfig(disabled=True),
                              [ServiceBinding(name, reward_pb2_grpc.add_RewardServicer_to_server, servicer)])


async def open_watch(stub: health_pb2_grpc.HealthStub):
    """A Watch call and its outcome: 'open' once the first status arrives, else the status code."""
    call = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
    try:
        first = await call.read()
        return call, ("open" if first.status == SERVING else first.status)
    except grpc.aio.AioRpcError as e:
        return call, e.code()


@pytest.mark.timeout(120)
async def test_watch_streams_are_bounded_per_client_and_in_total() -> None:
    running = await start(max_health_watches=24, max_health_watches_per_client=8)
    try:
        # Many connections from one host (separate subchannels): the bound is per host, not per connection.
        channels = [grpc.aio.insecure_channel(f"127.0.0.1:{running.port}",
                                              options=[("grpc.use_local_subchannel_pool", 1)]) for _ in range(10)]
        try:
            stubs = [health_pb2_grpc.HealthStub(c) for c in channels]
            results = await asyncio.gather(*(open_watch(stubs[i % 10]) for i in range(400)))
            outcomes = [r for _, r in results]
            assert outcomes.count("open") == 8
            assert outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 392
            # Check still answers, and a stream closed gives its slot back.
            check = await stubs[0].Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert check.status == SERVING
            for call, outcome in results:
                if outcome == "open":
                    call.cancel()
                    break
            for _ in range(50):
                call, outcome = await open_watch(stubs[1])
                if outcome == "open":
                    call.cancel()
                    break
                await asyncio.sleep(0.05)
            assert outcome == "open"
        finally:
            for c in channels:
                await c.close()
    finally:
        await running.stop(None)


async def test_total_watch_bound_applies_across_clients() -> None:
    running = await start(max_health_watches=5, max_health_watches_per_client=100)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            results = await asyncio.gather(*(open_watch(stub) for _ in range(40)))
            outcomes = [r for _, r in results]
            assert outcomes.count("open") == 5 and outcomes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 35
            for call, _ in results:
                call.cancel()
    finally:
        await running.stop(None)
