"""gRPC servicer for `arlo.v1.Environment`: checks request bounds, converts protobuf <-> the
gateway core's types, and maps errors to status codes (`errors.py`). The core (`gateway.py`)
routes each call to a local, MCP or remote environment."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any, NoReturn

import grpc

from arlo.proto.v1 import common_pb2, env_pb2, env_pb2_grpc
from arlo.rpc import utf8_too_long
from services.env_gateway.envs.base import Message, StepResult
from services.env_gateway.errors import status_of
from services.env_gateway.gateway import Gateway, Started, StepOutcome
from services.env_gateway.remote import RemoteError

log = logging.getLogger(__name__)

SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["Environment"].full_name

# Bounds from env.proto (local session ids are 32 hex chars; proxied ones are `r<i>:` + <= 120 bytes).
MAX_ENV_NAME_BYTES = 128
MAX_CONFIG_BYTES = 64 << 10
MAX_ACTION_BYTES = 64 << 10
MAX_SESSION_ID_BYTES = 128
MAX_BATCH_STEPS = 256
MAX_BATCH_CLOSES = 256

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


def _set_error(out: env_pb2.StepResult, error: BaseException, session_id: str) -> None:
    code = status_of(error)
    if code is None:
        log.error("environment step failed (session %s)", session_id, exc_info=error)
        code, message = grpc.StatusCode.INTERNAL, f"environment error: {type(error).__name__}"
    else:
        message = str(error)
    out.code, out.message = code.value[0], message


async def _abort(context: grpc.aio.ServicerContext, error: Exception) -> NoReturn:
    """Answers an expected failure with its status; re-raises a bug, which the server's error
    interceptor logs and answers INTERNAL."""
    code = status_of(error)
    if code is None:
        raise error
    await context.abort(code, str(error))


def _reset_response(started: Started | env_pb2.ResetResponse) -> env_pb2.ResetResponse:
    if isinstance(started, env_pb2.ResetResponse):
        return started  # proxied: the backend's reply as it came
    result = started.result
    return env_pb2.ResetResponse(session_id=started.session_id, observation=_messages(result.observation),
                                 tools_json=result.tools_json, task_id=result.task_id,
                                 metadata_json=json.dumps(result.metadata, default=str) if result.metadata else "")


class EnvironmentServicer(env_pb2_grpc.EnvironmentServicer):
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway
        self._info_json = InfoJson()

    async def ListEnvironments(self, request: env_pb2.ListEnvironmentsRequest,
                               context: grpc.aio.ServicerContext) -> env_pb2.ListEnvironmentsResponse:
        return env_pb2.ListEnvironmentsResponse(environments=await self._gateway.environments(context.time_remaining))

    async def Reset(self, request: env_pb2.ResetRequest, context: grpc.aio.ServicerContext) -> env_pb2.ResetResponse:
        problem = (None if request.env_name else "env_name is required") or \
            utf8_too_long("env_name", request.env_name, MAX_ENV_NAME_BYTES) or \
            utf8_too_long("config_json", request.config_json, MAX_CONFIG_BYTES)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            started = await self._gateway.reset_routed(request.env_name, request.config_json, request.seed,
                                                       context.time_remaining, client=context.peer())
        except Exception as e:
            await _abort(context, e)
        return _reset_response(started)

    async def Step(self, request: env_pb2.StepRequest, context: grpc.aio.ServicerContext) -> env_pb2.StepResponse:
        problem = step_problem(request.session_id, request.action)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            result = await self._gateway.step_routed(request.session_id, request.action, context.time_remaining())
        except Exception as e:
            await _abort(context, e)
        if isinstance(result, env_pb2.StepResponse):
            return result  # proxied
        return _fill(env_pb2.StepResponse(), result, self._info_json)

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
        actions = [step.action for step in steps]
        reply = env_pb2.StepBatchResponse()
        out = [reply.results.add() for _ in steps]
        refused = _refuse_bad_steps(session_ids, actions, out)
        if refused:  # rare: the others go on without them
            keep = [i for i in range(len(steps)) if i not in refused]
            session_ids, actions, out = [session_ids[i] for i in keep], [actions[i] for i in keep], [out[i] for i in keep]
        outcomes = await self._gateway.step_batch(session_ids, actions, context.time_remaining())
        self._fill_all(out, outcomes, session_ids)
        return reply

    def _fill_all(self, out: list[env_pb2.StepResult], outcomes: list[StepOutcome], session_ids: list[str]) -> None:
        info_json = self._info_json
        for result, outcome, session_id in zip(out, outcomes, session_ids, strict=True):
            if isinstance(outcome, StepResult):
                _fill(result.response, outcome, info_json)
            elif isinstance(outcome, env_pb2.StepResult):
                result.CopyFrom(outcome)  # proxied, error or not
            else:
                _set_error(result, outcome, session_id)

    async def Close(self, request: env_pb2.CloseRequest, context: grpc.aio.ServicerContext) -> env_pb2.CloseResponse:
        try:
            await self._gateway.close_routed(request.session_id, context.time_remaining())
        except RemoteError as e:
            await context.abort(e.code, str(e))
        return env_pb2.CloseResponse()

    async def CloseBatch(self, request: env_pb2.CloseBatchRequest,
                         context: grpc.aio.ServicerContext) -> env_pb2.CloseBatchResponse:
        session_ids = list(request.session_ids)
        if not 1 <= len(session_ids) <= MAX_BATCH_CLOSES:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"session_ids has {len(session_ids)} entries; send 1 to {MAX_BATCH_CLOSES}")
        reply = env_pb2.CloseBatchResponse()
        closing: list[tuple[env_pb2.CloseResult, str]] = []
        for i, session_id in enumerate(session_ids):
            result = reply.results.add()
            problem = utf8_too_long(f"session_ids[{i}]", session_id, MAX_SESSION_ID_BYTES)
            if problem:
                result.code, result.message = grpc.StatusCode.INVALID_ARGUMENT.value[0], problem
            else:
                closing.append((result, session_id))
        errors = await self._gateway.close_batch([s for _, s in closing], context.time_remaining())
        for (result, _), error in zip(closing, errors, strict=True):
            if isinstance(error, RemoteError):
                result.code, result.message = error.code.value[0], str(error)
            elif error is not None:
                raise error  # a bug: the server's error interceptor logs it and answers INTERNAL
        return reply

    async def aclose(self) -> None:
        """Closes the remote channels, the MCP sessions (their processes) and the worker threads
        (after the server stopped)."""
        await self._gateway.aclose()


def _refuse_bad_steps(session_ids: Sequence[str], actions: Sequence[str], out: list[env_pb2.StepResult]) -> set[int]:
    """Answers each step outside the bounds INVALID_ARGUMENT in its entry of `out`; their indices."""
    refused: set[int] = set()
    for i, (session_id, action) in enumerate(zip(session_ids, actions, strict=True)):
        # Inline cheap check: this loop runs for every step of every batch.
        if not (session_id and len(session_id) <= _SAFE_ID_CHARS and len(action) <= _SAFE_ACTION_CHARS):
            problem = step_problem(session_id, action, i)
            if problem:
                out[i].code, out[i].message = grpc.StatusCode.INVALID_ARGUMENT.value[0], problem
                refused.add(i)
    return refused
