"""Wrapping an RpcMethodHandler's behaviour, for any of the four RPC kinds.

grpc.aio server interceptors only see the method name and metadata; to observe the outcome
of a call (status, latency, exceptions) an interceptor must return a new handler whose
behaviour runs the original inside an async context manager. Response-streaming
behaviours come in two shapes (async generators, and coroutines that call
`context.write`); the wrapper keeps the shape, because grpc.aio dispatches on it.
"""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from typing import Any

import grpc

# around(request_or_iterator, context) -> async context manager entered for the whole call.
Around = Callable[[Any, grpc.aio.ServicerContext], AbstractAsyncContextManager[None]]

_KINDS = {
    (False, False): ("unary_unary", grpc.unary_unary_rpc_method_handler),
    (False, True): ("unary_stream", grpc.unary_stream_rpc_method_handler),
    (True, False): ("stream_unary", grpc.stream_unary_rpc_method_handler),
    (True, True): ("stream_stream", grpc.stream_stream_rpc_method_handler),
}

_KEEP = object()


def wrap_handler(handler: grpc.RpcMethodHandler, around: Around, *,
                 request_deserializer: Any = _KEEP) -> grpc.RpcMethodHandler:
    """A handler like `handler` whose behaviour runs inside `around(request, context)`."""
    attr, factory = _KINDS[(handler.request_streaming, handler.response_streaming)]
    behavior = getattr(handler, attr)
    deserializer = handler.request_deserializer if request_deserializer is _KEEP else request_deserializer
    return factory(_wrap_behavior(behavior, around), request_deserializer=deserializer,
                   response_serializer=handler.response_serializer)


def _wrap_behavior(behavior: Callable[..., Any], around: Around) -> Callable[..., Any]:
    if inspect.isasyncgenfunction(behavior):
        async def stream(request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
            async with around(request, context):
                async for response in behavior(request, context):
                    yield response

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext) -> Any:
        async with around(request, context):
            result = behavior(request, context)
            if inspect.isawaitable(result):
                result = await result
            return result

    return call


def rejecting_handler(handler: grpc.RpcMethodHandler, code: grpc.StatusCode, details: str) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that fails every call without reading the request.

    No deserializer: a rejected caller's bytes are never parsed.
    """
    attr, factory = _KINDS[(handler.request_streaming, handler.response_streaming)]

    async def reject(request: Any, context: grpc.aio.ServicerContext) -> Any:
        await context.abort(code, details)

    return factory(reject, request_deserializer=None, response_serializer=handler.response_serializer)
