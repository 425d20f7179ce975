"""Transport security and per-client limits of the shared server bootstrap, on real servers.

TLS and mTLS use certificates generated here (tests/support/certs.py); the limits use a
servicer whose Score waits until the test lets it finish, so calls stay in flight.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arlo.app.redis_server import free_port
from arlo.config import AuthConfig, ConfigError, ServerConfig, TlsConfig, load_config
from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
from arlo.rpc import RunningServer, ServiceBinding, make_channel, setup_logging, start_server
from tests.support.certs import CertAuthority

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tls-test-Secret-7f3a9c1e"
TOKEN_ENV = "ARLO_TEST_SECURITY_TOKEN"
REWARD = "arlo.v1.Reward"
SERVING = health_pb2.HealthCheckResponse.SERVING
OK_REQUEST = reward_pb2.ScoreRequest(reward_fn="exact_match", response="1", reference="1")


class GatedReward(reward_pb2_grpc.RewardServicer):
    """Score holds every call until `release` is set; `entered` counts calls that got in."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.entered = 0

    async def Score(self, request: reward_pb2.ScoreRequest, context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        self.entered += 1
        await self.release.wait()
        return reward_pb2.ScoreResponse(reward=1.0, status=reward_pb2.SCORE_STATUS_OK)


def binding(servicer: reward_pb2_grpc.RewardServicer) -> list[ServiceBinding]:
    return [ServiceBinding(REWARD, reward_pb2_grpc.add_RewardServicer_to_server, servicer)]


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> AuthConfig:
    monkeypatch.setenv(TOKEN_ENV, TOKEN)
    return AuthConfig(token_env=TOKEN_ENV)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict:
    root = tmp_path_factory.mktemp("pki")
    ca, rogue = CertAuthority(root / "ca"), CertAuthority(root / "rogue", name="rogue-ca")
    return {"ca": ca.ca, "server": ca.issue("server"), "client": ca.issue("client", hosts=("arlo-client",)),
            "named": ca.issue("named", hosts=("trainer.arlo.internal",)),
            "rogue_ca": rogue.ca, "rogue_client": rogue.issue("rogue", hosts=("arlo-client",))}


def server_tls(pki: dict, *, mtls: bool, leaf: str = "server") -> TlsConfig:
    return TlsConfig(enabled=True, cert_file=str(pki[leaf].cert), key_file=str(pki[leaf].key),
                     ca_file=str(pki["ca"]) if mtls else "", require_client_cert=mtls)


def client_tls(pki: dict, *, ca: str = "ca", leaf: str | None = "client", server_name: str = "") -> TlsConfig:
    return TlsConfig(enabled=True, ca_file=str(pki[ca]), cert_file=str(pki[leaf].cert) if leaf else "",
                     key_file=str(pki[leaf].key) if leaf else "", server_name=server_name)


async def start(auth: AuthConfig, servicer: reward_pb2_grpc.RewardServicer | None = None, **server_kw) -> RunningServer:
    from services.reward.registry import default_registry
    from services.reward.scoring import Scorer
    from services.reward.server import RewardServicer

    servicer = servicer or RewardServicer(default_registry(), Scorer(timeout_s=5.0))
    return await start_server("test", ServerConfig(port=0, metrics_port=-1, **server_kw), auth, binding(servicer))


@pytest.fixture
async def tls_server(auth: AuthConfig, pki: dict) -> AsyncIterator[RunningServer]:
    running = await start(dataclasses.replace(auth, tls=server_tls(pki, mtls=False)))
    yield running
    await running.stop(None)


@pytest.fixture
async def mtls_server(auth: AuthConfig, pki: dict) -> AsyncIterator[RunningServer]:
    running = await start(dataclasses.replace(auth, tls=server_tls(pki, mtls=True)))
    yield running
    await running.stop(None)


async def score(port: int, tls: TlsConfig | None, host: str = "127.0.0.1") -> reward_pb2.ScoreResponse:
    async with make_channel(f"{host}:{port}", token=TOKEN, tls=tls) as channel:
        return await reward_pb2_grpc.RewardStub(channel).Score(OK_REQUEST, timeout=5)


async def refused(port: int, tls: TlsConfig | None) -> grpc.StatusCode:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await score(port, tls)
    return e.value.code()


# -- TLS / mTLS -----------------------------------------------------------------------------

async def test_tls_server_serves_verified_clients_and_refuses_plaintext(tls_server: RunningServer, pki: dict) -> None:
    assert (await score(tls_server.port, client_tls(pki, leaf=None))).reward == 1.0
    assert (await score(tls_server.port, client_tls(pki), host="localhost")).reward == 1.0
    assert await refused(tls_server.port, None) == grpc.StatusCode.UNAVAILABLE
    # A client that trusts another CA does not accept the server's certificate.
    assert await refused(tls_server.port, client_tls(pki, ca="rogue_ca", leaf=None)) == grpc.StatusCode.UNAVAILABLE


async def test_mtls_needs_a_client_certificate_from_the_ca(mtls_server: RunningServer, pki: dict) -> None:
    assert (await score(mtls_server.port, client_tls(pki))).reward == 1.0
    assert await refused(mtls_server.port, client_tls(pki, leaf=None)) == grpc.StatusCode.UNAVAILABLE
    assert await refused(mtls_server.port, client_tls(pki, leaf="rogue_client")) == grpc.StatusCode.UNAVAILABLE
    assert await refused(mtls_server.port, None) == grpc.StatusCode.UNAVAILABLE


async def test_tls_still_needs_the_bearer_token(mtls_server: RunningServer, pki: dict) -> None:
    async with make_channel(f"127.0.0.1:{mtls_server.port}", token="wrong", tls=client_tls(pki)) as channel:
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await reward_pb2_grpc.RewardStub(channel).Score(OK_REQUEST, timeout=5)
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_server_name_override_checks_the_certificate_name(auth: AuthConfig, pki: dict) -> None:
    running = await start(dataclasses.replace(auth, tls=server_tls(pki, mtls=False, leaf="named")))
    try:
        assert await refused(running.port, client_tls(pki)) == grpc.StatusCode.UNAVAILABLE
        reply = await score(running.port, client_tls(pki, server_name="trainer.arlo.internal"))
        assert reply.reward == 1.0
    finally:
        await running.stop(None)


async def test_unreadable_or_non_pem_files_fail_at_start_naming_the_field(auth: AuthConfig, pki: dict,
                                                                          tmp_path: Path) -> None:
    missing = dataclasses.replace(server_tls(pki, mtls=False), key_file=str(tmp_path / "nope.key"))
    with pytest.raises(ConfigError, match=r"auth\.tls\.key_file: cannot read"):
        await start(dataclasses.replace(auth, tls=missing))
    (tmp_path / "junk.crt").write_text("not a certificate")
    junk = dataclasses.replace(server_tls(pki, mtls=False), cert_file=str(tmp_path / "junk.crt"))
    with pytest.raises(ConfigError, match=r"auth\.tls\.cert_file: .* is not a PEM file"):
        await start(dataclasses.replace(auth, tls=junk))


def test_tls_config_is_validated_at_load() -> None:
    with pytest.raises(ConfigError, match=r"auth\.tls\.cert_file: must be set"):
        load_config(overrides={"auth": {"tls": {"enabled": True}}})
    with pytest.raises(ConfigError, match=r"auth\.tls\.ca_file: must be set with require_client_cert"):
        load_config(overrides={"auth": {"tls": {"enabled": True, "cert_file": "a", "key_file": "b",
                                                "require_client_cert": True}}})
    with pytest.raises(ConfigError, match=r"max_rpcs_per_client: must be >= 0"):
        load_config(overrides={"reward": {"server": {"max_rpcs_per_client": -1}}})


# -- per-client and server-wide limits ------------------------------------------------------

async def wait_for(predicate, timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


async def health(port: int) -> int:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def test_per_client_limit_answers_resource_exhausted_and_spares_other_clients(auth: AuthConfig) -> None:
    gated = GatedReward()
    running = await start(auth, gated, max_rpcs_per_client=2)
    try:
        # Channels of one process to one target share a connection (one peer) unless told not to:
        # the polite client is another connection, as another process would be.
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as greedy, \
                grpc.aio.insecure_channel(f"127.0.0.1:{running.port}",
                                          options=[("grpc.use_local_subchannel_pool", 1)]) as polite:
            stub = reward_pb2_grpc.RewardStub(greedy)
            held = [asyncio.ensure_future(stub.Score(OK_REQUEST, timeout=10)) for _ in range(2)]
            await wait_for(lambda: gated.entered == 2)
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await stub.Score(OK_REQUEST, timeout=5)
            assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "limit 2" in (e.value.details() or "")
            other = asyncio.ensure_future(reward_pb2_grpc.RewardStub(polite).Score(
                OK_REQUEST, timeout=10, metadata=(("authorization", f"Bearer {TOKEN}"),)))
            await wait_for(lambda: gated.entered == 3)
            assert await health(running.port) == SERVING
            gated.release.set()
            replies = await asyncio.gather(*held, other)
            assert [r.reward for r in replies] == [1.0, 1.0, 1.0]
            # The slots are given back: the same client is served again.
            assert (await stub.Score(OK_REQUEST, timeout=5)).reward == 1.0
    finally:
        await running.stop(None)


async def test_server_wide_cap_answers_resource_exhausted_without_crashing(auth: AuthConfig) -> None:
    gated = GatedReward()
    running = await start(auth, gated, max_concurrent_rpcs=2, max_rpcs_per_client=0)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            stub = reward_pb2_grpc.RewardStub(channel)
            held = [asyncio.ensure_future(stub.Score(OK_REQUEST, timeout=10)) for _ in range(2)]
            await wait_for(lambda: gated.entered == 2)
            codes = []
            for _ in range(5):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await stub.Score(OK_REQUEST, timeout=5)
                codes.append(e.value.code())
            assert codes == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5
            gated.release.set()
            assert [r.reward for r in await asyncio.gather(*held)] == [1.0, 1.0]
            assert (await stub.Score(OK_REQUEST, timeout=5)).reward == 1.0
        assert await health(running.port) == SERVING
    finally:
        await running.stop(None)


# -- secrets stay out of logs ---------------------------------------------------------------

async def test_the_token_never_appears_in_logs(auth: AuthConfig, capsys: pytest.CaptureFixture[str],
                                               caplog: pytest.LogCaptureFixture) -> None:
    """In-process: every record at DEBUG, while calls with the right and a wrong token come in."""
    wrong = "Wrong-Token-4d2b8e"
    setup_logging("security-test", "DEBUG")
    try:
        with caplog.at_level(logging.DEBUG):
            running = await start(auth)
            try:
                assert (await score(running.port, None)).reward == 1.0
                async with make_channel(f"127.0.0.1:{running.port}", token=wrong) as channel:
                    with pytest.raises(grpc.aio.AioRpcError):
                        await reward_pb2_grpc.RewardStub(channel).Score(OK_REQUEST, timeout=5)
            finally:
                await running.stop(None)
        err = capsys.readouterr().err
        assert "unauthenticated call" in err  # the logs were captured, at DEBUG
        text = err + "\n".join(r.getMessage() + repr(vars(r)) for r in caplog.records)
        assert TOKEN not in text and wrong not in text
    finally:
        logging.getLogger().handlers.clear()


def test_service_process_never_logs_its_token(tmp_path: Path) -> None:
    """A real `python -m services.reward` with the token in its environment, called right and wrong."""
    log_path = tmp_path / "reward.log"
    port = free_port()
    env = {**os.environ, "ARLO_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_CONFIG", None)
    with log_path.open("w") as log:
        proc = subprocess.Popen([sys.executable, "-m", "services.reward", "--port", str(port), "--metrics-port", "-1"],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        async def exercise() -> None:
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, log_path.read_text()
                try:
                    assert (await score(port, None)).reward == 1.0
                    break
                except grpc.aio.AioRpcError:
                    assert time.monotonic() < deadline, log_path.read_text()
                    await asyncio.sleep(0.2)
            async with make_channel(f"127.0.0.1:{port}", token=TOKEN[:-1]) as channel:
                with pytest.raises(grpc.aio.AioRpcError):
                    await reward_pb2_grpc.RewardStub(channel).Score(OK_REQUEST, timeout=5)

        asyncio.run(exercise())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    text = log_path.read_text()
    assert "serving arlo.v1.Reward" in text
    assert TOKEN not in text and TOKEN[:-1] not in text
