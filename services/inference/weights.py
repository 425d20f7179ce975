"""Hot weight swap: learn of a new version (pub/sub, polling fallback), pull, verify, swap.

A pull that fails part-way resumes from the bytes already received; a payload whose sha256
does not match the pointer's is thrown away and pulled again. The old weights keep serving
throughout, so a bad publication can never take a replica down.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
from flax import nnx
from redis.exceptions import RedisError

from arlo.background import MustRestart
from arlo.config import TlsConfig
from arlo.coord import WeightPointer, WeightPointerState
from arlo.model.weight_delta import PayloadKind
from arlo.model.weights import nonfinite_param, state_from_bytes
from arlo.proto.v1 import common_pb2, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel
from services.inference.engine import Engine
from services.inference.versions import VersionFetcher

log = logging.getLogger(__name__)


class WeightPullError(Exception):
    """The pulled payload is unusable (checksum, size, gaps); the pull is retried."""


@dataclass
class SyncStats:
    pulls: int = 0
    failures: int = 0
    refused_nonfinite: int = 0
    """Versions whose sha matched but which held NaN or inf: refused, old weights kept."""
    last_swap_s: float = 0.0
    last_sync: dict[str, float] = field(default_factory=dict)
    """The last installed version's marks: version; notified_at, served_at (Unix s); pull_s, verify_s
    (restore and the finiteness check) and swap_s; bytes, what was fetched for it (a delta's
    envelopes, or the payload in the serving dtype); full_bytes, the payload; deltas applied;
    from_storage (1.0: read from trainer.weights.storage, not pulled from the trainer).
    Logged with every swap (bench/step_anatomy.py, bench/real_model_services.py)."""


async def pull_weights(target: str, version: int, *, token: str | None, timeout_s: float = 120.0,
                       max_message_bytes: int = 64 << 20, attempts: int = 3,
                       tls: TlsConfig | None = None, channel: grpc.aio.Channel | None = None,
                       payload: PayloadKind = "full") -> tuple[bytearray, str]:
    """Pulls `version` from a trainer; resumes at the last good offset after a broken stream.
    `channel`: an open channel to `target` to pull over (left open); None opens and closes one.
    `payload`: "delta" pulls the version's delta envelope (arlo/model/weight_delta.py) instead;
    the sha256 returned is then the envelope's, the weights' once applied being in it."""
    kind = common_pb2.WEIGHT_PAYLOAD_DELTA if payload == "delta" else common_pb2.WEIGHT_PAYLOAD_FULL
    if channel is None:
        async with make_channel(target, token=token, max_message_bytes=max_message_bytes, tls=tls) as own:
            return await _pull(trainer_pb2_grpc.TrainerStub(own), version, timeout_s=timeout_s, attempts=attempts,
                               kind=kind)
    return await _pull(trainer_pb2_grpc.TrainerStub(channel), version, timeout_s=timeout_s, attempts=attempts,
                       kind=kind)


def _first_bad_chunk(buf: bytearray, chunks: list[tuple[int, int, str]]) -> int | None:
    """The offset of the first received chunk (offset, length, sha256) that does not match its
    own checksum, if any."""
    view = memoryview(buf)
    try:
        return next((offset for offset, length, digest in chunks
                     if hashlib.sha256(view[offset : offset + length]).hexdigest() != digest), None)
    finally:
        view.release()  # a view left on a bytearray would forbid resizing it


async def _pull(stub: trainer_pb2_grpc.TrainerStub, version: int, *, timeout_s: float,
                attempts: int, kind: int = common_pb2.WEIGHT_PAYLOAD_FULL) -> tuple[bytearray, str]:
    # The payload's digest grows chunk by chunk, hashed in a worker thread (hashlib releases the
    # GIL): no second pass over the whole payload once it is in, and the event loop (which serves
    # Generate streams meanwhile) never hashes; at 1 GB a version that is a second or more. Each
    # chunk's own checksum is checked only when the whole does not match, to name the bad chunk:
    # checking every chunk on the way was a second pass over the payload on every swap's path
    # (bench/weight_sync.py), and the payload's digest refuses the same payloads.
    payload = hashlib.sha256()
    buf = bytearray()
    chunks: list[tuple[int, int, str]] = []  # (offset, length, sha256) of each chunk received
    total: int | None = None
    sha = ""
    for attempt in range(attempts):
        if total is not None and len(buf) == total:
            break  # every byte came before the stream broke: a resume would ask past the end
        try:
            call = stub.PullWeights(trainer_pb2.PullWeightsRequest(version=version, offset=len(buf), payload=kind),
                                    timeout=timeout_s)
            async for chunk in call:
                if chunk.version.version != version:
                    raise WeightPullError(f"asked for version {version}, got {chunk.version.version}")
                if chunk.offset != len(buf):
                    raise WeightPullError(f"chunk at offset {chunk.offset}, expected {len(buf)}")
                data = chunk.data  # once: each read of a bytes field is a copy of it
                await asyncio.to_thread(payload.update, data)
                chunks.append((len(buf), len(data), chunk.chunk_sha256))
                buf += data
                # A delta's bytes have a digest of their own; a full payload's is the version's.
                total, sha = chunk.total_bytes, chunk.payload_sha256 or chunk.version.sha256
            break
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.INVALID_ARGUMENT,
                            grpc.StatusCode.FAILED_PRECONDITION) or attempt == attempts - 1:
                raise
            log.warning("pull of version %d broke at %d bytes (%s); resuming", version, len(buf), e.code())
    if total is None or len(buf) != total:
        raise WeightPullError(f"received {len(buf)} of {total} bytes")
    if payload.hexdigest() != sha:
        bad = await asyncio.to_thread(_first_bad_chunk, buf, chunks)
        if bad is not None:
            raise WeightPullError(f"chunk at offset {bad} fails its checksum")
        raise WeightPullError("payload sha256 does not match the published checksum")
    return buf, sha  # not copied into bytes: at a real model's size that is a second copy of it


def _checked_state(data: bytearray, like: nnx.State) -> tuple[nnx.State, str | None]:
    """The pulled payload as a state shaped like `like`, and its first non-finite parameter (None: all finite)."""
    state = state_from_bytes(data, like)
    return state, nonfinite_param(state)


class Servable(Protocol):
    """What a WeightSync keeps current: the Engine, or a bench's bare parameter tree."""

    @property
    def version(self) -> int: ...

    @property
    def published_state(self) -> Any:
        """The part of the served state a publish carries (with LoRA, the adapters alone)."""
        ...

    @property
    def published_scope(self) -> str:
        """"adapters" when a publish carries LoRA adapters alone, else "model"."""
        ...

    def swap(self, state: Any, version: int) -> None: ...


Restore = Callable[[bytearray, Any], tuple[Any, "str | None"]]
"""A verified payload -> (the state to swap in, shaped like the one served; its first non-finite parameter)."""


def pointer_went_back(served: int, pointer: int) -> MustRestart:
    """The pointer only moves forward (a compare-and-set), so one below the served version was
    written out of band: an operator repairing a hostile or corrupted pointer, or a wiped Redis
    and a trainer numbering afresh. A replica never swaps backwards in place (its prefix cache is
    keyed by version, and the number may now name other weights): it restarts, and a replica
    starting up follows whatever the pointer says (issue 33, item 10: a repaired pointer left
    inference pinned to the hostile version for ~25 minutes)."""
    return MustRestart(f"the weight pointer went back from version {served} (served) to {pointer}; restarting "
                       "to follow it")


class WeightSync:
    """Keeps `engine` on the newest published version."""

    def __init__(self, engine: Engine | Servable, pointer: WeightPointer, *, token: str | None, poll_s: float,
                 max_message_bytes: int, tls: TlsConfig | None = None, restore: Restore | None = None,
                 versions: VersionFetcher | None = None) -> None:
        """`restore`: how a payload becomes a state (default: `state_from_bytes` like the served
        state, then the finiteness check); `versions`: how a version's payload is fetched and held."""
        self.tls = tls
        self.engine = engine
        self.restore = restore or _checked_state
        self.pointer = pointer
        self.token = token
        self.poll_s = poll_s
        self.max_message_bytes = max_message_bytes
        self.stats = SyncStats()
        self.versions = versions or VersionFetcher()
        self._refused: tuple[int, str] | None = None  # the last (version, sha) refused as non-finite
        # One channel to the trainer for every pull: a new connection per version cost a few ms of
        # each swap (bench.step_anatomy's "pull"); a new trainer address gets a new channel.
        self._channel: tuple[str, grpc.aio.Channel] | None = None

    async def _channel_to(self, target: str) -> grpc.aio.Channel:
        if self._channel is not None and self._channel[0] != target:
            await self.aclose()
        if self._channel is None:
            self._channel = (target, make_channel(target, token=self.token, max_message_bytes=self.max_message_bytes,
                                                  tls=self.tls))
        return self._channel[1]

    async def aclose(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            await channel[1].close()

    async def run(self) -> None:
        try:
            await self._follow()
        finally:
            await self.aclose()

    async def _follow(self) -> None:
        backoff = 0.5
        while True:
            newer = await self.pointer.wait_for_newer(self.engine.version, timeout_s=30.0, poll_s=self.poll_s,
                                                      or_older=True)
            if newer is None:
                continue
            if newer.version < self.engine.version:
                raise pointer_went_back(self.engine.version, newer.version)
            try:
                await self.sync_to(newer, notified_at=time.time())
                backoff = 0.5
            except (WeightPullError, grpc.aio.AioRpcError, ValueError) as e:
                # A fresh channel for the retry: a cached one whose trainer went away waits out
                # gRPC's reconnect backoff (up to minutes) before it tries again.
                await self.aclose()
                self.stats.failures += 1
                log.warning("could not install version %d (%s); still serving %d; retrying in %.1fs",
                            newer.version, e, self.engine.version, backoff)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 10.0)

    async def sync_to(self, pointer: WeightPointerState, *, notified_at: float = 0.0) -> None:
        """Pulls, verifies and installs `pointer`'s version; `notified_at`: when the new version was seen."""
        notified_at = notified_at or time.time()
        if self._refused == (pointer.version, pointer.sha256):
            raise WeightPullError(f"version {pointer.version} was refused: it holds NaN or inf")
        if not pointer.source.startswith("grpc://"):
            raise ValueError(f"unsupported weight source {pointer.source!r}")
        if pointer.scope != self.engine.published_scope:
            # A trainer and an inference service configured apart (trainer.lora on one side only):
            # the payload could never be installed, so say what differs instead of a tree mismatch.
            raise ValueError(f"version {pointer.version} holds the {pointer.scope} but this service serves "
                             f"{self.engine.published_scope} publishes: trainer.lora must be the same on both sides")
        loop = asyncio.get_running_loop()
        started = loop.time()
        target = pointer.source.removeprefix("grpc://")

        async def pull(version: int, kind: PayloadKind) -> tuple[bytearray, str]:
            data, sha = await pull_weights(target, version, token=self.token, channel=await self._channel_to(target),
                                           payload=kind)
            if kind == "full" and sha != pointer.sha256:
                raise WeightPullError(f"trainer sent sha256 {sha[:12]}, pointer says {pointer.sha256[:12]}")
            return data, sha

        # By deltas onto the payload held, or from shared storage, where the pointer allows; the
        # trainer's full payload otherwise. Whatever the path, checked against the pointer.
        fetched = await self.versions.fetch(pointer, pull)
        data = fetched.data
        pulled = loop.time()
        # A checksum proves the bytes are the trainer's, not that they are usable: a NaN
        # version would make the replica emit token 0 forever. Both on one worker thread: each
        # hop to a thread and back is on a synchronous step's critical path.
        state, bad = await asyncio.to_thread(self.restore, data, self.engine.published_state)
        if bad is not None:
            self._refused = (pointer.version, pointer.sha256)
            self.stats.refused_nonfinite += 1
            log.error("refusing version %d: parameter %r holds NaN or inf; still serving %d", pointer.version, bad,
                      self.engine.version, extra={"refused_version": pointer.version})
            raise WeightPullError(f"version {pointer.version}: parameter {bad!r} holds NaN or inf")
        if pointer.version > self.engine.version:
            verified = loop.time()
            self.engine.swap(state, pointer.version)
            self.versions.keep(data, pointer.version)
            self.stats.pulls += 1
            self.stats.last_swap_s = loop.time() - started
            self.stats.last_sync = {"version": pointer.version, "notified_at": notified_at, "served_at": time.time(),
                                    "pull_s": pulled - started, "verify_s": verified - pulled,
                                    "swap_s": loop.time() - verified, "bytes": fetched.fetched_bytes,
                                    "full_bytes": len(data), "deltas": fetched.deltas,
                                    "from_storage": float(fetched.from_storage)}
            log.info("serving version %d (%s, %d bytes fetched, %.3fs)", pointer.version, fetched.kind,
                     fetched.fetched_bytes, self.stats.last_swap_s, extra={"weight_sync": self.stats.last_sync})
            try:
                await self.pointer.announce_served(pointer.version)
            except (RedisError, OSError) as e:  # the gates re-check on their own poll
                log.warning("could not announce version %d: %s", pointer.version, e)
