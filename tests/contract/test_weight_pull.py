"""The inference side of a weight pull against a scripted Trainer service on an ephemeral port:
a broken stream resumes at the last good offset and still yields the exact payload; a chunk that
fails its own checksum, or a payload whose digest is not the version's, is refused."""

from __future__ import annotations

import hashlib
import os
from collections.abc import AsyncIterator

import grpc
import pytest

from arlo.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from services.inference.weights import WeightPullError, pull_weights
from tests.support.scripted_server import scripted_server

CHUNK = 64 << 10
PAYLOAD = os.urandom(5 * CHUNK + 123)


class ScriptedTrainer(trainer_pb2_grpc.TrainerServicer):
    def __init__(self) -> None:
        self.break_after: int | None = None  # chunks sent before the first stream breaks
        self.corrupt_offset: int | None = None  # this chunk's bytes differ from its checksum
        self.version_sha = hashlib.sha256(PAYLOAD).hexdigest()
        self.offsets: list[int] = []

    async def PullWeights(self, request, context) -> AsyncIterator[trainer_pb2.PullWeightsResponse]:  # noqa: N802
        self.offsets.append(request.offset)
        if request.offset >= len(PAYLOAD):  # as the real trainer answers (services/trainer/server.py)
            await context.abort(grpc.StatusCode.OUT_OF_RANGE, f"offset {request.offset} >= payload size")
        version = common_pb2.WeightVersion(version=request.version, sha256=self.version_sha)
        for sent, start in enumerate(range(request.offset, len(PAYLOAD), CHUNK)):
            if self.break_after is not None and sent == self.break_after:
                self.break_after = None
                await context.abort(grpc.StatusCode.UNAVAILABLE, "stream broke")
            piece = PAYLOAD[start : start + CHUNK]
            digest = hashlib.sha256(piece).hexdigest()
            if start == self.corrupt_offset:
                piece = bytes([piece[0] ^ 1]) + piece[1:]
            yield trainer_pb2.PullWeightsResponse(version=version, offset=start, data=piece,
                                                  total_bytes=len(PAYLOAD), chunk_sha256=digest)
        if self.break_after is not None:  # at or past the last chunk: the stream breaks after it
            self.break_after = None
            await context.abort(grpc.StatusCode.UNAVAILABLE, "stream broke after the last chunk")


@pytest.fixture
async def trainer() -> AsyncIterator[tuple[ScriptedTrainer, str]]:
    servicer = ScriptedTrainer()
    async with scripted_server(trainer_pb2_grpc.add_TrainerServicer_to_server, servicer) as address:
        yield servicer, address


async def test_a_whole_pull_is_the_exact_payload(trainer: tuple[ScriptedTrainer, str]) -> None:
    servicer, target = trainer
    data, sha = await pull_weights(target, 3, token=None, timeout_s=10)
    assert bytes(data) == PAYLOAD and sha == hashlib.sha256(PAYLOAD).hexdigest() and servicer.offsets == [0]


async def test_a_broken_stream_resumes_at_the_last_good_offset(trainer: tuple[ScriptedTrainer, str]) -> None:
    servicer, target = trainer
    servicer.break_after = 2
    data, _ = await pull_weights(target, 3, token=None, timeout_s=10)
    assert bytes(data) == PAYLOAD and servicer.offsets == [0, 2 * CHUNK]


async def test_a_stream_that_breaks_after_its_last_chunk_keeps_the_whole_payload(
        trainer: tuple[ScriptedTrainer, str]) -> None:
    """Every byte arrived, then the status did not (a deadline, a dropped connection): nothing is
    left to resume, and a resume at the end would be refused as OUT_OF_RANGE by the trainer."""
    servicer, target = trainer
    servicer.break_after = 6  # the payload's 6 chunks, then the break
    data, _ = await pull_weights(target, 3, token=None, timeout_s=10)
    assert bytes(data) == PAYLOAD and servicer.offsets == [0]


@pytest.mark.parametrize(("corrupt", "break_after"), [
    (0, None), (3 * CHUNK, None),
    (5 * CHUNK, None),  # the last chunk
    (CHUNK, 2),  # the stream breaks after the bad chunk: the resumed pull is refused all the same
])
async def test_a_chunk_that_fails_its_checksum_is_refused(trainer: tuple[ScriptedTrainer, str], corrupt: int,
                                                          break_after: int | None) -> None:
    """The payload's digest refuses it; the chunks' own checksums name the bad one."""
    servicer, target = trainer
    servicer.corrupt_offset, servicer.break_after = corrupt, break_after
    with pytest.raises(WeightPullError, match=f"chunk at offset {corrupt} fails its checksum"):
        await pull_weights(target, 3, token=None, timeout_s=10)
    assert servicer.offsets == ([0] if break_after is None else [0, break_after * CHUNK])


async def test_a_payload_that_is_not_the_versions_is_refused(trainer: tuple[ScriptedTrainer, str]) -> None:
    """Every chunk matches its own checksum, but the whole is not what the version says (the
    running digest, across a resumed stream too)."""
    servicer, target = trainer
    servicer.version_sha, servicer.break_after = hashlib.sha256(PAYLOAD[:-1]).hexdigest(), 1
    with pytest.raises(WeightPullError, match="payload sha256 does not match"):
        await pull_weights(target, 3, token=None, timeout_s=10)
    assert servicer.offsets == [0, CHUNK]
