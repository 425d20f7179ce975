"""Remote environments: env names served by another `arlo.v1.Environment` service, proxied.

Per backend: a concurrency limit (more callers wait, within their deadline), a deadline on
every call (the config's timeout, shortened to the caller's remaining time: gRPC does not
propagate deadlines), retries only for idempotent calls (ListEnvironments, Close; never
Reset or Step, which would start a second episode or apply an action twice), and a circuit
breaker so a dead backend fails fast with UNAVAILABLE instead of costing every caller a timeout.

Session affinity is in the id: a proxied session is `r<backend>:<remote id>`. Local ids are
32 hex digits, so the two never collide, and any gateway replica can route a step.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Coroutine, Sequence
from typing import Any

import grpc

from arlo.config import ConfigError, RemoteEnvConfig
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from services.env_gateway.breaker import HALF_OPEN, CircuitBreaker
from services.env_gateway.remote_replies import info_problem, reset_problem, step_problem

log = logging.getLogger(__name__)

# Codes that say the backend is unhealthy; any other answer proves it is up.
_FAILURES = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
MAX_REMOTE_SESSION_ID_BYTES = 120
"""Leaves room for the `r<i>:` prefix under the gateway's 128-byte session id bound."""
MAX_ERROR_CHARS = 4096
"""A remote step's error message is cut to this before it is passed on."""
_CODES = frozenset(c.value[0] for c in grpc.StatusCode)
MAX_LISTED_ENVIRONMENTS = 1024
"""Environments taken from one backend's ListEnvironments (each becomes a route and a listing)."""
LIST_TIMEOUT_S = 5.0
"""ListEnvironments is for discovery and dashboards: it never waits long on a slow backend."""
RETRY_BACKOFF_S = 0.05


class RemoteError(Exception):
    """A proxied call failed; `code` is what the gateway answers."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code


def _bad_reply(backend: RemoteBackend, method: str, problem: str) -> RemoteError:
    """A reply outside the contract (remote_replies.py): the backend's failure, not the agent's, so
    UNAVAILABLE (as EnvUnavailableError) and never passed on. Not a breaker failure: it answers."""
    log.warning("%s: %s reply refused: %s", backend.name, method, problem)
    return RemoteError(grpc.StatusCode.UNAVAILABLE,
                       f"{backend.name} answered {method} outside the Environment contract: {problem}")


class RemoteBackend:
    """One remote Environment service: channel, concurrency limit, breaker, deadlines, retries."""

    def __init__(self, index: int, cfg: RemoteEnvConfig, token: str | None) -> None:
        self.index = index
        self.cfg = cfg
        self.prefix = f"r{index}:"
        self.name = f"remote backend {index} ({cfg.address})"
        self.breaker = CircuitBreaker(failures=cfg.breaker_failures, reset_s=cfg.breaker_reset_s)
        self._token = token
        self._slots = asyncio.Semaphore(cfg.max_concurrency)
        self._channel = make_channel(cfg.address, token=token)
        self._stub = env_pb2_grpc.EnvironmentStub(self._channel)
        self._closing: set[asyncio.Task[None]] = set()
        self.answering = False
        """Whether its last ListEnvironments was answered."""

    async def call(self, method: str, request: Any, *, deadline_s: float | None, idempotent: bool,
                   cap_s: float | None = None) -> Any:
        """`method` of the remote stub, under this backend's policies; raises RemoteError."""
        loop = asyncio.get_running_loop()
        timeout = min(t for t in (self.cfg.timeout_s, deadline_s, cap_s) if t is not None)
        # Running out of the caller's own (shorter) deadline is no verdict on the backend.
        config_bound = deadline_s is None or timeout < deadline_s
        end = loop.time() + timeout
        attempts = 1 + (self.cfg.retries if idempotent else 0)
        for attempt in range(attempts):
            try:
                return await self._attempt(method, request, end, config_bound)
            except RemoteError as e:
                retry = e.code == grpc.StatusCode.UNAVAILABLE and attempt + 1 < attempts \
                    and self.breaker.rejection() is None
                pause = RETRY_BACKOFF_S * 2**attempt
                if not retry or loop.time() + pause >= end:
                    raise
                await asyncio.sleep(pause)
        raise AssertionError("unreachable")

    async def _attempt(self, method: str, request: Any, end: float, config_bound: bool) -> Any:
        loop = asyncio.get_running_loop()
        reason = self.breaker.rejection()  # before queueing for a slot: an open breaker fails fast
        if reason:
            raise RemoteError(grpc.StatusCode.UNAVAILABLE, f"{self.name} is unavailable: {reason}")
        try:
            async with asyncio.timeout_at(end):
                await self._slots.acquire()
        except TimeoutError:
            raise RemoteError(grpc.StatusCode.DEADLINE_EXCEEDED,
                              f"{self.name}: all {self.cfg.max_concurrency} call slots stayed busy until "
                              "the deadline") from None
        try:
            reason = self.breaker.allow()
            if reason:
                raise RemoteError(grpc.StatusCode.UNAVAILABLE, f"{self.name} is unavailable: {reason}")
            return await self._send(method, request, end - loop.time(), config_bound)
        finally:
            self._slots.release()

    async def _send(self, method: str, request: Any, timeout: float, config_bound: bool) -> Any:
        if self.breaker.state == HALF_OPEN:
            self._fresh_channel_if_failing()
        try:
            response = await getattr(self._stub, method)(request, timeout=max(timeout, 0.001))
        except grpc.aio.AioRpcError as e:
            code = e.code()
            if code == grpc.StatusCode.DEADLINE_EXCEEDED and not config_bound:
                self.breaker.abandon()
            elif code in _FAILURES:
                self.breaker.failure(f"{code.name}: {e.details()}")
            else:
                self.breaker.success()  # any other answer, even an error, shows it is up
            state = " is unavailable" if code == grpc.StatusCode.UNAVAILABLE else ""
            raise RemoteError(code, f"{self.name}{state}: {e.details()}") from None
        except asyncio.CancelledError:
            self.breaker.abandon()
            raise
        self.breaker.success()
        return response

    def _fresh_channel_if_failing(self) -> None:
        """A channel in TRANSIENT_FAILURE reconnects only after its backoff (up to minutes): the
        half-open probe gets a fresh one, so a restarted backend is used as soon as it answers."""
        if self._channel.get_state() != grpc.ChannelConnectivity.TRANSIENT_FAILURE:
            return
        old = self._channel
        self._channel = make_channel(self.cfg.address, token=self._token)
        self._stub = env_pb2_grpc.EnvironmentStub(self._channel)
        task = asyncio.get_running_loop().create_task(old.close(grace=1.0))
        self._closing.add(task)  # held: the loop keeps only weak references to tasks
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        await asyncio.gather(*self._closing, return_exceptions=True)
        await self._channel.close(grace=None)


def backend_token(cfg: RemoteEnvConfig, gateway_token: str | None, path: str) -> str | None:
    if not cfg.token_env:
        return gateway_token
    token = os.environ.get(cfg.token_env, "").strip()
    if not token:
        raise ConfigError(f"{path}.token_env: ${cfg.token_env} is unset or empty")
    return token


class RemoteEnvs:
    """Routes env names and proxied session ids to backends; see the module docstring."""

    def __init__(self, backends: Sequence[RemoteBackend], *, local_names: Sequence[str]) -> None:
        self.backends = list(backends)
        self._local = set(local_names)
        self._routes: dict[str, RemoteBackend] = {}
        self._infos: dict[str, env_pb2.EnvironmentInfo] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        for backend in self.backends:
            for name in backend.cfg.env_names:
                self._claim(name, backend, configured=True)

    @classmethod
    def from_config(cls, remotes: Sequence[RemoteEnvConfig], *, gateway_token: str | None,
                    local_names: Sequence[str]) -> RemoteEnvs:
        """Call inside the event loop that will use it (its channels bind to that loop)."""
        backends = [RemoteBackend(i, r, backend_token(r, gateway_token, f"env_gateway.remotes[{i}]"))
                    for i, r in enumerate(remotes)]
        return cls(backends, local_names=local_names)

    def _claim(self, name: str, backend: RemoteBackend, *, configured: bool) -> bool:
        owner = self._routes.get(name)
        if owner is backend:
            return True
        clash = "a built-in environment" if name in self._local else owner.name if owner else None
        if clash is None:
            self._routes[name] = backend
            return True
        message = f"env_gateway.remotes[{backend.index}]: environment {name!r} is already served by {clash}"
        if configured:
            raise ConfigError(message)
        log.warning("%s; ignoring it", message)
        return False

    def serves(self, env_name: str) -> bool:
        return env_name in self._routes

    def owner(self, session_id: str) -> tuple[RemoteBackend, str] | None:
        """The backend and remote id of a proxied session id; None for a local one."""
        if not session_id.startswith("r"):
            return None
        head, sep, remote_id = session_id.partition(":")
        index = head[1:]
        if not sep or not index.isdigit() or int(index) >= len(self.backends):
            return None
        return self.backends[int(index)], remote_id

    def names(self) -> list[str]:
        return sorted(self._routes)

    async def discover(self, deadline_s: float | None = None, *, only_unconfigured: bool = False) -> None:
        """Asks backends for their environments; a backend that does not answer keeps what it had.

        `only_unconfigured` asks just the backends whose env_names are discovered, not configured.
        """
        chosen = [b for b in self.backends if not (only_unconfigured and b.cfg.env_names)]
        await asyncio.gather(*(self._discover(b, deadline_s) for b in chosen))

    async def route(self, env_name: str, deadline_s: float | None) -> bool:
        """Whether a backend serves `env_name`, asking the discovering backends again if none does yet
        (one that was down at start may serve it now)."""
        if env_name not in self._routes:
            await self.discover(deadline_s, only_unconfigured=True)
        return env_name in self._routes

    async def _discover(self, backend: RemoteBackend, deadline_s: float | None) -> None:
        try:
            reply = await backend.call("ListEnvironments", env_pb2.ListEnvironmentsRequest(),
                                       deadline_s=deadline_s, idempotent=True, cap_s=LIST_TIMEOUT_S)
        except RemoteError as e:
            backend.answering = False
            log.warning("cannot list the environments of %s: %s", backend.name, e)
            return
        backend.answering = True
        wanted = set(backend.cfg.env_names)
        if len(reply.environments) > MAX_LISTED_ENVIRONMENTS:
            log.warning("%s lists %d environments; taking the first %d", backend.name, len(reply.environments),
                        MAX_LISTED_ENVIRONMENTS)
        for info in reply.environments[:MAX_LISTED_ENVIRONMENTS]:
            problem = info_problem(info)
            if problem:
                log.warning("%s: leaving out an environment it lists: %s", backend.name, problem)
                continue
            if (not wanted or info.name in wanted) and self._claim(info.name, backend, configured=False):
                self._infos[info.name] = info

    async def list_environments(self, deadline_s: float | None) -> list[env_pb2.EnvironmentInfo]:
        await self.discover(deadline_s)
        return [self._infos.get(name) or env_pb2.EnvironmentInfo(
                    name=name, tools_json="[]",
                    description=f"served by {backend.name}" + ("" if backend.answering else " (not answering now)"))
                for name, backend in sorted(self._routes.items())]

    async def reset(self, request: env_pb2.ResetRequest, deadline_s: float | None) -> env_pb2.ResetResponse:
        backend = self._routes[request.env_name]  # the caller checked `route` first
        reply: env_pb2.ResetResponse = await backend.call("Reset", request, deadline_s=deadline_s, idempotent=False)
        size = len(reply.session_id.encode())
        problem = None if 0 < size <= MAX_REMOTE_SESSION_ID_BYTES else \
            f"session id is {size} bytes; proxied session ids must be 1 to {MAX_REMOTE_SESSION_ID_BYTES} bytes"
        problem = problem or reset_problem(reply)
        if problem:
            if reply.session_id:  # the episode it started is orphaned: end it
                self._background(self._close_quietly(backend, reply.session_id))
            raise _bad_reply(backend, "Reset", problem)
        reply.session_id = backend.prefix + reply.session_id
        return reply

    async def step(self, backend: RemoteBackend, request: env_pb2.StepRequest,
                   deadline_s: float | None) -> env_pb2.StepResponse:
        reply: env_pb2.StepResponse = await backend.call("Step", request, deadline_s=deadline_s, idempotent=False)
        problem = step_problem(reply)
        if problem:
            raise _bad_reply(backend, "Step", problem)
        return reply

    async def step_batch(self, backend: RemoteBackend, steps: Sequence[env_pb2.StepRequest],
                         deadline_s: float | None) -> list[env_pb2.StepResult]:
        """One remote StepBatch for all of this backend's steps (remote ids); a failed call fails
        each, and each result outside the contract is that step's failure."""
        try:
            reply = await backend.call("StepBatch", env_pb2.StepBatchRequest(steps=steps), deadline_s=deadline_s,
                                       idempotent=False)
        except RemoteError as e:
            return [env_pb2.StepResult(code=e.code.value[0], message=str(e)) for _ in steps]
        if len(reply.results) != len(steps):
            error = _bad_reply(backend, "StepBatch", f"{len(reply.results)} results for {len(steps)} steps")
            return [env_pb2.StepResult(code=error.code.value[0], message=str(error)) for _ in steps]
        for result in reply.results:
            problem = step_problem(result.response) if result.code == 0 else \
                (None if result.code in _CODES else f"a step's status code is {result.code}, not a gRPC code")
            if problem:
                error = _bad_reply(backend, "StepBatch", problem)
                result.Clear()
                result.code, result.message = error.code.value[0], str(error)
            elif len(result.message) > MAX_ERROR_CHARS:
                result.message = result.message[:MAX_ERROR_CHARS] + " [cut]"
        return list(reply.results)

    async def close_session(self, backend: RemoteBackend, remote_id: str, deadline_s: float | None) -> None:
        await backend.call("Close", env_pb2.CloseRequest(session_id=remote_id), deadline_s=deadline_s,
                           idempotent=True)

    async def _close_quietly(self, backend: RemoteBackend, remote_id: str) -> None:
        try:
            await self.close_session(backend, remote_id, None)
        except RemoteError:
            pass  # the backend expires idle sessions; this was a courtesy

    def _background(self, job: Coroutine[Any, Any, None]) -> None:
        task = asyncio.get_running_loop().create_task(job)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def aclose(self) -> None:
        await asyncio.gather(*(b.close() for b in self.backends))
