"""Thin gRPC servicer for arlo.v1.Trainer over the training loop and the version store."""

from __future__ import annotations

from collections.abc import AsyncIterator

import grpc

from arlo.background import MustRestart
from arlo.coord import WeightPointerState
from arlo.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.trainer.loop import TrainingLoop
from services.trainer.publish import check_chunk_bytes, iter_chunks


class TrainerServicer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self, loop: TrainingLoop) -> None:
        self.loop = loop

    async def GetStatus(self, request, context):  # noqa: N802 (gRPC names)
        s = self.loop.state
        last = s.last
        return trainer_pb2.GetStatusResponse(
            version=s.version, step=self.loop.learner.step_count, paused=s.paused,
            checkpoint_version=s.checkpoint_version, trajectories_consumed=s.consumed,
            trajectories_dropped=sum(self.loop.dropped().values()),
            last_loss=last.loss if last else 0.0, last_reward=last.reward_mean if last else 0.0,
            phase=self.loop.phase, sft_steps=self.loop.sft_steps, last_staleness=s.last_staleness,
            tokens_trained=s.tokens_trained, until_step=s.until_step, failed_steps=s.failed_steps,
            publish_failures=s.publish_failures, pointer_conflicts=s.pointer_conflicts,
            checkpoint_failures=s.checkpoint_failures, checkpoint_error=s.checkpoint_error,
            held_entries=s.held_entries, acked_undurable=s.acked_undurable,
            checkpoint_fallbacks=s.checkpoint_fallbacks,
        )

    async def PullWeights(  # noqa: N802
        self, request: trainer_pb2.PullWeightsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[trainer_pb2.PullWeightsResponse]:
        try:
            chunk_bytes = check_chunk_bytes(request.chunk_bytes)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if request.version < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "version must be >= 0 (0 = newest)")
        published = self.loop.store.get(request.version)
        if published is None:
            held = self.loop.store.newest_version
            await context.abort(grpc.StatusCode.NOT_FOUND,
                                f"version {request.version} is not held (newest held: {held or 'none'})")
        sent = published
        if request.payload == common_pb2.WEIGHT_PAYLOAD_DELTA:
            if published.delta is None:
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                                    f"version {published.version} was published full, not as a delta")
            sent = published.delta
        elif request.payload not in (common_pb2.WEIGHT_PAYLOAD_FULL, common_pb2.WEIGHT_PAYLOAD_UNSPECIFIED):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown payload kind {request.payload}")
        if request.offset >= max(len(sent.data), 1):
            await context.abort(grpc.StatusCode.OUT_OF_RANGE,
                                f"offset {request.offset} >= payload size {len(sent.data)}")
        version = WeightPointerState(
            version=published.version, source=self.loop.source, sha256=published.sha256,
            checkpoint_version=self.loop.state.checkpoint_version,
            checkpoint_uri=self.loop.state.checkpoint_uri, time=published.time, payload=published.kind,
            base_version=published.version - 1 if published.kind == "delta" else 0,
            full_version=published.full_version,
        ).to_proto()
        async for chunk in iter_chunks(sent, offset=request.offset, chunk_bytes=chunk_bytes):
            self.loop.store.sent_bytes += len(chunk.data)
            yield trainer_pb2.PullWeightsResponse(
                version=version, offset=chunk.offset, data=chunk.data, total_bytes=len(sent.data),
                chunk_sha256=chunk.sha256, payload=request.payload, payload_sha256=sent.sha256,
            )

    async def SaveCheckpoint(self, request, context):  # noqa: N802
        try:
            version, uri = await self.loop.checkpoint()
        except ValueError as e:  # no checkpoint_dir, or nothing published yet
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        except MustRestart as e:  # the run was taken over, or the state is damaged: this trainer stops
            await context.abort(grpc.StatusCode.ABORTED, f"checkpoint refused: {e}")
        except Exception as e:  # the write itself failed (disk full, permissions, ...)
            await context.abort(grpc.StatusCode.INTERNAL, f"checkpoint failed: {type(e).__name__}: {e}")
        return trainer_pb2.SaveCheckpointResponse(checkpoint_version=version, checkpoint_uri=uri)

    async def Pause(self, request, context):  # noqa: N802
        await self.loop.pause()
        return trainer_pb2.PauseResponse(paused=True)

    async def Resume(self, request, context):  # noqa: N802
        if request.until_step < 0:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "until_step must be >= 0 (0 = no limit)")
        return trainer_pb2.ResumeResponse(paused=self.loop.resume(request.until_step))
