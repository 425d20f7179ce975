"""The gateway's expected failures and the gRPC status each is answered with: the one table the
servicer applies to Reset, Step and StepBatch, and that the in-process adapter of the tests
(tests/support/inprocess.py) applies so the agent loop sees the codes a client would. Anything
else an environment raises is a bug, answered INTERNAL."""

from __future__ import annotations

import grpc

from services.env_gateway.envs.base import EnvUnavailableError, EpisodeOverError
from services.env_gateway.gateway import InvalidConfigError, UnknownEnvError
from services.env_gateway.remote import RemoteError
from services.env_gateway.sessions import SessionBusyError, SessionLimitError, SessionNotFoundError

STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (UnknownEnvError, grpc.StatusCode.NOT_FOUND),
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (InvalidConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (EpisodeOverError, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionBusyError, grpc.StatusCode.ABORTED),
    (SessionLimitError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EnvUnavailableError, grpc.StatusCode.UNAVAILABLE),
)


def status_of(error: BaseException) -> grpc.StatusCode | None:
    """The status an expected failure is answered with (a remote backend's failure carries its
    own); None for a bug."""
    if isinstance(error, RemoteError):
        return error.code
    return next((code for kind, code in STATUS if isinstance(error, kind)), None)
