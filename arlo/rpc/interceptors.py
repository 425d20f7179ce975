"""Server interceptors for cross-cutting concerns: request ids, metrics, error mapping.

Order matters (the first interceptor is the outermost): request id, then metrics (so
rejected calls are counted too), then auth, then the per-client limit (concurrency.py), then
error mapping next to the handler. Each
wraps the handler's behaviour (see handlers.py), because grpc.aio interceptors cannot see a
call's outcome otherwise.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from arlo.rpc.handlers import wrap_handler
from arlo.rpc.logs import (
    REQUEST_ID_HEADER,
    current_request_id,
    new_request_id,
    set_request_id,
    valid_request_id,
)
from arlo.rpc.metrics import RpcMetrics

log = logging.getLogger(__name__)

Continuation = Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]]


class RequestIdInterceptor(grpc.aio.ServerInterceptor):
    """Sets the request id for the call from `x-request-id`, or a fresh one.

    grpc.aio runs all interceptors and the handler of one call in the same contextvars
    Context, so setting the ContextVar here is enough.
    """

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        rid = None
        for key, value in handler_call_details.invocation_metadata or ():
            if key == REQUEST_ID_HEADER and isinstance(value, str) and valid_request_id(value):
                rid = value
                break
        set_request_id(rid or new_request_id())
        return await continuation(handler_call_details)


def _code_name(code: grpc.StatusCode | None, default: str) -> str:
    return code.name if isinstance(code, grpc.StatusCode) else default


class MetricsInterceptor(grpc.aio.ServerInterceptor):
    """Counts each call by final status code and observes its latency."""

    def __init__(self, metrics: RpcMetrics) -> None:
        self._metrics = metrics

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            # Unknown methods are not counted: their names come from callers (label cardinality).
            return None
        method = handler_call_details.method
        metrics = self._metrics

        @asynccontextmanager
        async def observe(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[None]:
            start = time.perf_counter()
            code = "UNKNOWN"
            try:
                yield
                code = _code_name(context.code(), "OK")
            except grpc.aio.AbortError:
                code = _code_name(context.code(), "UNKNOWN")
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            finally:
                metrics.observe(method, code, time.perf_counter() - start)

        return wrap_handler(handler, observe)


@dataclass(frozen=True, slots=True)
class Undecodable:
    """Stands in for a request whose bytes did not parse, so the handler wrapper can say so."""

    error: str


def _tolerant(deserializer: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as e:  # DecodeError, or anything a custom deserializer raises
            return Undecodable(f"{type(e).__name__}: {e}")

    return deserialize


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Maps failures to clear statuses: unparsable request -> INVALID_ARGUMENT; an unexpected
    exception in a handler -> INTERNAL with the traceback logged (grpc.aio would answer UNKNOWN
    with the exception text, leaking internals and hiding the traceback)."""

    async def intercept_service(self, continuation: Continuation,
                                handler_call_details: grpc.HandlerCallDetails) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        deserializer = handler.request_deserializer
        if deserializer is not None and not handler.request_streaming:
            # grpc.aio parses unary requests before any wrapper runs; a parse error there
            # would become UNKNOWN, so parse leniently and reject in the wrapper.
            deserializer = _tolerant(deserializer)
        return wrap_handler(handler, lambda req, ctx: _guard(req, ctx, method), request_deserializer=deserializer)


@asynccontextmanager
async def _guard(request: Any, context: grpc.aio.ServicerContext, method: str) -> AsyncIterator[None]:
    if isinstance(request, Undecodable):
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                            f"{method}: request is not a valid protobuf message ({request.error})")
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except DecodeError as e:  # a malformed message in a request stream
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{method}: request is not a valid protobuf message ({e})")
    except Exception:
        log.exception("unhandled exception in %s", method)
        await context.abort(grpc.StatusCode.INTERNAL,
                            f"internal error in {method} (request id {current_request_id()}); see the server log")
