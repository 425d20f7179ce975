"""Episode affinity over two real env_gateway servers on ephemeral ports: every call of an
episode reaches the replica that created its session, episodes spread over both, and a replica
that goes away costs only its own episodes (UNAVAILABLE, which the rollout retries)."""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator, Callable

import grpc
import pytest

from arlo.config import AuthConfig, EnvGatewayConfig, RunConfig, ServerConfig
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import RunningServer, make_channel
from arlo.rpc.replicas import parse_target, resolve
from services.env_gateway.__main__ import start_env_gateway
from services.rollout.env_affinity import AffinityEnvironmentClient
from services.rollout.env_closes import SessionCloses
from services.rollout.types import BackendError, RetryableError
from tests.support.scripted_server import scripted_server

TOKEN = "affinity-token"
TOKEN_ENV = "ARLO_TEST_AFFINITY_TOKEN"


@pytest.fixture
async def replicas(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[list[RunningServer]]:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    cfg = RunConfig(auth=AuthConfig(token_env=TOKEN_ENV),
                    env_gateway=EnvGatewayConfig(server=ServerConfig(port=0, metrics_port=-1)))
    servers = [await start_env_gateway(cfg) for _ in range(2)]
    try:
        yield servers
    finally:
        for s in servers:
            await s.stop(None)


def client_for(servers: list[RunningServer]) -> AffinityEnvironmentClient:
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    return AffinityEnvironmentClient(target, lambda address: make_channel(address, token=TOKEN), timeout_s=5)


def answer_of(prompt: str) -> int:
    a, b = prompt.removesuffix("=").split("+")
    return int(a) + int(b)


async def episode(env: AffinityEnvironmentClient, seed: int) -> tuple[str, str]:
    """Wrong answer, then the right one: three calls on one session, then Close."""
    started = await env.reset("arith", "", seed)
    replica = env.replica_of(started.session_id)
    assert replica is not None
    result = answer_of(started.observation[0].content)
    wrong = await env.step(started.session_id, str(result + 1))
    right = await env.step(started.session_id, str(result))
    assert not wrong.done and right.done and right.reward == 1.0
    await env.close(started.session_id)
    return started.session_id, replica


async def test_each_episode_stays_on_its_replica_and_episodes_spread(replicas: list[RunningServer]) -> None:
    env = client_for(replicas)
    try:
        done = await asyncio.gather(*(episode(env, seed) for seed in range(24)))
    finally:
        await env.aclose()
    per_replica = Counter(replica for _, replica in done)
    # Least-loaded placement (Resets in flight count): concurrent episodes split evenly.
    assert per_replica == {f"127.0.0.1:{s.port}": 12 for s in replicas}


async def test_a_session_is_only_known_to_its_own_replica(replicas: list[RunningServer]) -> None:
    """Why affinity is needed at all: the other replica answers NOT_FOUND for the same session."""
    env = client_for(replicas)
    try:
        started = await env.reset("arith", "", 7)
        owner = env.replica_of(started.session_id)
        other = next(f"127.0.0.1:{s.port}" for s in replicas if f"127.0.0.1:{s.port}" != owner)
        async with make_channel(other, token=TOKEN) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await env_pb2_grpc.EnvironmentStub(channel).Step(
                    env_pb2.StepRequest(session_id=started.session_id, action="1"), timeout=5)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND
        await env.step(started.session_id, "1")  # while its own replica knows it
    finally:
        await env.aclose()


async def test_a_lost_replica_costs_only_its_episodes(replicas: list[RunningServer]) -> None:
    env = client_for(replicas)
    try:
        sessions = [(await env.reset("arith", "", seed)).session_id for seed in range(4)]
        lost = f"127.0.0.1:{replicas[0].port}"
        await replicas[0].stop(None)
        for session_id in sessions:
            if env.replica_of(session_id) == lost:
                with pytest.raises(RetryableError):  # the worker restarts the episode
                    await env.step(session_id, "1")
            else:
                await env.step(session_id, "1")
        # New episodes skip the dead replica (it refuses the Reset) and land on the live one.
        restarted = [await env.reset("arith", "", seed) for seed in range(4)]
        assert {env.replica_of(r.session_id) for r in restarted} == {f"127.0.0.1:{replicas[1].port}"}
    finally:
        await env.aclose()


async def test_targets_resolve_like_the_deployed_address() -> None:
    assert parse_target("dns:///env-gateway:50053", "env_gateway") == ("env-gateway", 50053)
    assert parse_target("env-gateway.arlo.svc:50053", "env_gateway") == ("env-gateway.arlo.svc", 50053)
    assert parse_target("ipv4:10.0.0.1:1,10.0.0.2:1", "env_gateway") == ["10.0.0.1:1", "10.0.0.2:1"]
    assert "127.0.0.1:50053" in await resolve("dns:///localhost:50053")
    with pytest.raises(ValueError, match="^env_gateway address .*host:port"):
        AffinityEnvironmentClient("env-gateway", lambda a: make_channel(a, token=None), timeout_s=1)


async def test_concurrent_steps_to_one_replica_travel_as_one_step_batch(replicas: list[RunningServer]) -> None:
    """A lone Step goes out alone; Steps that arrive while one is in flight leave together as a
    StepBatch, each caller getting its own result (or its own error)."""
    env = client_for(replicas[:1])
    try:
        started = [await env.reset("arith", "", seed) for seed in range(32)]
        alone = await env.step(started[0].session_id, "x")
        assert not alone.done and env.calls == {"Step": 1}
        answers = [str(answer_of(s.observation[0].content)) for s in started]
        results = await asyncio.gather(*(env.step(s.session_id, a) for s, a in zip(started, answers, strict=True)),
                                       env.step("no-such-session", "1"), return_exceptions=True)
        *steps, missing = results
        assert all(r.done and r.reward == 1.0 and r.answer == a for r, a in zip(steps, answers, strict=True))
        assert isinstance(missing, BackendError) and not isinstance(missing, RetryableError)
        assert missing.code == "NOT_FOUND"
        # One Step went out at once; the other 32 waited for it and left in one StepBatch.
        assert env.calls == {"Step": 2, "StepBatch": 1, "batched_steps": 32}
    finally:
        await env.aclose()


async def test_without_coalescing_every_step_is_its_own_call(replicas: list[RunningServer]) -> None:
    env = AffinityEnvironmentClient(f"ipv4:127.0.0.1:{replicas[0].port}",
                                    lambda address: make_channel(address, token=TOKEN), timeout_s=5, max_in_flight=0)
    try:
        started = [await env.reset("arith", "", seed) for seed in range(8)]
        await asyncio.gather(*(env.step(s.session_id, "x") for s in started))
        assert env.calls == {"Step": 8}
    finally:
        await env.aclose()


class HeldCloses(env_pb2_grpc.EnvironmentServicer):
    """A gateway whose closes are held until `release` is set: a close that waited for its
    answer would hang. Without CloseBatch it is a gateway from before it (the base answers
    UNIMPLEMENTED)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.calls: Counter[str] = Counter()
        self.closed: list[str] = []

    async def Reset(self, request, context):  # noqa: N802
        self.calls["Reset"] += 1
        return env_pb2.ResetResponse(session_id=f"s{self.calls['Reset']}")

    async def Close(self, request, context):  # noqa: N802
        self.calls["Close"] += 1
        await self.release.wait()
        self.closed.append(request.session_id)
        return env_pb2.CloseResponse()


class HeldCloseBatches(HeldCloses):
    async def CloseBatch(self, request, context):  # noqa: N802
        self.calls["CloseBatch"] += 1
        await self.release.wait()
        self.closed += request.session_ids
        return env_pb2.CloseBatchResponse(results=[env_pb2.CloseResult() for _ in request.session_ids])


@contextlib.asynccontextmanager
async def held_gateway(servicer: HeldCloses) -> AsyncIterator[AffinityEnvironmentClient]:
    """A client of `servicer`'s gateway; closed (sending the closes it owes) before the server stops."""
    async with scripted_server(env_pb2_grpc.add_EnvironmentServicer_to_server, servicer) as address:
        env = AffinityEnvironmentClient(f"ipv4:{address}", lambda a: make_channel(a, token=None), timeout_s=30)
        try:
            yield env
        finally:
            await env.aclose()


@pytest.mark.parametrize("servicer", [HeldCloseBatches, HeldCloses])
async def test_closes_never_wait_for_the_gateway_and_end_together(servicer: type[HeldCloses]) -> None:
    """Episodes that end together close without waiting on the gateway (a close is off the step's
    critical path) and their closes leave as one CloseBatch, or one Close each to a gateway
    without it (remembered: the next closes go alone at once); `aclose` sends the closes still
    owed before it returns."""
    gateway = servicer()
    async with held_gateway(gateway) as env:
        sessions = [(await env.reset("any", "", seed)).session_id for seed in range(16)]
        await asyncio.wait_for(asyncio.gather(*(env.close(s) for s in sessions[:8])), timeout=10)
        assert gateway.closed == [] and env.replica_of(sessions[0]) is None
        gateway.release.set()
        await asyncio.wait_for(_until(lambda: len(gateway.closed) == 8), timeout=10)
        await asyncio.gather(*(env.close(s) for s in sessions[8:]))
        await env.aclose()
    assert sorted(gateway.closed) == sorted(sessions)
    if servicer is HeldCloseBatches:
        assert gateway.calls["CloseBatch"] == 2 and gateway.calls["Close"] == 0
        assert env.calls == {"CloseBatch": 2, "batched_closes": 16}
    else:  # refused as UNIMPLEMENTED once, then sent one Close each
        assert gateway.calls["Close"] == 16 and env.calls == {"CloseBatch": 1, "batched_closes": 8, "Close": 16}


class UpgradedInPlace(HeldCloseBatches):
    """A gateway that answers CloseBatch UNIMPLEMENTED until it is `upgraded` (a rolling
    upgrade behind the same address)."""

    def __init__(self) -> None:
        super().__init__()
        self.release.set()
        self.upgraded = False

    async def CloseBatch(self, request, context):  # noqa: N802
        if not self.upgraded:
            self.calls["refused CloseBatch"] += 1
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not yet")
        return await super().CloseBatch(request, context)


async def test_a_gateway_upgraded_in_place_is_offered_close_batch_again() -> None:
    """A replica that refused CloseBatch gets lone Closes only for `reprobe_s`: after that it is
    offered CloseBatch again, so an upgrade behind the same address batches again (the refusal
    used to be remembered for the client's whole life)."""
    gateway = UpgradedInPlace()
    calls: Counter[str] = Counter()
    async with scripted_server(env_pb2_grpc.add_EnvironmentServicer_to_server, gateway) as address:
        channel = make_channel(f"ipv4:{address}", token=None)
        closes = SessionCloses(lambda _: channel, timeout_s=10, coalesce=True, calls=calls,
                               on_sent=lambda _: None, reprobe_s=0.5)
        try:
            async def burst(first: int) -> None:
                for i in range(first, first + 4):
                    closes.send(address, f"s{i}")
                await asyncio.wait_for(_until(lambda: closes.owed(address) == 0), timeout=10)

            await burst(0)  # refused, then sent alone
            gateway.upgraded = True
            await burst(4)  # inside reprobe_s: still alone, not offered a batch
            assert gateway.calls["refused CloseBatch"] == 1 and gateway.calls["CloseBatch"] == 0
            assert gateway.calls["Close"] == 8
            await asyncio.sleep(0.6)
            await burst(8)  # offered again, and taken
            assert gateway.calls["CloseBatch"] == 1 and gateway.calls["Close"] == 8
            assert sorted(gateway.closed) == sorted(f"s{i}" for i in range(12))
        finally:
            await closes.drain(5)
            await channel.close()


async def test_closes_handed_over_while_the_client_closes_are_sent() -> None:
    """Closes handed over while `aclose` drains (episodes still unwinding) are sent too."""
    gateway = HeldCloseBatches()
    async with held_gateway(gateway) as env:
        sessions = [(await env.reset("any", "", seed)).session_id for seed in range(6)]
        await asyncio.gather(*(env.close(s) for s in sessions[:2]))
        closing = asyncio.create_task(env.aclose())
        # The first two are at the gateway, held.
        await asyncio.wait_for(_until(lambda: gateway.calls["CloseBatch"] == 1), timeout=10)
        await asyncio.gather(*(env.close(s) for s in sessions[2:]))
        gateway.release.set()
        await closing
    assert sorted(gateway.closed) == sorted(sessions)


class HeldApart(HeldCloseBatches):
    """CloseBatches held on `release`, lone Closes on `release_lone`."""

    def __init__(self) -> None:
        super().__init__()
        self.release_lone = asyncio.Event()

    async def Close(self, request, context):  # noqa: N802
        self.calls["Close"] += 1
        await self.release_lone.wait()
        self.closed.append(request.session_id)
        return env_pb2.CloseResponse()


async def test_a_replica_that_left_the_list_keeps_its_channel_until_its_closes_are_sent() -> None:
    """A replica's channel is dropped once it is unlisted and none of its sessions is open, but
    not while a close to it is still owed: that close would be cancelled with the channel."""
    gateway = HeldApart()
    async with held_gateway(gateway) as env:
        sessions = [(await env.reset("any", "", seed)).session_id for seed in range(5)]
        env._addresses = []  # as a re-resolve that no longer lists the replica (a pod going away)
        await asyncio.gather(*(env.close(s) for s in sessions[:4]))
        await asyncio.wait_for(_until(lambda: gateway.calls["CloseBatch"] == 1), timeout=10)
        await env.close(sessions[4])  # the last open session; it goes alone, held at the gateway
        await asyncio.wait_for(_until(lambda: gateway.calls["Close"] == 1), timeout=10)
        gateway.release.set()  # the batch ends while the lone close is still in flight
        # The batch's closes have ended here too (then, without the fix, the channel was dropped).
        address = next(iter(env._channels))
        await asyncio.wait_for(_until(lambda: env._closes.owed(address) == 1), timeout=10)
        gateway.release_lone.set()
        await asyncio.wait_for(_until(lambda: len(gateway.closed) == 5), timeout=10)
        assert sorted(gateway.closed) == sorted(sessions)


async def _until(condition: Callable[[], bool]) -> None:
    while not condition():
        await asyncio.sleep(0.01)


async def test_ended_episodes_are_closed_on_their_replicas(replicas: list[RunningServer]) -> None:
    env = client_for(replicas)
    try:
        done = await asyncio.gather(*(episode(env, seed) for seed in range(8)))
    finally:
        await env.aclose()
    for session, replica in done:
        async with make_channel(replica, token=TOKEN) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as gone:
                await env_pb2_grpc.EnvironmentStub(channel).Step(env_pb2.StepRequest(session_id=session, action="1"),
                                                                 timeout=5)
            assert gone.value.code() == grpc.StatusCode.NOT_FOUND
