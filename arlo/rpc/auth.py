"""Bearer-token auth: loading the shared token, and the server interceptor that checks it."""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from arlo.config import AuthConfig, ConfigError
from arlo.rpc.handlers import rejecting_handler

log = logging.getLogger(__name__)

# Kubelet's native gRPC probe cannot send headers, so health checks stay open.
EXEMPT_PREFIXES = ("/grpc.health.v1.Health/",)
UNAUTHENTICATED_DETAILS = "missing or invalid bearer token: send metadata 'authorization: Bearer <token>'"


def load_token(auth: AuthConfig) -> str | None:
    """The bearer token: $`auth.token_env`, else the stripped contents of `auth.token_file`.

    None only when `auth.disabled`; with auth on and no token this raises ConfigError, so a
    service never starts open by accident.
    """
    if auth.disabled:
        return None
    token = os.environ.get(auth.token_env, "").strip() if auth.token_env else ""
    source = f"${auth.token_env}"
    if not token and auth.token_file:
        path = Path(auth.token_file)
        try:
            token = path.read_text().strip()
        except OSError as e:
            raise ConfigError(f"auth.token_file: cannot read {path}: {e.strerror or e}") from e
        source = str(path)
    if not token:
        looked = f"${auth.token_env} is unset or empty" if auth.token_env else "auth.token_env is unset"
        looked += f", and {auth.token_file} is empty" if auth.token_file else ", and auth.token_file is unset"
        raise ConfigError(
            f"auth: no bearer token ({looked}). Export {auth.token_env or 'ARLO_TOKEN'}=<secret> "
            "(the same value for every service), set auth.token_file, or set auth.disabled: true "
            "for a local-only run."
        )
    if not (token.isascii() and token.isprintable()):
        raise ConfigError(f"auth: the token from {source} must be printable ASCII (it travels as gRPC metadata)")
    return token


def bearer_ok(metadata: object, expected: bytes) -> bool:
    """True when the first `authorization` entry is `Bearer <expected>` (scheme case-insensitive)."""
    for key, value in metadata or ():  # type: ignore[attr-defined]
        if key != "authorization":
            continue
        if isinstance(value, bytes):
            return False
        scheme, _, token = value.partition(" ")
        # compare_digest on bytes: its time does not depend on where the tokens first differ.
        return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), expected)
    return False


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call without the token, except health checks.

    Unknown methods stay UNIMPLEMENTED (the lookup returns no handler); that reveals nothing
    reflection does not already guard.
    """

    def __init__(self, token: str) -> None:
        self._expected = token.encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(EXEMPT_PREFIXES):
            return handler
        if bearer_ok(handler_call_details.invocation_metadata, self._expected):
            return handler
        log.debug("unauthenticated call to %s", method)
        return rejecting_handler(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_DETAILS)
