"""A test's own servicer (scripted delays, failures, held answers) on a real gRPC server at an
ephemeral port: the peer a client under test talks to when the real service cannot be made to
misbehave on cue."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc


@contextlib.asynccontextmanager
async def scripted_server(add_servicer: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> AsyncIterator[str]:
    """Serves `servicer` (added with the generated `add_..._to_server`); yields its address."""
    server = grpc.aio.server()
    add_servicer(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)
