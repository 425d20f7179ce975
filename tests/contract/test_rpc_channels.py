"""A server restarted on the same address is reachable at once through a new channel, while a
channel to its predecessor is still open in the process (the supervisor restarts a crashed
service on its port; a test's server may get a port an earlier test's server had). With gRPC's
process-wide subchannel pool the new channel shared the old one's subchannel, stuck in
reconnect backoff, and failed UNAVAILABLE "connection refused" (CI saw it in test_reward.py)."""

from __future__ import annotations

import asyncio

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from arlo.app.supervisor import is_serving
from arlo.rpc import make_channel


async def serve(port: int = 0) -> tuple[grpc.aio.Server, int]:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), server)
    bound = server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, bound


async def check(channel: grpc.aio.Channel) -> grpc.StatusCode:
    try:
        await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
    except grpc.aio.AioRpcError as e:
        return e.code()
    return grpc.StatusCode.OK


async def test_a_new_channel_reaches_a_server_restarted_on_the_same_port() -> None:
    first, port = await serve()
    old = make_channel(f"127.0.0.1:{port}", token=None)
    try:
        assert await check(old) == grpc.StatusCode.OK
        await first.stop(None)
        assert await check(old) == grpc.StatusCode.UNAVAILABLE  # its subchannel is now in backoff
        await asyncio.sleep(0.2)
        second, _ = await serve(port)
        try:
            async with make_channel(f"127.0.0.1:{port}", token=None) as new:
                assert await check(new) == grpc.StatusCode.OK
            assert await asyncio.to_thread(is_serving, f"127.0.0.1:{port}", 5.0)  # the supervisor's probe too
        finally:
            await second.stop(None)
    finally:
        await old.close()
