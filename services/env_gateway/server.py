"""gRPC servicer for `arlo.v1.Environment`: checks request bounds and maps core errors to codes."""

from __future__ import annotations

import json
import logging

import grpc

from arlo.proto.v1 import common_pb2, env_pb2, env_pb2_grpc
from arlo.rpc import utf8_too_long
from services.env_gateway.envs.base import EpisodeOverError, Message, StepResult
from services.env_gateway.gateway import Gateway, InvalidConfigError, UnknownEnvError
from services.env_gateway.sessions import SessionLimitError, SessionNotFoundError

log = logging.getLogger(__name__)

SERVICE_NAME = env_pb2.DESCRIPTOR.services_by_name["Environment"].full_name

# Bounds from env.proto (session ids are ours: 32 hex chars; 128 leaves room for remote backends).
MAX_ENV_NAME_BYTES = 128
MAX_CONFIG_BYTES = 64 << 10
MAX_ACTION_BYTES = 64 << 10
MAX_SESSION_ID_BYTES = 128
MAX_BATCH_STEPS = 256

# Expected failures of a step, and their codes; anything else is a bug -> INTERNAL.
_STEP_ERRORS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (SessionNotFoundError, grpc.StatusCode.NOT_FOUND),
    (EpisodeOverError, grpc.StatusCode.FAILED_PRECONDITION),
)


def _messages(observation: list[Message]) -> list[common_pb2.Message]:
    return [common_pb2.Message(role=m.role, content=m.content, name=m.name) for m in observation]


def _step_response(result: StepResult) -> env_pb2.StepResponse:
    return env_pb2.StepResponse(observation=_messages(result.observation), done=result.done, reward=result.reward,
                                answer=result.answer, reference=result.reference,
                                info_json=json.dumps(result.info, default=str))


def step_problem(step: env_pb2.StepRequest, prefix: str = "") -> str | None:
    if not step.session_id:
        return f"{prefix}session_id is required (from Reset)"
    return (utf8_too_long(f"{prefix}session_id", step.session_id, MAX_SESSION_ID_BYTES)
            or utf8_too_long(f"{prefix}action", step.action, MAX_ACTION_BYTES))


def _code_of(error: Exception) -> grpc.StatusCode | None:
    return next((code for kind, code in _STEP_ERRORS if isinstance(error, kind)), None)


class EnvironmentServicer(env_pb2_grpc.EnvironmentServicer):
    def __init__(self, gateway: Gateway) -> None:
        self._gateway = gateway

    async def ListEnvironments(self, request: env_pb2.ListEnvironmentsRequest,
                               context: grpc.aio.ServicerContext) -> env_pb2.ListEnvironmentsResponse:
        return env_pb2.ListEnvironmentsResponse(environments=[
            env_pb2.EnvironmentInfo(name=s.name, description=s.description, tools_json=s.tools_json,
                                    max_turns=s.max_turns) for s in self._gateway.registry.specs()])

    async def Reset(self, request: env_pb2.ResetRequest, context: grpc.aio.ServicerContext) -> env_pb2.ResetResponse:
        problem = (None if request.env_name else "env_name is required") or \
            utf8_too_long("env_name", request.env_name, MAX_ENV_NAME_BYTES) or \
            utf8_too_long("config_json", request.config_json, MAX_CONFIG_BYTES)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            started = self._gateway.reset(request.env_name, request.config_json, request.seed)
        except UnknownEnvError as e:
            await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
        except InvalidConfigError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except SessionLimitError as e:
            await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        result = started.result
        return env_pb2.ResetResponse(session_id=started.session_id, observation=_messages(result.observation),
                                     tools_json=result.tools_json, task_id=result.task_id)

    async def Step(self, request: env_pb2.StepRequest, context: grpc.aio.ServicerContext) -> env_pb2.StepResponse:
        problem = step_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        try:
            return _step_response(self._gateway.step(request.session_id, request.action))
        except Exception as e:
            code = _code_of(e)
            if code is None:
                raise  # the server's error interceptor logs it and answers INTERNAL
            await context.abort(code, str(e))

    def _step_one(self, index: int, step: env_pb2.StepRequest) -> env_pb2.StepResult:
        problem = step_problem(step, f"steps[{index}].")
        if problem:
            return env_pb2.StepResult(code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=problem)
        try:
            response = _step_response(self._gateway.step(step.session_id, step.action))
        except Exception as e:
            code = _code_of(e)
            if code is None:
                log.exception("environment step failed (session %s)", step.session_id)
                code, message = grpc.StatusCode.INTERNAL, f"environment error: {type(e).__name__}"
            else:
                message = str(e)
            return env_pb2.StepResult(code=code.value[0], message=message)
        return env_pb2.StepResult(code=grpc.StatusCode.OK.value[0], response=response)

    async def StepBatch(self, request: env_pb2.StepBatchRequest,
                        context: grpc.aio.ServicerContext) -> env_pb2.StepBatchResponse:
        steps = request.steps
        if not 1 <= len(steps) <= MAX_BATCH_STEPS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"steps has {len(steps)} entries; send 1 to {MAX_BATCH_STEPS}")
        first_index: dict[str, int] = {}
        for i, step in enumerate(steps):
            if step.session_id in first_index:
                # Two actions for one session in one batch have no defined order: refuse the batch.
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                    f"steps[{i}] repeats the session of steps[{first_index[step.session_id]}]; "
                                    "each step in a batch must be for a distinct session")
            first_index[step.session_id] = i
        return env_pb2.StepBatchResponse(results=[self._step_one(i, s) for i, s in enumerate(steps)])

    async def Close(self, request: env_pb2.CloseRequest, context: grpc.aio.ServicerContext) -> env_pb2.CloseResponse:
        self._gateway.close(request.session_id)
        return env_pb2.CloseResponse()
