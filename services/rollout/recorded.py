"""The gRPC edge of black-box episodes: which replica's OpenAI endpoint serves an episode, and
what it recorded (Inference.GetModelInfo's openai_url, Inference.GetEpisode).

Both calls go to the replica the episode id hashes to (the ReplicaSet's rendezvous), so
the agent's calls and the fetch of their record meet on the same process.
"""

from __future__ import annotations

import grpc

from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from arlo.rpc.replicas import ReplicaSet
from services.rollout.agent import Turn
from services.rollout.blackbox import Call
from services.rollout.clients import translated
from services.rollout.types import BackendError


class GrpcRecordings:
    def __init__(self, channel: grpc.aio.Channel | ReplicaSet, *, timeout_s: float, routing: bool = False) -> None:
        """`routing`: keep each turn's recorded experts (this run's trainer.algorithm.routing_replay).
        The endpoint records them for every call on a model with routed experts, whatever the run:
        a service shared by several runs cannot know each one's setting; each run keeps or drops them."""
        self.replicas = channel if isinstance(channel, ReplicaSet) else None
        self.channel = None if self.replicas else channel
        self.timeout_s = timeout_s
        self.routing = routing

    async def _stub(self, episode_id: str) -> inference_pb2_grpc.InferenceStub:
        channel = self.channel if self.replicas is None else await self.replicas.channel(episode_id)
        return inference_pb2_grpc.InferenceStub(channel)

    @translated("inference")
    async def endpoint(self, episode_id: str) -> str:
        stub = await self._stub(episode_id)
        info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=self.timeout_s)
        if not info.openai_url:
            raise BackendError("inference", "FAILED_PRECONDITION",
                               "the OpenAI endpoint is off (inference.openai_port: -1); rollout.agent needs it")
        return info.openai_url

    @translated("inference")
    async def take(self, episode_id: str) -> list[Call]:
        stub = await self._stub(episode_id)
        reply = await stub.GetEpisode(inference_pb2.GetEpisodeRequest(episode_id=episode_id), timeout=self.timeout_s)
        return [Call(prompt=tuple(c.prompt_token_ids), choices=tuple(
            Turn(token_ids=list(ch.token_ids), logprobs=list(ch.logprobs), policy_versions=list(ch.policy_versions),
                 finished_by_stop=ch.finish_reason == inference_pb2.FINISH_REASON_STOP,
                 routed_experts=ch.routed_experts if self.routing else b"") for ch in c.choices))
            for c in reply.calls]
