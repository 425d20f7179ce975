"""The shared server bootstrap (arlo.rpc) on real servers, ports picked by the OS."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
import urllib.request
from collections.abc import AsyncIterator

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from arlo.config import AuthConfig, ConfigError, RunConfig, ServerConfig
from arlo.proto.v1 import env_pb2, env_pb2_grpc, reward_pb2, reward_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import (
    RunningServer,
    ServiceBinding,
    current_request_id,
    load_token,
    make_channel,
    setup_logging,
    start_server,
    use_request_id,
)
from services.env_gateway.__main__ import build_gateway
from services.env_gateway.server import EnvironmentServicer
from services.reward.registry import default_registry
from services.reward.scoring import Scorer
from services.reward.server import RewardServicer

TOKEN = "s3cret-token"
TOKEN_ENV = "ARLO_TEST_BOOTSTRAP_TOKEN"
REWARD = "arlo.v1.Reward"
ENVIRONMENT = "arlo.v1.Environment"
TRAINER = "arlo.v1.Trainer"
HEALTH = "grpc.health.v1.Health"
REFLECTION = "grpc.reflection.v1alpha.ServerReflection"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def identity(x: bytes) -> bytes:
    return x


class RecordingReward(reward_pb2_grpc.RewardServicer):
    """Score records the request id it saw; reward_fn "boom" raises like a buggy handler."""

    def __init__(self) -> None:
        self.request_ids: list[str | None] = []

    async def Score(self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        self.request_ids.append(current_request_id())
        if request.reward_fn == "boom":
            raise RuntimeError("kaboom")
        return reward_pb2.ScoreResponse(reward=1.0, status=reward_pb2.SCORE_STATUS_OK)


class ChunkTrainer(trainer_pb2_grpc.TrainerServicer):
    """A server-streaming handler written as an async generator."""

    async def PullWeights(self, request: trainer_pb2.PullWeightsRequest,
                          context: grpc.aio.ServicerContext) -> AsyncIterator[trainer_pb2.PullWeightsResponse]:
        for i in range(3):
            yield trainer_pb2.PullWeightsResponse(offset=i, data=b"x")


def bindings() -> list[ServiceBinding]:
    """The real reward and env_gateway servicers, both on one server."""
    return [
        ServiceBinding(name=REWARD, add_to_server=reward_pb2_grpc.add_RewardServicer_to_server,
                       servicer=RewardServicer(default_registry(), Scorer(timeout_s=5.0))),
        ServiceBinding(name=ENVIRONMENT, add_to_server=env_pb2_grpc.add_EnvironmentServicer_to_server,
                       servicer=EnvironmentServicer(build_gateway(RunConfig()))),
    ]


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> AuthConfig:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return AuthConfig(token_env=TOKEN_ENV)


@pytest.fixture
async def server(auth: AuthConfig) -> AsyncIterator[RunningServer]:
    running = await start_server("test", ServerConfig(port=0, metrics_port=0), auth, bindings())
    yield running
    await running.stop(None)


async def health_status(port: int, service: str = "") -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=5)
        return response.status


async def test_health_serving_for_every_service_without_token(server: RunningServer) -> None:
    for service in ("", REWARD, ENVIRONMENT):
        assert await health_status(server.port, service) == SERVING


async def test_health_turns_not_serving_when_stop_begins(auth: AuthConfig) -> None:
    running = await start_server("test", ServerConfig(port=0, metrics_port=-1), auth, bindings())
    assert running.metrics_port is None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{running.port}") as channel:
        watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest(service=REWARD))
        assert (await watch.read()).status == SERVING
        stopping = asyncio.create_task(running.stop(grace=0.5))
        assert (await asyncio.wait_for(watch.read(), 5)).status == NOT_SERVING
        await asyncio.wait_for(stopping, 5)
    await asyncio.wait_for(running.wait(), 5)


async def test_cancelling_wait_does_not_break_stop(auth: AuthConfig) -> None:
    running = await start_server("test", ServerConfig(port=0, metrics_port=0), auth, bindings())
    waiter = asyncio.create_task(running.wait())
    await asyncio.sleep(0.05)
    waiter.cancel()
    await asyncio.gather(waiter, return_exceptions=True)
    await asyncio.wait_for(running.stop(grace=1.0), 5)
    await asyncio.wait_for(running.stop(grace=1.0), 5)  # idempotent
    await asyncio.wait_for(running.wait(), 5)


async def test_reflection_lists_services(server: RunningServer) -> None:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        await call.write(reflection_pb2.ServerReflectionRequest(list_services=""))
        response = await call.read()
        await call.done_writing()
    names = {s.name for s in response.list_services_response.service}
    assert {REWARD, ENVIRONMENT, HEALTH, REFLECTION} <= names


async def test_reflection_needs_the_token(server: RunningServer) -> None:
    """The call is refused on its metadata, before any message: read without writing. (A write
    raced the refusal under load: gRPC core failed the send and the call ended INTERNAL, not
    UNAUTHENTICATED.)"""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        call = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(timeout=5)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


def _methods(service: str) -> list[str]:
    module = {REWARD: reward_pb2, ENVIRONMENT: env_pb2}[service]
    descriptor = module.DESCRIPTOR.services_by_name[service.rsplit(".", 1)[1]]
    return [f"/{service}/{m.name}" for m in descriptor.methods]


@pytest.mark.parametrize("metadata", [(), (("authorization", "Bearer wrong"),), (("authorization", TOKEN),)],
                         ids=["no-token", "wrong-token", "no-scheme"])
async def test_every_rpc_but_health_needs_the_token(server: RunningServer, metadata: tuple) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        for method in _methods(REWARD) + _methods(ENVIRONMENT):
            call = channel.unary_unary(method, request_serializer=identity, response_deserializer=identity)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await call(b"", metadata=metadata, timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED, method
        assert await health_status(server.port) == SERVING


async def test_token_accepted_with_any_scheme_case(server: RunningServer) -> None:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        reply = await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(),
                                               metadata=(("authorization", f"bearer {TOKEN}"),), timeout=5)
    assert [f.name for f in reply.functions] == ["exact_match"]


async def test_metrics_endpoint_counts_calls(server: RunningServer) -> None:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        stub = reward_pb2_grpc.RewardStub(channel)
        await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
        await stub.ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest(), timeout=5)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
        with pytest.raises(grpc.aio.AioRpcError):
            await reward_pb2_grpc.RewardStub(channel).ListRewardFunctions(reward_pb2.ListRewardFunctionsRequest())
    assert server.metrics_port
    text = await asyncio.to_thread(
        lambda: urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5).read().decode())
    labels = {"service": "test", "method": "/arlo.v1.Reward/ListRewardFunctions"}
    assert scraped(text, "arlo_rpc_requests_total", {**labels, "code": "OK"}) == 2.0
    assert scraped(text, "arlo_rpc_requests_total", {**labels, "code": "UNAUTHENTICATED"}) == 1.0
    assert scraped(text, "arlo_rpc_latency_seconds_count", labels) == 3.0


def scraped(text: str, name: str, labels: dict[str, str]) -> float | None:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and sample.labels == labels:
                return sample.value
    return None


async def test_oversized_message_is_resource_exhausted(auth: AuthConfig) -> None:
    running = await start_server("test", ServerConfig(port=0, metrics_port=-1, max_message_bytes=64 * 1024),
                                 auth, bindings())
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(reward_pb2.ScoreRequest(reward_fn="exact_match", response="x" * 100_000), timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            reply = await stub.Score(reward_pb2.ScoreRequest(reward_fn="exact_match", response="a", reference="a"),
                                     timeout=5)
            assert reply.reward == 1.0
        assert await health_status(running.port) == SERVING
    finally:
        await running.stop(None)


async def test_garbage_bytes_are_invalid_argument(server: RunningServer) -> None:
    async with make_channel(f"127.0.0.1:{server.port}", token=TOKEN) as channel:
        raw = channel.unary_unary("/arlo.v1.Reward/Score", request_serializer=identity, response_deserializer=identity)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await raw(b"\xff\xff\xff\xff\x0fnot a protobuf", timeout=5)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a valid protobuf" in (e.value.details() or "")
        reply = await reward_pb2_grpc.RewardStub(channel).Score(
            reward_pb2.ScoreRequest(reward_fn="exact_match", response="1", reference="1"), timeout=5)
        assert reply.status == reward_pb2.SCORE_STATUS_OK
    assert await health_status(server.port) == SERVING


async def test_handler_exception_is_internal_with_logged_traceback(
        auth: AuthConfig, caplog: pytest.LogCaptureFixture) -> None:
    servicer = RecordingReward()
    running = await start_server("test", ServerConfig(port=0, metrics_port=-1), auth, [
        ServiceBinding(REWARD, reward_pb2_grpc.add_RewardServicer_to_server, servicer)])
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            with caplog.at_level(logging.ERROR), pytest.raises(grpc.aio.AioRpcError) as e:
                with use_request_id("req-boom"):
                    await stub.Score(reward_pb2.ScoreRequest(reward_fn="boom"), timeout=5)
            assert e.value.code() == grpc.StatusCode.INTERNAL
            assert "req-boom" in (e.value.details() or "")
            assert "kaboom" not in (e.value.details() or "")  # internals stay in the log
            assert any(r.exc_info and "kaboom" in str(r.exc_info[1]) for r in caplog.records)
            assert (await stub.Score(reward_pb2.ScoreRequest(reward_fn="ok"), timeout=5)).reward == 1.0
        assert await health_status(running.port) == SERVING
    finally:
        await running.stop(None)


async def test_request_id_is_forwarded_or_generated(auth: AuthConfig) -> None:
    servicer = RecordingReward()
    running = await start_server("test", ServerConfig(port=0, metrics_port=-1), auth, [
        ServiceBinding(REWARD, reward_pb2_grpc.add_RewardServicer_to_server, servicer)])
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            with use_request_id("episode-42"):
                await stub.Score(reward_pb2.ScoreRequest(), timeout=5)
            await stub.Score(reward_pb2.ScoreRequest(), timeout=5)
        assert servicer.request_ids[0] == "episode-42"
        assert servicer.request_ids[1] and servicer.request_ids[1] != "episode-42"
    finally:
        await running.stop(None)


async def test_server_streaming_through_interceptors(auth: AuthConfig) -> None:
    running = await start_server("test", ServerConfig(port=0, metrics_port=-1), auth, [
        ServiceBinding(TRAINER, trainer_pb2_grpc.add_TrainerServicer_to_server, ChunkTrainer())])
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            call = trainer_pb2_grpc.TrainerStub(channel).PullWeights(trainer_pb2.PullWeightsRequest(), timeout=5)
            offsets = [chunk.offset async for chunk in call]
        assert offsets == [0, 1, 2]
        value = running.registry.get_sample_value(
            "arlo_rpc_requests_total", {"service": "test", "method": "/arlo.v1.Trainer/PullWeights", "code": "OK"})
        assert value == 1.0
    finally:
        await running.stop(None)


async def test_auth_disabled_serves_without_token() -> None:
    running = await start_server("test", ServerConfig(port=0, metrics_port=-1), AuthConfig(disabled=True), bindings())
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=None) as channel:
            reply = await reward_pb2_grpc.RewardStub(channel).ListRewardFunctions(
                reward_pb2.ListRewardFunctionsRequest(), timeout=5)
        assert reply.functions
    finally:
        await running.stop(None)


async def test_busy_port_is_a_clear_error(server: RunningServer, auth: AuthConfig) -> None:
    with pytest.raises(OSError, match="cannot listen"):
        await start_server("test", ServerConfig(port=server.port, metrics_port=-1), auth, bindings())


async def test_unknown_binding_name_is_rejected(auth: AuthConfig) -> None:
    with pytest.raises(ValueError, match="not a known proto service"):
        await start_server("test", ServerConfig(port=0, metrics_port=-1), auth, [
            ServiceBinding("arlo.v1.Rewards", reward_pb2_grpc.add_RewardServicer_to_server, RecordingReward())])


def test_load_token_sources(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token(AuthConfig(token_env=TOKEN_ENV, disabled=True)) is None
    with pytest.raises(ConfigError, match=TOKEN_ENV) as e:
        load_token(AuthConfig(token_env=TOKEN_ENV))
    assert "auth.disabled" in str(e.value)
    token_file = tmp_path / "token"
    token_file.write_text("  from-file\n")
    assert load_token(AuthConfig(token_env=TOKEN_ENV, token_file=str(token_file))) == "from-file"
    monkeypatch.setenv(TOKEN_ENV, "from-env")
    assert load_token(AuthConfig(token_env=TOKEN_ENV, token_file=str(token_file))) == "from-env"
    monkeypatch.delenv(TOKEN_ENV)
    with pytest.raises(ConfigError, match="cannot read"):
        load_token(AuthConfig(token_env=TOKEN_ENV, token_file=str(tmp_path / "missing")))
    token_file.write_text("\n")
    with pytest.raises(ConfigError, match="no bearer token"):
        load_token(AuthConfig(token_env=TOKEN_ENV, token_file=str(token_file)))


async def test_start_server_refuses_to_start_open(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(ConfigError):
        await start_server("test", ServerConfig(port=0, metrics_port=-1), AuthConfig(token_env=TOKEN_ENV), bindings())


def test_metrics_port_busy_is_a_clear_error() -> None:
    from prometheus_client import CollectorRegistry

    from arlo.rpc.metrics import MetricsHttpServer

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(OSError, match="cannot serve /metrics"):
            MetricsHttpServer.start("127.0.0.1", s.getsockname()[1], CollectorRegistry())


def test_setup_logging_writes_json_lines_with_the_request_id(capsys: pytest.CaptureFixture[str]) -> None:
    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    try:
        setup_logging("demo", "DEBUG")
        setup_logging("demo", "DEBUG")  # idempotent: one handler, one line per record
        with use_request_id("rid-1"):
            logging.getLogger("arlo.test").info("hello %s", "world", extra={"step": 3})
        try:
            raise ValueError("bad")
        except ValueError:
            logging.getLogger("arlo.test").exception("failed")
    finally:
        root.handlers[:] = before
        root.setLevel(level)
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines())
    assert {k: first[k] for k in ("level", "service", "logger", "msg", "request_id", "step")} == {
        "level": "INFO", "service": "demo", "logger": "arlo.test", "msg": "hello world", "request_id": "rid-1", "step": 3}
    assert first["ts"].endswith("+00:00")
    assert second["request_id"] is None and "ValueError: bad" in second["exc"]
    with pytest.raises(ValueError, match="log level"):
        setup_logging("demo", "LOUD")
