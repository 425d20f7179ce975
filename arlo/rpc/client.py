"""Client channels to arlo services: bearer token, request-id forwarding, round-robin LB, TLS,
and trace context when the caller traces."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import grpc

from arlo.config import TlsConfig
from arlo.rpc.logs import REQUEST_ID_HEADER, current_request_id
from arlo.rpc.tls import channel_credentials, channel_options

if TYPE_CHECKING:
    from arlo.tracing import Tracing

# pick_first (the default) sent every call to one of three servers; round_robin spreads a
# dns:/// target's addresses (a headless Service's pods).
SERVICE_CONFIG = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})


class _CallMetadata:
    """Adds `authorization` and `x-request-id` to a call's metadata."""

    def __init__(self, token: str | None) -> None:
        self._auth = ("authorization", f"Bearer {token}") if token else None

    def _details(self, details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
        metadata = list(details.metadata or ())
        keys = {key for key, _ in metadata}
        if self._auth is not None and "authorization" not in keys:
            metadata.append(self._auth)
        rid = current_request_id()
        if rid is not None and REQUEST_ID_HEADER not in keys:
            metadata.append((REQUEST_ID_HEADER, rid))
        return grpc.aio.ClientCallDetails(method=details.method, timeout=details.timeout,
                                          metadata=grpc.aio.Metadata(*metadata), credentials=details.credentials,
                                          wait_for_ready=details.wait_for_ready)


# grpc.aio files each interceptor under the FIRST kind it is an instance of (an if/elif
# chain), so one class implementing all four kinds would only see unary-unary calls.
class _UnaryUnary(_CallMetadata, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation: Callable[..., Awaitable[Any]],
                                    client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _UnaryStream(_CallMetadata, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation: Callable[..., Awaitable[Any]],
                                     client_call_details: grpc.aio.ClientCallDetails, request: Any) -> Any:
        return await continuation(self._details(client_call_details), request)


class _StreamUnary(_CallMetadata, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation: Callable[..., Awaitable[Any]],
                                     client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


class _StreamStream(_CallMetadata, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation: Callable[..., Awaitable[Any]],
                                      client_call_details: grpc.aio.ClientCallDetails, request_iterator: Any) -> Any:
        return await continuation(self._details(client_call_details), request_iterator)


def make_channel(target: str, *, token: str | None, max_message_bytes: int = 64 * 1024 * 1024,
                 tls: TlsConfig | None = None, tracing: Tracing | None = None) -> grpc.aio.Channel:
    """An aio channel to `target` ("host:port" or "dns:///name:port"); TLS when `tls.enabled`.

    Create it inside the running event loop that will use it (grpc.aio binds to that loop),
    and after any child processes are started (gRPC does not survive fork). With `tracing`, each
    call is a client span and carries its context to the server.
    """
    options: list[tuple[str, Any]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.service_config", SERVICE_CONFIG),
        # Subchannels of its own, not gRPC's process-wide pool: there, a new channel to a server
        # restarted on the same address (the supervisor restarts a service on its port; a test's
        # server gets a port an earlier one had) shares the subchannel another, older channel
        # left in reconnect backoff, and fails UNAVAILABLE ("connection refused") for up to
        # minutes though the server is up (tests/contract/test_rpc_channels.py).
        ("grpc.use_local_subchannel_pool", 1),
    ]
    interceptors: list[Any] = [kind(token) for kind in (_UnaryUnary, _UnaryStream, _StreamUnary, _StreamStream)]
    if tracing is not None:
        interceptors += tracing.client_interceptors()
    if tls is not None and tls.enabled:
        return grpc.aio.secure_channel(target, channel_credentials(tls), options=options + channel_options(tls),
                                       interceptors=interceptors)
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
