"""The one server bootstrap every service uses: grpc.aio server, health, reflection, auth,
metrics, request ids, and graceful shutdown on SIGTERM."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from prometheus_client import CollectorRegistry

from arlo.background import MustRestart, TaskGroup
from arlo.config import AuthConfig, ConfigError, ServerConfig
from arlo.gc_pauses import GcPauses, freeze_startup
from arlo.rpc.auth import AuthInterceptor, load_token
from arlo.rpc.concurrency import ClientLimitInterceptor, WatchLimitInterceptor
from arlo.rpc.interceptors import ErrorInterceptor, MetricsInterceptor, RequestIdInterceptor
from arlo.rpc.metrics import MetricsHttpServer, RpcMetrics
from arlo.rpc.tls import server_credentials

if TYPE_CHECKING:
    from arlo.tracing import Tracing

log = logging.getLogger(__name__)

# Clients resolve DNS (a headless Service's pod IPs) only when connecting: ageing connections
# out makes them re-resolve and spread over new replicas. In-flight calls, including long
# streams, are not cut (the age grace is unbounded).
MAX_CONNECTION_AGE_MS = 5 * 60 * 1000


@dataclass(frozen=True, slots=True)
class ServiceBinding:
    """One proto service to serve: its full name, the generated add-function, the servicer.

    Not keyword-only, so both `ServiceBinding(name, add, servicer)` and keywords work.
    """

    name: str
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any


class RunningServer:
    """A started server. `stop()` flips health to NOT_SERVING, then drains for `grace` seconds."""

    def __init__(self, *, service: str, server: grpc.aio.Server, port: int, metrics_http: MetricsHttpServer | None,
                 registry: CollectorRegistry, health: health_aio.HealthServicer) -> None:
        self.service = service
        self.port = port
        self.metrics_port = metrics_http.port if metrics_http else None
        self.registry = registry
        self.health = health
        self._server = server
        self._metrics_http = metrics_http
        self._stopped: asyncio.Future[None] | None = None

    async def stop(self, grace: float | None = None) -> None:
        """Idempotent; a second caller waits for the first stop to finish."""
        if self._stopped is not None:
            await asyncio.shield(self._stopped)
            return
        self._stopped = asyncio.get_running_loop().create_future()
        try:
            log.info("%s: stopping (grace %ss)", self.service, grace)
            await self.health.enter_graceful_shutdown()
            try:
                await self._server.stop(grace)
            finally:
                # /metrics stays up through the drain, so the last numbers can still be scraped.
                if self._metrics_http is not None:
                    await self._metrics_http.close()
        finally:
            self._stopped.set_result(None)

    async def wait(self) -> None:
        """Returns when the server has terminated. Safe to cancel."""
        # Cancelling grpc.aio's wait_for_termination() also cancels the server's own shutdown
        # (a shared future): a later stop() then dies with CancelledError. Shield it.
        await asyncio.shield(self._server.wait_for_termination())


def _server_options(cfg: ServerConfig) -> list[tuple[str, Any]]:
    return [
        ("grpc.max_send_message_length", cfg.max_message_bytes),
        ("grpc.max_receive_message_length", cfg.max_message_bytes),
        # gRPC sets SO_REUSEPORT by default: a second server would silently share a busy port.
        ("grpc.so_reuseport", 0),
        ("grpc.max_connection_age_ms", MAX_CONNECTION_AGE_MS),
    ]


def _check_bindings(bindings: Sequence[ServiceBinding]) -> None:
    names = [b.name for b in bindings]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate service bindings: {names}")
    pool = descriptor_pool.Default()
    for name in names:
        try:
            pool.FindServiceByName(name)
        except KeyError:
            raise ValueError(f"ServiceBinding name {name!r} is not a known proto service "
                             "(use the full name, e.g. 'arlo.v1.Reward')") from None


async def start_server(service: str, server_cfg: ServerConfig, auth: AuthConfig,
                       bindings: Sequence[ServiceBinding], *,
                       registry: CollectorRegistry | None = None, tracing: Tracing | None = None) -> RunningServer:
    """Starts serving `bindings` plus health and reflection; returns once the port is bound.
    With `tracing`, every call but health and reflection is a span (a child of the caller's).

    Raises ConfigError when auth is on and no token is found, OSError when a port is busy.
    """
    _check_bindings(bindings)
    token = load_token(auth)
    registry = registry if registry is not None else CollectorRegistry()
    interceptors: list[grpc.aio.ServerInterceptor] = [RequestIdInterceptor(), MetricsInterceptor(RpcMetrics(registry, service))]
    if tracing is not None:
        interceptors.insert(0, tracing.server_interceptor())  # outermost: its span covers the rest
    if token is not None:
        interceptors.append(AuthInterceptor(token))
    if server_cfg.max_rpcs_per_client:
        interceptors.append(ClientLimitInterceptor(server_cfg.max_rpcs_per_client))
    interceptors.append(WatchLimitInterceptor(total=server_cfg.max_health_watches,
                                              per_client=server_cfg.max_health_watches_per_client))
    interceptors.append(ErrorInterceptor())
    credentials = server_credentials(auth.tls) if auth.tls.enabled else None  # a bad file fails before binding
    server = grpc.aio.server(interceptors=interceptors, options=_server_options(server_cfg),
                             maximum_concurrent_rpcs=server_cfg.max_concurrent_rpcs or None)

    health = health_aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    for binding in bindings:
        binding.add_to_server(binding.servicer, server)
    health_name = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
    reflection.enable_server_reflection([*(b.name for b in bindings), health_name, reflection.SERVICE_NAME], server)

    address = f"{server_cfg.host}:{server_cfg.port}"
    try:
        port = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
    except RuntimeError as e:  # grpc raises RuntimeError("Failed to bind ...")
        raise OSError(f"{service}: cannot listen on {address} (port in use?): {e}") from e
    metrics_http = None
    if server_cfg.metrics_port >= 0:
        metrics_http = MetricsHttpServer.start(server_cfg.host, server_cfg.metrics_port, registry)
    try:
        await server.start()
        # Not SERVING until every binding is registered and marked: probes never see a half-up server.
        await health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        for binding in bindings:
            await health.set(binding.name, health_pb2.HealthCheckResponse.SERVING)
        await health.set("", health_pb2.HealthCheckResponse.SERVING)
    except BaseException:
        await server.stop(None)
        if metrics_http is not None:
            await metrics_http.close()
        raise
    running = RunningServer(service=service, server=server, port=port, metrics_http=metrics_http,
                            registry=registry, health=health)
    tls = ("mTLS" if auth.tls.require_client_cert else "TLS") if credentials else "plaintext"
    log.info("%s: serving %s on %s:%d (%s, metrics port %s, auth %s)", service, ", ".join(b.name for b in bindings),
             server_cfg.host, port, tls, running.metrics_port, "on" if token else "OFF")
    return running


def run_until_signal(start: Callable[[], Awaitable[RunningServer]], *,
                     on_stop: Callable[[], Awaitable[None]] | None = None, grace_s: float = 5.0,
                     tasks: TaskGroup | None = None) -> None:
    """Runs a service until SIGTERM/SIGINT (or its server ends), then shuts down gracefully.

    Health turns NOT_SERVING first, in-flight calls get `grace_s`, then `on_stop` runs. A
    startup ConfigError or busy port exits with a one-line message instead of a traceback.
    `tasks`: the service's background tasks; one that stops with MustRestart (arlo/background.py)
    stops the service the same way but without the grace, then the process exits 1 saying why,
    so that its supervisor restarts it from durable state.
    """
    try:
        asyncio.run(_serve(start, on_stop, grace_s, tasks))
    except ConfigError as e:
        log.error("bad config: %s", e)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from e
    except OSError as e:
        log.error("cannot start: %s", e, exc_info=True)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from e
    except MustRestart as e:  # while starting (a fenced write refused: the run was taken over)
        log.critical("stopping to be restarted: %s", e)
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    if tasks is not None and tasks.fatal is not None:
        print(f"error: {tasks.fatal}", file=sys.stderr)
        raise SystemExit(1)


async def _serve(start: Callable[[], Awaitable[RunningServer]],
                 on_stop: Callable[[], Awaitable[None]] | None, grace_s: float, tasks: TaskGroup | None) -> None:
    loop = asyncio.get_running_loop()
    stop_requested = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop_requested.set)
    pauses = None
    try:
        running = await start()
        if tasks is not None:
            tasks.on_fatal = lambda _: stop_requested.set()
            if tasks.fatal is not None:  # while starting
                stop_requested.set()
        # Start-up's objects (imports, the model, the warm-up) out of the collector's way (arlo/gc_pauses.py).
        frozen = freeze_startup()
        pauses = GcPauses(running.registry)
        log.info("%s: %d start-up objects frozen out of the garbage collector's walks", running.service, frozen)
        waiters = [asyncio.create_task(stop_requested.wait()), asyncio.create_task(running.wait())]
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for task in waiters:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        fatal = tasks.fatal if tasks is not None else None
        log.info("%s: %s", running.service, f"stopping to be restarted: {fatal}" if fatal else
                 "signal received" if stop_requested.is_set() else "server ended")
        # A fatal stop does not drain: what this process would still do can no longer be trusted
        # (its weights went bad, or another trainer took its run and its unfenced writes must end).
        await running.stop(0.0 if fatal else grace_s)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
        if pauses is not None:
            pauses.close()
            log.info(pauses.summary())
        if on_stop is not None:
            await on_stop()
