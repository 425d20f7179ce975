"""Thin gRPC servicer for arlo.v1.Inference: protobuf <-> engine types, errors -> status codes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from services.inference.engine import Engine, Sample, SamplingRequest

FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH}
MAX_ID_BYTES = 128


def to_sampling_request(req: inference_pb2.GenerateRequest) -> SamplingRequest:
    if len(req.session_id.encode()) > MAX_ID_BYTES or len(req.request_id.encode()) > MAX_ID_BYTES:
        raise ValueError(f"session_id and request_id are at most {MAX_ID_BYTES} bytes")
    if not req.HasField("sampling") or req.sampling.max_tokens == 0:
        raise ValueError("sampling.max_tokens is required (>= 1)")
    s = req.sampling
    return SamplingRequest(
        prompt=tuple(req.prompt_token_ids), n=req.n or 1, max_tokens=s.max_tokens,
        temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids), stop_strings=tuple(s.stop),
    )


def to_completion(sample: Sample) -> inference_pb2.Completion:
    return inference_pb2.Completion(
        token_ids=sample.token_ids, logprobs=sample.logprobs,
        policy_versions=sample.policy_versions, finish_reason=FINISH[sample.finish_reason],
    )


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine, tokenizer_name: str) -> None:
        self.engine = engine
        self.tokenizer_name = tokenizer_name
        # One generation on the device at a time; cross-request batching is the engine's job.
        self._device = asyncio.Lock()

    async def _run(self, req: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> list[Sample]:
        try:
            sampling = to_sampling_request(req)
            async with self._device:
                return await asyncio.to_thread(self.engine.generate, sampling)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # unreachable: abort raises

    async def Generate(self, request, context):  # noqa: N802 (gRPC names)
        version = self.engine.version
        samples = await self._run(request, context)
        return inference_pb2.GenerateResponse(
            completions=[to_completion(s) for s in samples], policy_version=version)

    async def GenerateStream(  # noqa: N802
        self, request: inference_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        if request.request.n > 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GenerateStream takes n = 1")
        (sample,) = await self._run(request.request, context)
        # Token-by-token streaming from inside the decode loop comes with the continuous-batching
        # engine; until then the completion is sent as one message.
        yield inference_pb2.GenerateStreamResponse(
            token_ids=sample.token_ids, logprobs=sample.logprobs,
            policy_versions=sample.policy_versions, finish_reason=FINISH[sample.finish_reason])

    async def GetModelInfo(self, request, context):  # noqa: N802
        e = self.engine
        return inference_pb2.GetModelInfoResponse(
            model_name=e.model_name, tokenizer=self.tokenizer_name, vocab_size=e.model_cfg.vocab_size,
            max_seq_len=e.model_cfg.max_seq_len, max_prompt_tokens=e.limits.max_prompt_tokens,
            max_tokens=e.limits.max_tokens, max_n=e.limits.max_n, policy_version=e.version,
            eos_token_id=e.tokenizer.eos_id,
        )
