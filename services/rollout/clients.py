"""gRPC-backed implementations of the agent loop's Protocols (the transport edge of rollout).

Everything gRPC stops here: replies become `services.rollout.types` records and a failed call
becomes a `BackendError` (`RetryableError` for the status codes worth a retry), so the core
above never imports grpc or a *_pb2 module for its backends.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, ParamSpec, TypeVar

import grpc

from arlo.config import SamplingConfig
from arlo.proto.v1 import (
    common_pb2,
    env_pb2,
    env_pb2_grpc,
    inference_pb2,
    inference_pb2_grpc,
    reward_pb2,
    reward_pb2_grpc,
)
from arlo.rpc.replicas import ReplicaSet
from services.rollout.agent import Turn
from services.rollout.coalescing import Coalescer, Settle, each_alone
from services.rollout.types import BackendError, Message, ResetResult, RetryableError, ScoreResult, StepResult

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

# Worth retrying with backoff: the backend may be restarting or overloaded.
RETRYABLE = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                       grpc.StatusCode.RESOURCE_EXHAUSTED})

MAX_GENERATE_BATCH = 256
"""GenerateBatch's bound (inference.proto)."""
SEND_ALONE_ON = (grpc.StatusCode.UNIMPLEMENTED, grpc.StatusCode.RESOURCE_EXHAUSTED)
"""A batch call refused for these is sent again one call per request (older server, message limit)."""
MAX_SCORE_BATCH = 256
"""Under ScoreBatch's bound (1024, reward.proto), like GenerateBatch's."""
MAX_BATCHED_REQUEST_BYTES = 64 << 10
"""A larger Generate or Score request goes alone: a batch of 256 stays under 16 MiB, well inside a
channel's max message size (64 MiB by default); a request that large gains little from sharing a call."""
_STATUS = {code.value[0]: code for code in grpc.StatusCode}

P = ParamSpec("P")
R = TypeVar("R")


def backend_error(service: str, code: grpc.StatusCode, details: str) -> BackendError:
    kind = RetryableError if code in RETRYABLE else BackendError
    return kind(service, code.name, details)


def translated(service: str) -> Callable[[Callable[P, Awaitable[R]]], Callable[P, Awaitable[R]]]:
    """Turns a gRPC failure of the wrapped call into the core's BackendError / RetryableError."""
    def wrap(fn: Callable[P, Awaitable[R]]) -> Callable[P, Awaitable[R]]:
        @functools.wraps(fn)
        async def call(*args: P.args, **kwargs: P.kwargs) -> R:
            try:
                return await fn(*args, **kwargs)
            except grpc.aio.AioRpcError as e:
                raise backend_error(service, e.code(), e.details() or "") from e
        return call
    return wrap


def _messages(observation: Sequence[common_pb2.Message]) -> tuple[Message, ...]:
    return tuple(Message(role=m.role, content=m.content, name=m.name) for m in observation)


def reset_result(reply: env_pb2.ResetResponse) -> ResetResult:
    return ResetResult(session_id=reply.session_id, task_id=reply.task_id, observation=_messages(reply.observation),
                       tools_json=reply.tools_json, metadata_json=reply.metadata_json)


def step_result(reply: env_pb2.StepResponse) -> StepResult:
    return StepResult(observation=_messages(reply.observation), reward=reply.reward, done=reply.done,
                      answer=reply.answer, reference=reply.reference, info_json=reply.info_json)


_SCORE_STATUS = {reward_pb2.SCORE_STATUS_OK: "ok", reward_pb2.SCORE_STATUS_ERROR: "error",
                 reward_pb2.SCORE_STATUS_TIMEOUT: "timeout"}


def score_result(reply: reward_pb2.ScoreResponse) -> ScoreResult:
    status = _SCORE_STATUS.get(reply.status)
    if status is None:  # UNSPECIFIED: a reward server that did not say is not trusted with a reward
        return ScoreResult(status="error", error=f"reward status {reply.status} unknown: {reply.error}")
    return ScoreResult(status=status, reward=reply.reward, components=dict(reply.components), error=reply.error)


class InferenceClient:
    """Generation over one channel, or over a ReplicaSet (each session on its own replica)."""

    def __init__(self, channel: grpc.aio.Channel | ReplicaSet, sampling: SamplingConfig, *,
                 stop_token_ids: Sequence[int], timeout_s: float, batch_window_s: float = 0.0,
                 tracer: Tracer | None = None, run_id: str = "", return_routing: bool = False,
                 return_kept: bool = False) -> None:
        """`stop_token_ids`: the tokenizer's (every eos id of the model); sampling.stop_token_ids
        are added to them. `batch_window_s` > 0: calls to one replica that arrive together leave
        as one GenerateBatch (services/rollout/coalescing.py); 0: one Generate each. `run_id`: the
        run this worker generates for, sent with every call (an inference service shared by several
        runs picks that run's adapter and version; one serving another run refuses it).
        `return_routing`: ask for each token's routed experts (trainer.algorithm.routing_replay).
        `return_kept`: ask for each token's kept set (filter replay, arlo/filter_replay.py
        `run_kept_width`)."""
        self.run_id = run_id
        self.return_routing = return_routing
        self.return_kept = return_kept
        self.replicas = channel if isinstance(channel, ReplicaSet) else None
        self.channel = None if self.replicas else channel
        self.stub = None if self.replicas else inference_pb2_grpc.InferenceStub(channel)
        self.sampling = sampling
        self.stop_token_ids = list(dict.fromkeys([*stop_token_ids, *sampling.stop_token_ids]))
        self.timeout_s = timeout_s
        self.batch_window_s = batch_window_s
        self.tracer = tracer
        self._batchers: dict[grpc.aio.Channel, Coalescer[inference_pb2.GenerateRequest, inference_pb2.GenerateResponse]] = {}

    async def _channel(self, session_id: str = "") -> grpc.aio.Channel:
        return self.channel if self.replicas is None else await self.replicas.channel(session_id)

    async def _call(self, request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        channel = await self._channel(request.session_id)
        stub = inference_pb2_grpc.InferenceStub(channel)
        if self.batch_window_s <= 0 or request.ByteSize() > MAX_BATCHED_REQUEST_BYTES:
            return await stub.Generate(request, timeout=self.timeout_s)
        batcher = self._batchers.get(channel)
        if batcher is None:
            if self.replicas is not None:  # forget the batchers of replicas that are gone
                live = set(await self.replicas.all_channels())
                self._batchers = {c: b for c, b in self._batchers.items() if c in live}
            batcher = self._batchers[channel] = Coalescer(
                functools.partial(self._generate_one, stub), functools.partial(self._generate_many, stub),
                window_s=self.batch_window_s, max_batch=MAX_GENERATE_BATCH, tracer=self.tracer,
                span_name="rollout.generate_batch")
        return await batcher.call(request)

    async def _generate_one(self, stub: inference_pb2_grpc.InferenceStub,
                            request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        try:
            return await stub.Generate(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise backend_error("inference", e.code(), e.details() or "") from e

    async def _generate_many(self, stub: inference_pb2_grpc.InferenceStub, requests: list[inference_pb2.GenerateRequest],
                             settle: Settle) -> None:
        settled: set[int] = set()
        try:
            async for message in stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=requests),
                                                    timeout=self.timeout_s):
                for r in message.results:
                    settled.add(r.index)
                    settle(r.index, r.response if r.code == 0 else
                           backend_error("inference", _STATUS.get(r.code, grpc.StatusCode.UNKNOWN), r.message))
        except grpc.aio.AioRpcError as e:
            if e.code() not in SEND_ALONE_ON:
                raise backend_error("inference", e.code(), e.details() or "") from e
            # The batch itself was refused (an older server, a message past its limit): what one
            # Generate each would have done.
            await each_alone(functools.partial(self._generate_one, stub), requests, settle, skip=settled)

    @translated("inference")
    async def served_version(self) -> int:
        """The oldest policy version any replica serves: episodes spread over every replica, so
        this is what a caller can count on all of them having."""
        stubs = ([self.stub] if self.replicas is None else
                 [inference_pb2_grpc.InferenceStub(channel) for channel in await self.replicas.all_channels()])
        infos = await asyncio.gather(*(stub.GetModelInfo(inference_pb2.GetModelInfoRequest(run_id=self.run_id),
                                                         timeout=self.timeout_s)
                                       for stub in stubs))
        return min(info.policy_version for info in infos)

    @translated("inference")
    async def generate(self, prompt: Sequence[int], *, max_tokens: int, session_id: str = "",
                       seed: int | None = None) -> Turn:
        s = self.sampling
        params = common_pb2.SamplingParams(
            temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, min_p=s.min_p, max_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids, stop=s.stop)
        if seed is not None:  # unset, the engine draws a fresh seed per request
            params.seed = seed
        resp = await self._call(inference_pb2.GenerateRequest(
            prompt_token_ids=prompt, n=1, session_id=session_id, sampling=params, run_id=self.run_id,
            return_routing=self.return_routing, return_kept=self.return_kept))
        c = resp.completions[0]
        return Turn(token_ids=list(c.token_ids), logprobs=list(c.logprobs),
                    policy_versions=list(c.policy_versions),
                    finished_by_stop=c.finish_reason == inference_pb2.FINISH_REASON_STOP,
                    queue_s=resp.queue_s, engine_s=resp.engine_s, routed_experts=c.routed_experts,
                    kept_token_ids=c.kept_token_ids)


class EnvironmentClient:
    """The agent loop's environment over one channel (one gateway, or a proxy in front of several)."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float) -> None:
        self.stub = env_pb2_grpc.EnvironmentStub(channel)
        self.timeout_s = timeout_s

    @translated("env_gateway")
    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        return reset_result(await self.stub.Reset(
            env_pb2.ResetRequest(env_name=env_name, config_json=config_json, seed=seed), timeout=self.timeout_s))

    @translated("env_gateway")
    async def step(self, session_id: str, action: str) -> StepResult:
        return step_result(await self.stub.Step(env_pb2.StepRequest(session_id=session_id, action=action),
                                                timeout=self.timeout_s))

    async def close(self, session_id: str) -> None:
        try:
            await self.stub.Close(env_pb2.CloseRequest(session_id=session_id), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            pass  # the gateway expires idle sessions anyway; closing is a courtesy


class RewardClient:
    """Scoring over one channel. `batch_window_s` > 0: calls that arrive together leave as one
    ScoreBatch (services/rollout/coalescing.py); a batch the server refuses as a whole (one item
    past a size limit) is sent again item by item, so only that item fails. 0: one Score each."""

    def __init__(self, channel: grpc.aio.Channel, *, timeout_s: float, batch_window_s: float = 0.0,
                 tracer: Tracer | None = None) -> None:
        self.stub = reward_pb2_grpc.RewardStub(channel)
        self.timeout_s = timeout_s
        self.batcher = Coalescer(self._score_one, self._score_many, window_s=batch_window_s, max_batch=MAX_SCORE_BATCH,
                                 tracer=tracer, span_name="rollout.score_batch") if batch_window_s > 0 else None

    async def score(self, reward_fn: str, response: str, reference: str, metadata_json: str = "") -> ScoreResult:
        request = reward_pb2.ScoreRequest(reward_fn=reward_fn, response=response, reference=reference,
                                          metadata_json=metadata_json)
        alone = self.batcher is None or request.ByteSize() > MAX_BATCHED_REQUEST_BYTES
        return score_result(await (self._score_one(request) if alone else self.batcher.call(request)))

    async def _score_one(self, request: reward_pb2.ScoreRequest) -> reward_pb2.ScoreResponse:
        try:
            return await self.stub.Score(request, timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            raise backend_error("reward", e.code(), e.details() or "") from e

    async def _score_many(self, requests: list[reward_pb2.ScoreRequest], settle: Settle) -> None:
        try:
            reply = await self.stub.ScoreBatch(reward_pb2.ScoreBatchRequest(items=requests), timeout=self.timeout_s)
        except grpc.aio.AioRpcError as e:
            # Refused whole (one bad item, a message past the limit, an older server) or past the
            # one deadline of slow verifiers: one Score each, each with its own deadline.
            if e.code() not in (*SEND_ALONE_ON, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.DEADLINE_EXCEEDED):
                raise backend_error("reward", e.code(), e.details() or "") from e
            await each_alone(self._score_one, requests, settle)
            return
        if len(reply.results) != len(requests):
            raise BackendError("reward", "INTERNAL", f"ScoreBatch answered {len(reply.results)} of {len(requests)} items")
        # ScoreBatch answers an item Score would refuse (an unknown reward_fn, bad metadata) with an
        # error status instead; sent again alone, such an item gets Score's own answer, so a
        # misconfiguration fails its episode the same way whether or not its call was batched.
        errors = {i for i, result in enumerate(reply.results) if result.status == reward_pb2.SCORE_STATUS_ERROR}
        for i, result in enumerate(reply.results):
            if i not in errors:
                settle(i, result)
        await each_alone(self._score_one, requests, settle, skip=set(range(len(requests))) - errors)
