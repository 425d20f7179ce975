"""One client cannot take every environment session (issue 33, item 17a): a flood of Resets
from one client used to fill env_gateway.max_sessions and refuse every other client until the
flood's sessions expired. Now each client (gRPC connection) holds at most
max_sessions_per_client; the flooding one is refused RESOURCE_EXHAUSTED, the others are served."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.__main__ import start_env_gateway
from services.env_gateway.envs.arith import ArithEnv
from services.env_gateway.sessions import ClientSessionLimitError, SessionLimitError, SessionStore
from tests.contract.test_env_gateway import TOKEN, config, token  # noqa: F401

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED


async def _reset(stub: env_pb2_grpc.EnvironmentStub, seed: int) -> env_pb2.ResetResponse | grpc.aio.AioRpcError:
    try:
        return await stub.Reset(env_pb2.ResetRequest(env_name="arith", seed=seed), timeout=10)
    except grpc.aio.AioRpcError as e:
        return e


@pytest.mark.usefixtures("token")
async def test_a_flooding_client_is_refused_while_another_still_gets_sessions() -> None:
    running = await start_env_gateway(config(max_sessions=8, max_sessions_per_client=3))
    try:
        address = f"127.0.0.1:{running.port}"
        async with make_channel(address, token=TOKEN) as flood_channel, make_channel(address, token=TOKEN) as other:
            flood, polite = env_pb2_grpc.EnvironmentStub(flood_channel), env_pb2_grpc.EnvironmentStub(other)
            replies = await asyncio.gather(*(_reset(flood, seed) for seed in range(40)))
            opened = [r for r in replies if isinstance(r, env_pb2.ResetResponse)]
            refused = [r for r in replies if isinstance(r, grpc.aio.AioRpcError)]
            assert len(opened) == 3 and len(refused) == 37
            assert {e.code() for e in refused} == {EXHAUSTED}
            assert "max_sessions_per_client" in (refused[0].details() or "")
            # Another client is served beside the flood, up to its own bound.
            mine = [await _reset(polite, seed) for seed in range(3)]
            assert all(isinstance(r, env_pb2.ResetResponse) for r in mine)
            # The flooding client gets room back as it closes what it holds.
            await flood.Close(env_pb2.CloseRequest(session_id=opened[0].session_id), timeout=10)
            assert isinstance(await _reset(flood, 99), env_pb2.ResetResponse)
            assert isinstance(await _reset(flood, 100), grpc.aio.AioRpcError)
    finally:
        await running.stop(None)


@pytest.mark.usefixtures("token")
async def test_without_the_bound_a_flood_refuses_everyone_else() -> None:
    """The fault itself, with the bound off (0): what every gateway did before it existed."""
    running = await start_env_gateway(config(max_sessions=8, max_sessions_per_client=0))
    try:
        address = f"127.0.0.1:{running.port}"
        async with make_channel(address, token=TOKEN) as flood_channel, make_channel(address, token=TOKEN) as other:
            flood, polite = env_pb2_grpc.EnvironmentStub(flood_channel), env_pb2_grpc.EnvironmentStub(other)
            replies = await asyncio.gather(*(_reset(flood, seed) for seed in range(40)))
            assert sum(isinstance(r, env_pb2.ResetResponse) for r in replies) == 8
            refused = await _reset(polite, 0)
            assert isinstance(refused, grpc.aio.AioRpcError) and refused.code() == EXHAUSTED
    finally:
        await running.stop(None)


def test_a_clients_count_is_freed_by_close_and_by_either_expiry() -> None:
    now = [0.0]
    store = SessionStore(idle_timeout_s=10.0, max_sessions=5, max_per_client=2, clock=lambda: now[0])
    a = [store.create("arith", ArithEnv(), client="a") for _ in range(2)]
    with pytest.raises(ClientSessionLimitError, match="max_sessions_per_client is 2"):
        store.create("arith", ArithEnv(), client="a")
    b = [store.create("arith", ArithEnv(), client="b") for _ in range(2)]
    store.create("arith", ArithEnv(), client="c")
    with pytest.raises(SessionLimitError, match=r"5 sessions are open \(env_gateway.max_sessions\)"):
        store.create("arith", ArithEnv(), client="d")  # within its own bound, but the store is full
    assert store.close(a[0].id) and not store.close(a[0].id)  # a second close frees nothing more
    assert store.held_by("a") == 1
    now[0] = 10.0  # all idle past the timeout: one found on lookup, the others on the next create
    with pytest.raises(LookupError):
        store.get(b[0].id)
    store.create("arith", ArithEnv(), client="a")
    assert (store.held_by("a"), store.held_by("b"), store.held_by("c"), len(store)) == (1, 0, 0, 1)
    assert store._held == {"a": 1}  # no entry outlives a client's last session
    unbounded = SessionStore(idle_timeout_s=10.0, max_sessions=3)  # 0: only max_sessions bounds
    for _ in range(3):
        unbounded.create("arith", ArithEnv(), client="a")
