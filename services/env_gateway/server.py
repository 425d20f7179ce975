"""gRPC servicer for `arlo.v1.Environment`: checks request bounds, routes each call to a local
environment or a remote backend, and maps errors to status codes."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import grpc

from arlo.proto.v1 import common_pb2, env_pb2, env_pb2_grpc
from arlo.rpc import utf8_too_long
from services.env_gateway.envs.base import EnvUnavailableError, EpisodeOverError, Message, StepResult
from services.env_gateway.gateway import Gateway, InvalidConfigError, UnknownEnvError
from services.env_gateway.mcp_envs import McpEnvs
from services.env_gateway.remote import RemoteBackend, RemoteEnvs, RemoteError
from services.env_gateway.sessions import SessionBusyError, SessionLimitError, SessionNotFoundError

log = logging.getLogger(__name__)

SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["Environment"].full_name

# Bounds from env.proto (local session ids are 32 hex chars; proxied ones are `r<i>:` + <= 120 bytes).
MAX_ENV_NAME_BYTES = 128
MAX_CONFIG_BYTES = 64 << 10
MAX_ACTION_BYTES = 64 << 10
MAX_SESSION_ID_BYTES = 128
MAX_BATCH_STEPS = 256
MAX_BATCH_CLOSES = 256

# Expected failures of a step, and their codes; anything else is a bug -> INTERNAL.
_STEP_ERRORS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (EpisodeOverError, grpc.StatusCode.FAILED_PRECONDITION),
    (SessionBusyError, grpc.StatusCode.ABORTED),
    (EnvUnavailableError, grpc.StatusCode.UNAVAILABLE),
)


def _messages(observation: list[Message]) -> list[common_pb2.Message]:
    return [common_pb2.Message(role=m.role, content=m.content, name=m.name) for m in observation]


class InfoJson:
    """info dicts as JSON, memoised: cheap steps repeat a handful of small infos ({"turns": 3,
    "correct": false}), and json encoding was a third of such a step's cost in a StepBatch.

    Keyed on the items and their types (True == 1 as a dict key, but not in JSON); an info that
    cannot be hashed is encoded each time. Bounded: the cache is dropped when it fills.
    """

    def __init__(self, max_entries: int = 4096) -> None:
        self._encoder = json.JSONEncoder(default=str)
        self._cache: dict[tuple[Any, ...], tuple[tuple[type, ...], str]] = {}
        self._max_entries = max_entries

    def encode(self, info: dict[str, Any]) -> str:
        try:
            key = tuple(info.items())
            hit = self._cache.get(key)
        except TypeError:  # a list or dict inside
            return self._encoder.encode(info)
        types = tuple(map(type, info.values()))
        if hit is None or hit[0] != types:
            if len(self._cache) >= self._max_entries:
                self._cache.clear()
            hit = self._cache[key] = (types, self._encoder.encode(info))
        return hit[1]


def _fill(response: env_pb2.StepResponse, result: StepResult, info_json: InfoJson) -> env_pb2.StepResponse:
    """Writes `result` into `response` in place: StepBatch fills its reply's entries without the
    copy that passing a message to a constructor makes. Defaults are not written (each write costs)."""
    for m in result.observation:
        message = response.observation.add()
        message.role, message.content = m.role, m.content
        if m.name:
            message.name = m.name
    if result.done:
        response.done = True
    if result.reward:
        response.reward = result.reward
    if result.answer:
        response.answer = result.answer
    if result.reference:
        response.reference = result.reference
    response.info_json = info_json.encode(result.info)
    return response


# A str of at most this many characters is within the byte bound whatever it holds (<= 4 bytes a char).
_SAFE_ID_CHARS = MAX_SESSION_ID_BYTES // 4
_SAFE_ACTION_CHARS = MAX_ACTION_BYTES // 4


def step_problem(session_id: str, action: str, index: int | None = None) -> str | None:
    """Why a step (StepBatch's steps[index]) is refused with INVALID_ARGUMENT, or None."""
    # Cheap path first (no encoding, no message strings): almost every step is far inside both bounds.
    if session_id and len(session_id) <= _SAFE_ID_CHARS and len(action) <= _SAFE_ACTION_CHARS:
        return None
    prefix = "" if index is None else f"steps[{index}]."
    if not session_id:
        return f"{prefix}session_id is required (from Reset)"
    return (utf8_too_long(f"{prefix}session_id", session_id, MAX_SESSION_ID_BYTES)
            or utf8_too_long(f"{prefix}action", action, MAX_ACTION_BYTES))


def _code_of(error: BaseException) -> grpc.StatusCode | None:
    return next((code for kind, code in _STEP_ERRORS if isinstance(error, kind)), None)


def _set_error(out: env_pb2.StepResult, error: BaseException, session_id: str) -> None:
    code = _code_of(error)
    if code is None:
        log.error("environment step failed (session %s)", session_id, exc_info=error)
        code, message = grpc.StatusCode.INTERNAL, f"environment error: {type(error).__name__}"
    else:
        message = str(error)
    out.code, out.message = code.value[0], message


class EnvironmentServicer(env_pb2_grpc.EnvironmentServicer):
    def __init__(self, gateway: Gateway, remotes: RemoteEnvs | None = None, mcp: McpEnvs | None = None) -> None:
        self._gateway = gateway
        self._remotes = remotes
        self._mcp = mcp
        self._info_json = InfoJson()

    def _owner(self, session_id: str) -> tuple[RemoteBackend, str] | None:
        return self._remotes.owner(session_id) if self._remotes is not None else None

    async def ListEnvironments(self, request: env_pb2.ListEnvironmentsRequest,
                               context: grpc.aio.ServicerContext) -> env_pb2.ListEnvironmentsResponse:
        specs = self._gateway.registry.specs()
        mcp = self._mcp
        infos = [env_pb2.EnvironmentInfo(name=s.name, description=s.description, tools_json=s.tools_json,
                                         max_turns=s.max_turns) for s in specs if not (mcp and mcp.serves(s.name))]
        if mcp is not None:  # described live: a server may have been reached (or lost) since start
            infos += await asyncio.gather(*(mcp.info(s.name, context.time_remaining())
                                            for s in specs if mcp.serves(s.name)))
        if self._remotes is not None:
            infos += await self._remotes.list_environments(context.time_remaining())
        return env_pb2.ListEnvironmentsResponse(environments=sorted(infos, key=lambda i: i.name))

    async def Reset(self, request: env_pb2.ResetRequest, context: grpc.aio.ServicerContext) -> env_pb2.ResetResponse:
        problem = (None if request.env_name else "env_name is required") or \
            utf8_too_long("env_name", request.env_name, MAX_ENV_NAME_BYTES) or \
            utf8_too_long("config_json", request.config_json, MAX_CONFIG_BYTES)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        remotes = self._remotes
        if remotes is not None and self._gateway.registry.get(request.env_name) is None \
                and await remotes.route(request.env_name, context.time_remaining()):
            try:
                return await remotes.reset(request, context.time_remaining())
            except RemoteError as e:
                await context.abort(e.code, str(e))
        try:
            started = await self._gateway.reset_async(request.env_name, request.config_json, request.seed,
                                                      context.time_remaining())
        except UnknownEnvError:
            known = sorted([*self._gateway.registry.names(), *(remotes.names() if remotes else [])])
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown environment {request.env_name!r}; known: {known}")
        except InvalidConfigError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SessionLimitError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except EnvUnavailableError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        result = started.result
        return env_pb2.ResetResponse(session_id=started.session_id, observation=_messages(result.observation),
                                     tools_json=result.tools_json, task_id=result.task_id,
                                     metadata_json=json.dumps(result.metadata, default=str) if result.metadata else "")

    async def Step(self, request: env_pb2.StepRequest, context: grpc.aio.ServicerContext) -> env_pb2.StepResponse:
        problem = step_problem(request.session_id, request.action)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        owner = self._owner(request.session_id)
        if owner is not None and self._remotes is not None:
            backend, remote_id = owner
            try:
                return await self._remotes.step(backend, env_pb2.StepRequest(session_id=remote_id, action=request.action),
                                                context.time_remaining())
            except RemoteError as e:
                await context.abort(e.code, str(e))
        try:
            result = await self._gateway.step_async(request.session_id, request.action, context.time_remaining())
            return _fill(env_pb2.StepResponse(), result, self._info_json)
        except Exception as e:
            code = _code_of(e)
            if code is None:
                raise  # the server's error interceptor logs it and answers INTERNAL
            await context.abort(code, str(e))

    async def StepBatch(self, request: env_pb2.StepBatchRequest,
                        context: grpc.aio.ServicerContext) -> env_pb2.StepBatchResponse:
        steps = request.steps
        if not 1 <= len(steps) <= MAX_BATCH_STEPS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"steps has {len(steps)} entries; send 1 to {MAX_BATCH_STEPS}")
        session_ids = [step.session_id for step in steps]  # read once: each read makes a new str
        if len(set(session_ids)) < len(session_ids):
            first_index: dict[str, int] = {}
            for i, session_id in enumerate(session_ids):
                if session_id in first_index:
                    # Two actions for one session in one batch have no defined order: refuse the batch.
                    await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                        f"steps[{i}] repeats the session of steps[{first_index[session_id]}]; "
                                        "each step in a batch must be for a distinct session")
                first_index[session_id] = i
        reply = env_pb2.StepBatchResponse()
        await self._step_all(steps, session_ids, [reply.results.add() for _ in steps], context.time_remaining())
        return reply

    async def _step_all(self, steps: list[env_pb2.StepRequest], session_ids: list[str],
                        out: list[env_pb2.StepResult], deadline_s: float | None) -> None:
        """Fills `out` (the reply's entries): cheap local steps inline, blocking ones in worker
        threads, and one remote StepBatch per backend; all waits run concurrently."""
        pending: list[tuple[int, asyncio.Future[StepResult]]] = []
        remote: dict[int, tuple[RemoteBackend, list[int], list[env_pb2.StepRequest]]] = {}
        # Locals, not attribute lookups: this loop is the whole cost of a batch of cheap steps.
        begin, info_json, remotes = self._gateway.begin_step, self._info_json, self._remotes
        for i, (step, session_id, result) in enumerate(zip(steps, session_ids, out, strict=True)):
            action = step.action
            if not (session_id and len(session_id) <= _SAFE_ID_CHARS and len(action) <= _SAFE_ACTION_CHARS):
                problem = step_problem(session_id, action, i)
                if problem:
                    result.code, result.message = grpc.StatusCode.INVALID_ARGUMENT.value[0], problem
                    continue
            owner = remotes.owner(session_id) if remotes is not None else None
            if owner is not None:
                _, indices, requests = remote.setdefault(owner[0].index, (owner[0], [], []))
                indices.append(i)
                requests.append(env_pb2.StepRequest(session_id=owner[1], action=action))
                continue
            try:
                outcome = begin(session_id, action, deadline_s)
            except Exception as e:
                _set_error(result, e, session_id)
                continue
            if isinstance(outcome, StepResult):
                _fill(result.response, outcome, info_json)
            else:
                pending.append((i, outcome))
        if pending or remote:
            await self._gather(steps, out, pending, list(remote.values()), deadline_s)

    async def _gather(self, steps: list[env_pb2.StepRequest], out: list[env_pb2.StepResult],
                      pending: list[tuple[int, asyncio.Future[StepResult]]],
                      remote: list[tuple[RemoteBackend, list[int], list[env_pb2.StepRequest]]],
                      deadline_s: float | None) -> None:
        remotes = self._remotes
        assert remotes is not None or not remote
        local_job = asyncio.gather(*(f for _, f in pending), return_exceptions=True)
        remote_jobs = [remotes.step_batch(b, reqs, deadline_s) for b, _, reqs in remote] if remotes else []
        local, *replies = await asyncio.gather(local_job, *remote_jobs)
        for (i, _), outcome in zip(pending, local, strict=True):
            if isinstance(outcome, BaseException):
                _set_error(out[i], outcome, steps[i].session_id)
            else:
                _fill(out[i].response, outcome, self._info_json)
        for (_, indices, _), reply in zip(remote, replies, strict=True):
            for i, result in zip(indices, reply, strict=True):
                out[i].CopyFrom(result)

    async def Close(self, request: env_pb2.CloseRequest, context: grpc.aio.ServicerContext) -> env_pb2.CloseResponse:
        owner = self._owner(request.session_id)
        if owner is not None and self._remotes is not None:
            try:
                await self._remotes.close_session(owner[0], owner[1], context.time_remaining())
            except RemoteError as e:
                await context.abort(e.code, str(e))
        else:
            self._gateway.close(request.session_id)
        return env_pb2.CloseResponse()

    async def CloseBatch(self, request: env_pb2.CloseBatchRequest,
                         context: grpc.aio.ServicerContext) -> env_pb2.CloseBatchResponse:
        session_ids = list(request.session_ids)
        if not 1 <= len(session_ids) <= MAX_BATCH_CLOSES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"session_ids has {len(session_ids)} entries; send 1 to {MAX_BATCH_CLOSES}")
        reply = env_pb2.CloseBatchResponse()
        results = [reply.results.add() for _ in session_ids]
        remote: list[tuple[env_pb2.CloseResult, RemoteBackend, str]] = []
        for i, (session_id, result) in enumerate(zip(session_ids, results, strict=True)):
            problem = utf8_too_long(f"session_ids[{i}]", session_id, MAX_SESSION_ID_BYTES)
            if problem:
                result.code, result.message = grpc.StatusCode.INVALID_ARGUMENT.value[0], problem
                continue
            owner = self._owner(session_id)
            if owner is not None and self._remotes is not None:
                remote.append((result, *owner))
            else:
                self._gateway.close(session_id)
        if remote:  # each backend's sessions closed concurrently, as Close closes one
            remotes, deadline_s = self._remotes, context.time_remaining()
            assert remotes is not None
            outcomes = await asyncio.gather(*(remotes.close_session(backend, remote_id, deadline_s)
                                              for _, backend, remote_id in remote), return_exceptions=True)
            for (result, _, _), outcome in zip(remote, outcomes, strict=True):
                if isinstance(outcome, RemoteError):
                    result.code, result.message = outcome.code.value[0], str(outcome)
                elif isinstance(outcome, BaseException):
                    raise outcome  # a bug: the server's error interceptor logs it and answers INTERNAL
        return reply

    async def aclose(self) -> None:
        """Closes the remote channels, the MCP sessions (their processes) and the worker threads
        (after the server stopped)."""
        if self._remotes is not None:
            await self._remotes.aclose()
        if self._mcp is not None:
            await self._mcp.aclose()
        self._gateway.shutdown()
