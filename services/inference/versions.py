"""A version's payload for a replica, checked against the weight pointer before anything uses it.

    pointer (full)  -> the full file in storage, else PullWeights FULL from the trainer
    pointer (delta) -> the deltas after the version held, applied in order onto the payload held
                       (or onto the newest full, when the replica holds nothing that recent),
                       each read from storage, else PullWeights DELTA
    any failure     -> PullWeights FULL of the pointer's version from the trainer

The result's sha256 is always checked against the pointer, whatever the path: a delta applied
onto the wrong base, a torn file or a corrupted body cannot reach the engine. The payload held
for the next delta is the one the engine serves; a failure part-way through applying drops it
(the next install starts from a full payload), never the served weights.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import grpc

from arlo.coord import WeightPointerState
from arlo.model.weight_delta import Envelope, PayloadKind, apply_delta, unpack
from arlo.model.weight_files import read_version

log = logging.getLogger(__name__)

Pull = Callable[[int, PayloadKind], Awaitable[tuple[bytearray, str]]]
"""Pulls (version, kind) from the trainer: the payload (a delta's envelope) and its sha256, checked."""


class VersionFetchError(ValueError):
    """The chain of files or deltas did not give the pointer's weights; a full pull follows."""


@dataclass(frozen=True, slots=True)
class Fetched:
    data: bytearray
    """The full payload of the pointer's version, its sha256 checked."""
    kind: PayloadKind
    """"delta" when built from the payload held or the newest full by deltas."""
    fetched_bytes: int
    """What came over the wire or from storage for it."""
    deltas: int
    from_storage: bool


class VersionFetcher:
    """Holds the payload of the version served, to apply the next deltas onto."""

    def __init__(self, *, copy_on_write: bool = False) -> None:
        """`copy_on_write`: deltas apply onto a copy of the payload held, never onto it, for a
        target whose served state shares its bytes (bench/weight_replica.py's tree is views into
        it: one copy of the weights in memory, not two). The engine's state is its own (on the
        device), so by default the payload held is rewritten in place."""
        self.copy_on_write = copy_on_write
        self.held: bytearray | None = None
        self.held_version = 0
        self.fallbacks = 0
        """Installs that fell back to a full pull from the trainer (a bad file or delta, a gap)."""

    def keep(self, data: bytearray, version: int) -> None:
        """`data` is now the served version's payload."""
        self.held, self.held_version = data, version

    async def fetch(self, pointer: WeightPointerState, pull: Pull) -> Fetched:
        try:
            fetched = await self._by_chain(pointer, pull)
            if fetched is not None:
                return fetched
        except (VersionFetchError, ValueError, OSError, grpc.aio.AioRpcError) as e:
            self.fallbacks += 1
            log.warning("version %d by %s failed (%s); pulling it full from the trainer", pointer.version,
                        "storage" if pointer.storage else "deltas", e, extra={"weight_fallbacks": self.fallbacks})
        self.held = None
        data, _ = await pull(pointer.version, "full")  # `pull` checks it against the pointer
        return Fetched(data=data, kind="full", fetched_bytes=len(data), deltas=0, from_storage=False)

    async def _by_chain(self, pointer: WeightPointerState, pull: Pull) -> Fetched | None:
        """None when there is nothing better than the trainer's full payload to try."""
        if pointer.payload == "full" and not pointer.storage:
            return None
        start = pointer.chain_start
        fetched = 0
        if self.held is not None and start <= self.held_version < pointer.version and pointer.payload == "delta":
            buf, at = (bytearray(self.held) if self.copy_on_write else self.held), self.held_version
            if not self.copy_on_write:
                self.held = None  # rewritten below: until it checks out it is no version at all
        else:
            if not pointer.storage:
                return None  # the trainer keeps the newest versions full: one pull, not a full and deltas
            self.held = None  # a full payload replaces it: not two beside the served state
            envelope = await _read(pointer, start, "full")
            env = await asyncio.to_thread(unpack, envelope)
            _check_envelope(env, start, "full")
            fetched += len(envelope)
            buf, at = _body(envelope, env), start
        deltas = 0
        for version in range(at + 1, pointer.version + 1):
            envelope = await _read(pointer, version, "delta") if pointer.storage else (await pull(version, "delta"))[0]
            env = await asyncio.to_thread(unpack, envelope)
            _check_envelope(env, version, "delta")
            await asyncio.to_thread(apply_delta, buf, env)
            fetched += len(envelope)
            deltas += 1
        # A full file alone was checked whole as it was read (its body's sha256 is the weights').
        _check(await asyncio.to_thread(_sha256, buf) if deltas else env.body_sha256, pointer)
        return Fetched(data=buf, kind="delta" if deltas else "full", fetched_bytes=fetched, deltas=deltas,
                       from_storage=bool(pointer.storage))


async def _read(pointer: WeightPointerState, version: int, kind: PayloadKind) -> bytearray:
    try:
        return await asyncio.to_thread(read_version, pointer.storage, version, kind)
    except FileNotFoundError as e:
        raise VersionFetchError(f"version {version} ({kind}) is not in {pointer.storage}") from e


def _body(envelope: bytearray, env: Envelope) -> bytearray:
    """The full payload inside `envelope`, without a second copy (a bytearray drops its head in place)."""
    size = len(env.body)
    env_body = env.body
    if isinstance(env_body, memoryview):
        env_body.release()
    del envelope[: len(envelope) - size]
    return envelope


def _check_envelope(env: Envelope, version: int, kind: PayloadKind) -> None:
    if env.version != version or env.kind != kind:
        raise VersionFetchError(f"asked for version {version} ({kind}), the file holds {env.version} ({env.kind})")
    if kind == "delta" and env.base_version != version - 1:
        raise VersionFetchError(f"the delta of version {version} applies onto {env.base_version}, not {version - 1}")


def _check(sha: str, pointer: WeightPointerState) -> None:
    if sha != pointer.sha256:
        raise VersionFetchError(f"version {pointer.version}'s weights hash to {sha[:12]}, the pointer says "
                                f"{pointer.sha256[:12]}")


def _sha256(data: bytearray) -> str:
    return hashlib.sha256(data).hexdigest()
