"""gRPC servicer for `arlo.v1.Reward`: checks request bounds, converts protobuf <-> scoring types."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from typing import Any

import grpc
from prometheus_client import CollectorRegistry, Counter

from arlo.proto.v1 import reward_pb2, reward_pb2_grpc
from arlo.rpc import utf8_too_long
from services.reward.registry import RewardRegistry, RewardSpec
from services.reward.scoring import ScoreOutcome, Scorer, ScoreStatus, error, parse_metadata

SERVICE_NAME = reward_pb2.DESCRIPTOR.services_by_name["Reward"].full_name

# Bounds from reward.proto.
MAX_NAME_BYTES = 128
MAX_TEXT_BYTES = 1 << 20
MAX_METADATA_BYTES = 64 << 10
MAX_BATCH_ITEMS = 1024

_STATUS = {
    ScoreStatus.OK: reward_pb2.SCORE_STATUS_OK,
    ScoreStatus.ERROR: reward_pb2.SCORE_STATUS_ERROR,
    ScoreStatus.TIMEOUT: reward_pb2.SCORE_STATUS_TIMEOUT,
}


def size_problem(item: reward_pb2.ScoreRequest, prefix: str = "") -> str | None:
    """The first over-limit field of `item`, as an INVALID_ARGUMENT message, else None."""
    for name, limit in (("reward_fn", MAX_NAME_BYTES), ("response", MAX_TEXT_BYTES),
                        ("reference", MAX_TEXT_BYTES), ("metadata_json", MAX_METADATA_BYTES)):
        problem = utf8_too_long(prefix + name, getattr(item, name), limit)
        if problem:
            return problem
    return None


def to_proto(outcome: ScoreOutcome) -> reward_pb2.ScoreResponse:
    return reward_pb2.ScoreResponse(reward=outcome.reward, components=dict(outcome.components),
                                    status=_STATUS[outcome.status], error=outcome.error)


class RewardServicer(reward_pb2_grpc.RewardServicer):
    def __init__(self, registry: RewardRegistry, scorer: Scorer, *,
                 metrics_registry: CollectorRegistry | None = None) -> None:
        self._registry = registry
        self._scorer = scorer
        # Non-OK scores are the ones that silently corrupt training elsewhere: count them.
        self._scores = Counter("arlo_reward_scores", "Scored items by reward function and status.",
                               ["reward_fn", "status"], registry=metrics_registry or CollectorRegistry())

    def _unknown(self, name: str) -> str:
        if not name:
            return f"reward_fn is required; known: {self._registry.names()}"
        return f"unknown reward_fn {name!r}; known: {self._registry.names()}"

    async def _score(self, spec: RewardSpec, item: reward_pb2.ScoreRequest, metadata: Mapping[str, Any]) -> ScoreOutcome:
        outcome = await self._scorer.score(spec.fn, item.response, item.reference, metadata)
        self._scores.labels(spec.name, outcome.status.value).inc()
        return outcome

    async def Score(self, request: reward_pb2.ScoreRequest,
                    context: grpc.aio.ServicerContext) -> reward_pb2.ScoreResponse:
        problem = size_problem(request)
        if problem:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        spec = self._registry.get(request.reward_fn)
        if spec is None:
            code = grpc.StatusCode.NOT_FOUND if request.reward_fn else grpc.StatusCode.INVALID_ARGUMENT
            await context.abort(code, self._unknown(request.reward_fn))
        try:
            metadata = parse_metadata(request.metadata_json)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        return to_proto(await self._score(spec, request, metadata))

    async def _score_item(self, item: reward_pb2.ScoreRequest) -> ScoreOutcome:
        spec = self._registry.get(item.reward_fn)
        if spec is None:
            self._scores.labels("<unknown>", ScoreStatus.ERROR.value).inc()
            return error(self._unknown(item.reward_fn))
        try:
            metadata = parse_metadata(item.metadata_json)
        except ValueError as e:
            self._scores.labels(spec.name, ScoreStatus.ERROR.value).inc()
            return error(str(e))
        return await self._score(spec, item, metadata)

    async def ScoreBatch(self, request: reward_pb2.ScoreBatchRequest,
                         context: grpc.aio.ServicerContext) -> reward_pb2.ScoreBatchResponse:
        if not 1 <= len(request.items) <= MAX_BATCH_ITEMS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"items has {len(request.items)} entries; send 1 to {MAX_BATCH_ITEMS}")
        for i, item in enumerate(request.items):
            problem = size_problem(item, f"items[{i}].")
            if problem:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, problem)
        outcomes = await asyncio.gather(*(self._score_item(item) for item in request.items))
        return reward_pb2.ScoreBatchResponse(results=[to_proto(o) for o in outcomes])

    async def ListRewardFunctions(self, request: reward_pb2.ListRewardFunctionsRequest,
                                  context: grpc.aio.ServicerContext) -> reward_pb2.ListRewardFunctionsResponse:
        return reward_pb2.ListRewardFunctionsResponse(functions=[
            reward_pb2.RewardFunctionInfo(name=s.name, description=s.description) for s in self._registry.specs()])
