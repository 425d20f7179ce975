"""Per-client concurrency limit: one client connection cannot take every handler slot.

grpc's own `maximum_concurrent_rpcs` caps the whole server (health included); this caps each
peer (a client connection) so one runaway caller gets RESOURCE_EXHAUSTED while the others,
and health probes, are still served.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import grpc

from arlo.rpc.auth import EXEMPT_PREFIXES
from arlo.rpc.handlers import wrap_handler


class ClientLimitInterceptor(grpc.aio.ServerInterceptor):
    """Answers RESOURCE_EXHAUSTED to a call when its peer already has `max_per_client` in flight."""

    def __init__(self, max_per_client: int) -> None:
        if max_per_client < 1:
            raise ValueError(f"max_per_client: must be >= 1, got {max_per_client}")
        self._max = max_per_client
        # Only touched from the server's event loop: no lock needed.
        self._in_flight: dict[str, int] = {}

    def in_flight(self, peer: str) -> int:
        return self._in_flight.get(peer, 0)

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(EXEMPT_PREFIXES):
            return handler
        return wrap_handler(handler, self._slot)

    @asynccontextmanager
    async def _slot(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        peer = context.peer()
        held = self._in_flight.get(peer, 0)
        if held >= self._max:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{held} RPCs already in flight from this client (limit {self._max}); "
                                "retry with backoff")
        with _holding(self._in_flight, peer):
            yield


WATCH_METHOD = "/grpc.health.v1.Health/Watch"


def peer_host(peer: str) -> str:
    """"ipv4:127.0.0.1:5555" -> "ipv4:127.0.0.1": one client machine, whatever its connections."""
    return peer.rsplit(":", 1)[0] if peer.count(":") >= 2 else peer


class WatchLimitInterceptor(grpc.aio.ServerInterceptor):
    """Bounds open health Watch streams per client host and in total (RESOURCE_EXHAUSTED beyond).

    Health is unauthenticated (probes carry no token) and a Watch stream lives until the client
    leaves: ~8,000 of them grew a service by 200 MiB for good (issue 16). Check is not bounded here
    (it ends at once); probes and the supervisor use Check.
    """

    def __init__(self, *, total: int, per_client: int) -> None:
        if total < 1 or per_client < 1:
            raise ValueError(f"watch limits must be >= 1, got total={total} per_client={per_client}")
        self._total, self._per_client = total, per_client
        self._open: dict[str, int] = {}  # event-loop only

    def open_streams(self) -> int:
        return sum(self._open.values())

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method != WATCH_METHOD:
            return handler
        return wrap_handler(handler, self._slot)

    @asynccontextmanager
    async def _slot(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
        host = peer_host(context.peer())
        mine, total = self._open.get(host, 0), self.open_streams()
        if mine >= self._per_client or total >= self._total:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"too many health Watch streams ({mine} from this client, limit {self._per_client}; "
                                f"{total} in all, limit {self._total}); use Check")
        with _holding(self._open, host):
            yield


@contextlib.contextmanager
def _holding(counts: dict[str, int], key: str) -> Iterator[None]:
    """One slot of `key` held for the body; peers come and go, so no entry outlives its last slot."""
    counts[key] = counts.get(key, 0) + 1
    try:
        yield
    finally:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]
