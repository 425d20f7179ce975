"""Thin gRPC servicer for arlo.v1.Inference: protobuf <-> engine types, errors -> status codes.

Handlers never run the model: they submit to the engine's loop (its own thread) and await
an asyncio future or queue that the engine's callbacks fill, so many concurrent calls share
every decode step. A client that goes away (CancelledError in the handler) cancels its
request, which frees its slots at the next chunk boundary.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import AsyncIterator

import grpc

from arlo.budget import runs_under
from arlo.filter_replay import GREEDY_BELOW, MAX_KEPT_WIDTH, kept_ids, kept_width, pack_kept
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from arlo.routing_replay import pack_recorded
from services.inference.bridge import Bridge
from services.inference.engine import Engine, Sample, SamplingRequest, TokenDelta
from services.inference.episodes import EpisodeRecorder

FINISH = {"stop": inference_pb2.FINISH_REASON_STOP, "length": inference_pb2.FINISH_REASON_LENGTH,
          "abort": inference_pb2.FINISH_REASON_ABORT}
MAX_ID_BYTES = 128
MAX_BATCH_REQUESTS = 256
"""GenerateBatch's bound (inference.proto)."""
MAX_BATCH_MESSAGE_BYTES = 4 << 20
"""Results that finished together share a GenerateBatch message up to this size: 256 long
completions in one message could pass the channel's max message size (64 MiB by default)."""


def to_sampling_request(req: inference_pb2.GenerateRequest, runs: dict[str, int] | None = None) -> SamplingRequest:
    """`runs`: run_id -> adapter slot of the runs this service serves (services/inference/runs.py);
    a request's empty run_id is the service's own run (slot 0)."""
    if len(req.session_id.encode()) > MAX_ID_BYTES or len(req.request_id.encode()) > MAX_ID_BYTES:
        raise ValueError(f"session_id and request_id are at most {MAX_ID_BYTES} bytes")
    adapter = slot_of_run(req.run_id, runs)
    if not req.HasField("sampling") or req.sampling.max_tokens == 0:
        raise ValueError("sampling.max_tokens is required (>= 1)")
    s = req.sampling
    return SamplingRequest(
        prompt=tuple(req.prompt_token_ids), n=req.n, max_tokens=s.max_tokens,
        temperature=s.temperature, top_p=s.top_p or 1.0, top_k=s.top_k, min_p=s.min_p,
        seed=s.seed if s.HasField("seed") else None,
        stop_token_ids=tuple(s.stop_token_ids), stop_strings=tuple(s.stop),
        # Sessions park KV written by one run's adapter: another run's request must never reuse it.
        session_id=f"{adapter}:{req.session_id}" if adapter and req.session_id else req.session_id,
        adapter=adapter, return_routing=req.return_routing, top_logprobs=_kept_of(req),
    )


def _kept_of(req: inference_pb2.GenerateRequest) -> int:
    """The K of the kept sets `req` asks for (filter replay; 0: none)."""
    if not req.return_kept:
        return 0
    s = req.sampling
    width = kept_width(temperature=s.temperature, top_k=s.top_k)
    if not width:
        raise ValueError(f"return_kept needs sampling.top_k in [1, {MAX_KEPT_WIDTH}] and a temperature of at least "
                         f"{GREEDY_BELOW} (got top_k {s.top_k}, temperature {s.temperature})")
    return width


def slot_of_run(run_id: str, runs: dict[str, int] | None) -> int:
    """The adapter slot of `run_id`; ValueError for a run this service does not serve (a rollout
    pointed at another run's inference would otherwise sample that run's policy as its own)."""
    if not run_id or runs is None:
        return 0
    if run_id not in runs:
        raise ValueError(f"run_id {run_id[:MAX_ID_BYTES]!r} is not served here (serving {sorted(runs)})")
    return runs[run_id]


def to_completion(sample: Sample, routing: tuple[int, int, int] | None = None, kept: int = 0) -> inference_pb2.Completion:
    """`routing`: the model's routing_shape, for packing `Sample.routed_experts` (arlo/routing_replay.py).
    `kept`: the K of the kept sets asked for (filter replay), read off `Sample.top_ids`; 0: none."""
    kept_ids_ = (kept_ids(sample.top_ids, sample.top_logprobs, kept)
                 if kept and sample.top_ids is not None and sample.top_logprobs is not None else None)
    return inference_pb2.Completion(
        token_ids=sample.token_ids, logprobs=sample.logprobs, policy_versions=sample.policy_versions,
        finish_reason=FINISH[sample.finish_reason], routed_experts=pack_recorded(sample.routed_experts, routing),
        kept_token_ids=pack_kept(kept_ids_))


def _put_at(bridge: Bridge, index: int, result: list[Sample] | BaseException) -> None:
    bridge.put((index, result))


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    def __init__(self, engine: Engine, tokenizer_name: str, *, recorder: EpisodeRecorder | None = None,
                 runs: dict[str, int] | None = None) -> None:
        """`runs`: run_id -> adapter slot when several runs share this service (None: one run)."""
        self.engine = engine
        self.runs = runs
        self.tokenizer_name = tokenizer_name
        self.recorder = recorder
        self.openai_url = ""
        """Set once the OpenAI endpoint listens (services.inference.openai_http)."""

    async def _submit(self, req: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext, *,
                      stream: bool) -> tuple[int, Bridge]:
        bridge = Bridge()
        try:
            handle = self.engine.submit(to_sampling_request(req, self.runs), on_tokens=bridge.put if stream else None,
                                        on_done=bridge.put)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except RuntimeError as e:
            await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
        else:
            return handle.id, bridge
        raise AssertionError("unreachable: abort raises")

    def _response(self, result: list[Sample], request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        first = result[0].policy_versions[:1] if result else []
        kept = _kept_of(request)
        return inference_pb2.GenerateResponse(completions=[to_completion(s, self.engine.routing, kept) for s in result],
                                              policy_version=first[0] if first else self.engine.version,
                                              queue_s=result[0].queue_s if result else 0.0,
                                              engine_s=result[0].engine_s if result else 0.0)

    async def Generate(self, request, context):  # noqa: N802 (gRPC names)
        request_id, bridge = await self._submit(request, context, stream=False)
        try:
            result = await bridge.queue.get()
        except asyncio.CancelledError:
            self.engine.cancel(request_id)
            raise
        if isinstance(result, BaseException):
            await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {result}")
        return self._response(result, request)

    async def GenerateBatch(  # noqa: N802
        self, request: inference_pb2.GenerateBatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateBatchResponse]:
        """Every valid request goes to the engine in one submit (one admission); the refused ones
        get their INVALID_ARGUMENT results first, the rest as they finish, those that finished
        together in one message."""
        if not 1 <= len(request.requests) <= MAX_BATCH_REQUESTS:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                f"requests: 1 to {MAX_BATCH_REQUESTS}, got {len(request.requests)}")
        refused, indices, sampling = [], [], []
        for i, req in enumerate(request.requests):
            try:
                sr = to_sampling_request(req, self.runs)
                self.engine.validate(sr)
            except ValueError as e:
                refused.append(inference_pb2.GenerateBatchResult(
                    index=i, code=grpc.StatusCode.INVALID_ARGUMENT.value[0], message=str(e)))
                continue
            indices.append(i)
            sampling.append(sr)
        bridge = Bridge()
        running: dict[int, int] = {}
        if sampling:  # submitted before the refusals are sent: the engine need not wait for a write
            try:
                handles = self.engine.submit_many(sampling, on_done=[functools.partial(_put_at, bridge, i)
                                                                     for i in indices])
            except RuntimeError as e:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(e))
            running = dict(zip(indices, (h.id for h in handles), strict=True))
        try:
            if refused:
                yield inference_pb2.GenerateBatchResponse(results=refused)
            while running:
                finished = [await bridge.queue.get()]
                while not bridge.queue.empty():
                    finished.append(bridge.queue.get_nowait())
                for i, _ in finished:
                    running.pop(i, None)
                for results in runs_under([self._batch_result(i, r, request.requests[i]) for i, r in finished],
                                          inference_pb2.GenerateBatchResult.ByteSize, MAX_BATCH_MESSAGE_BYTES):
                    yield inference_pb2.GenerateBatchResponse(results=results)
        finally:
            for request_id in running.values():  # the client went away (CancelledError) or the stream broke
                self.engine.cancel(request_id)

    def _batch_result(self, index: int, result: list[Sample] | BaseException,
                      request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateBatchResult:
        if isinstance(result, BaseException):
            return inference_pb2.GenerateBatchResult(index=index, code=grpc.StatusCode.INTERNAL.value[0],
                                                     message=f"generation failed: {result}")
        return inference_pb2.GenerateBatchResult(index=index, response=self._response(result, request))

    async def GenerateStream(  # noqa: N802
        self, request: inference_pb2.GenerateStreamRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateStreamResponse]:
        if request.request.n > 1:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GenerateStream takes n = 1")
        if request.request.return_kept:  # GenerateStreamResponse has no kept sets to carry them
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "GenerateStream does not return kept sets "
                                "(return_kept): use Generate or GenerateBatch")
        request_id, bridge = await self._submit(request.request, context, stream=True)
        finished = False
        try:
            while not finished:
                item = await bridge.queue.get()
                if isinstance(item, BaseException):
                    await context.abort(grpc.StatusCode.INTERNAL, f"generation failed: {item}")
                if not isinstance(item, TokenDelta):  # the sample list: only an abort ends here
                    finished = True
                    yield inference_pb2.GenerateStreamResponse(finish_reason=inference_pb2.FINISH_REASON_ABORT)
                    continue
                finished = item.finish_reason is not None
                yield inference_pb2.GenerateStreamResponse(
                    token_ids=item.token_ids, logprobs=item.logprobs, policy_versions=item.policy_versions,
                    finish_reason=FINISH[item.finish_reason] if finished else inference_pb2.FINISH_REASON_UNSPECIFIED,
                    routed_experts=pack_recorded(item.routed_experts, self.engine.routing))
        finally:
            if not finished:  # the client went away (CancelledError) or the stream broke
                self.engine.cancel(request_id)

    async def GetModelInfo(self, request, context):  # noqa: N802
        e = self.engine
        try:
            slot = slot_of_run(request.run_id, self.runs)
        except ValueError as err:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(err))
        return inference_pb2.GetModelInfoResponse(
            model_name=e.model_name, tokenizer=self.tokenizer_name, vocab_size=e.model_cfg.vocab_size,
            max_seq_len=e.max_seq_len, max_prompt_tokens=e.config.max_prompt_tokens,
            max_tokens=e.config.max_tokens, max_n=e.config.max_n, policy_version=e.versions[slot],
            eos_token_id=e.tokenizer.eos_id, openai_url=self.openai_url,
        )

    async def GetEpisode(self, request, context):  # noqa: N802
        if len(request.episode_id.encode()) > MAX_ID_BYTES or not request.episode_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"episode_id must be 1 to {MAX_ID_BYTES} bytes")
        log = self.recorder.take(request.episode_id, keep=request.keep) if self.recorder else None
        if log is None:
            return inference_pb2.GetEpisodeResponse()
        return inference_pb2.GetEpisodeResponse(dropped_calls=log.dropped, calls=[inference_pb2.RecordedCall(
            prompt_token_ids=c.prompt_token_ids, kind=c.kind, continued=c.continued, created_at=c.created_at,
            choices=[inference_pb2.RecordedChoice(token_ids=ch.token_ids, logprobs=ch.logprobs,
                                                  policy_versions=ch.policy_versions,
                                                  finish_reason=FINISH[ch.finish_reason],
                                                  routed_experts=ch.routed_experts) for ch in c.choices])
            for c in log.calls])
