"""Published weight versions held in host memory and cut into checksummed chunks for PullWeights."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from arlo.config.trainer import WeightPublishConfig
from arlo.model import weight_delta
from arlo.model.weight_delta import Envelope, PayloadKind, encode_delta, envelope_parts, pack
from arlo.model.weight_files import VersionFiles
from arlo.model.weights import sha256_hex

DEFAULT_CHUNK_BYTES = 1 << 20
MIN_CHUNK_BYTES = 64 << 10
MAX_CHUNK_BYTES = 4 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class PublishedVersion:
    version: int
    data: bytes
    sha256: str
    time: float
    chunk_digests: dict[tuple[int, int], str | asyncio.Future[str]] = field(default_factory=dict)
    """The sha256 of each aligned chunk, by (offset, length): hashed with the payload when it was
    published (`hashed_payload`), else on its first pull (the future of that hashing while under
    way); every replica pulls the same chunks of a version, hashed once (`iter_chunks`)."""
    kind: PayloadKind = "full"
    """How the version went out: whole, or as `delta` onto version - 1."""
    full_version: int = 0
    """The newest version at or before this one that went out full (this one's, when full)."""
    delta: PublishedVersion | None = None
    """The delta's envelope as a payload of its own (PullWeights with payload DELTA), when a delta."""
    changed_fraction: float = 1.0
    """The fraction of serving-dtype elements that changed since version - 1 (1.0 when unknown)."""
    published_bytes: int = 0
    """What went out once: the delta's envelope, or the full payload."""


@dataclass(frozen=True, slots=True)
class PayloadDigests:
    sha256: str
    """The whole payload's: what the weight pointer names."""
    chunks: dict[tuple[int, int], str]
    """Each aligned chunk's at `DEFAULT_CHUNK_BYTES`, by (offset, length): what a pull sends."""


def hashed_payload(data: bytes, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> PayloadDigests:
    """The payload's digest and its chunks', the two passes side by side (hashlib lets go of the
    GIL): a pull then sends every chunk at once instead of hashing each on the way, which
    serialised hashing and sending on the swap's path (bench/weight_sync.py). Blocking: run it
    in a worker thread."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="chunk-digests") as pool:
        chunks = pool.submit(_chunk_digests, data, chunk_bytes)
        whole = sha256_hex(data)
        try:
            return PayloadDigests(sha256=whole, chunks=chunks.result())
        except Exception as e:
            raise RuntimeError(f"hashing the payload's chunks failed: {e!r}") from e


def _chunk_digests(data: bytes, chunk_bytes: int) -> dict[tuple[int, int], str]:
    view = memoryview(data)
    digests = {}
    for start in range(0, len(data), chunk_bytes):
        piece = view[start : start + chunk_bytes]
        digests[(start, len(piece))] = sha256_hex(piece)
    return digests


@dataclass(frozen=True, kw_only=True, slots=True)
class Chunk:
    offset: int
    data: bytes
    sha256: str


class VersionStore:
    """The newest `keep` versions; older ones are released (a puller then gets NOT_FOUND)."""

    def __init__(self, keep: int = 2) -> None:
        if keep < 1:
            raise ValueError("keep must be >= 1")
        self._keep = keep
        self._versions: OrderedDict[int, PublishedVersion] = OrderedDict()
        self.sent_bytes = 0
        """Bytes PullWeights has streamed from this store: the trainer's weight egress over gRPC."""

    def put(self, version: int, data: bytes, *, sha256: str = "",
            chunk_digests: Mapping[tuple[int, int], str] | None = None,
            delta: Envelope | None = None, delta_bytes: bytes = b"") -> PublishedVersion:
        """`sha256`: the data's digest when the caller has it (computed off the event loop);
        `chunk_digests`: its chunks' (`hashed_payload`), else each is hashed on its first pull.
        `delta` (and its packed envelope, `delta_bytes`): the version published as a delta onto
        the version held before it."""
        newest = self.get()
        if newest is not None and version <= newest.version:
            raise ValueError(f"version {version} is not newer than {newest.version}")
        if delta is not None and (newest is None or delta.base_version != newest.version
                                  or delta.version != version):
            raise ValueError(f"a delta of version {delta.version} onto {delta.base_version} does not follow "
                             f"the newest version held ({newest.version if newest else 'none'})")
        sha256 = sha256 or sha256_hex(data)
        extra: dict[str, Any] = {"published_bytes": len(data), "full_version": version}
        if delta is not None and newest is not None:
            envelope = PublishedVersion(version=version, data=delta_bytes, sha256=sha256_hex(delta_bytes),
                                        time=time.time())
            extra = {"kind": "delta", "full_version": newest.full_version, "delta": envelope,
                     "changed_fraction": delta.changed_fraction, "published_bytes": len(delta_bytes)}
        pv = PublishedVersion(version=version, data=data, sha256=sha256, time=time.time(),
                              chunk_digests=dict(chunk_digests or {}), **extra)
        self._versions[version] = pv
        while len(self._versions) > self._keep:
            self._versions.popitem(last=False)
        return pv

    def get(self, version: int = 0) -> PublishedVersion | None:
        """`version` 0 means the newest."""
        if not self._versions:
            return None
        if version == 0:
            return next(reversed(self._versions.values()))
        return self._versions.get(version)

    @property
    def newest_version(self) -> int:
        return next(reversed(self._versions)) if self._versions else 0


def check_chunk_bytes(chunk_bytes: int) -> int:
    """The chunk size to use; ValueError (-> INVALID_ARGUMENT) outside [64 KiB, 4 MiB]."""
    if chunk_bytes == 0:
        return DEFAULT_CHUNK_BYTES
    if not MIN_CHUNK_BYTES <= chunk_bytes <= MAX_CHUNK_BYTES:
        raise ValueError(f"chunk_bytes must be 0 or in [{MIN_CHUNK_BYTES}, {MAX_CHUNK_BYTES}], got {chunk_bytes}")
    return chunk_bytes


async def iter_chunks(published: PublishedVersion, *, offset: int, chunk_bytes: int) -> AsyncIterator[Chunk]:
    """`published`'s payload from `offset` in chunks of `chunk_bytes`, each with its sha256.

    A chunk's digest is computed once, in a worker thread, and shared: every replica pulls a new
    version at the same moment, and each waits on the one hashing of a chunk already under way
    (at a real model's size, 1 GB a version at 0.5B parameters in bfloat16, hashing per pull, or
    on the event loop, would cost the trainer seconds per version). Only chunks of the default
    size that start on a multiple of it are kept (every replica's fresh pull, and a resumed one's):
    what a client asks for at another size or an odd offset is hashed for it alone, so the memo
    holds at most one digest per default chunk of the version."""
    data = published.data
    if offset < 0 or (offset >= len(data) and len(data) > 0):
        raise ValueError(f"offset {offset} is outside the {len(data)}-byte payload")
    view = memoryview(data)
    memo = published.chunk_digests
    for start in range(offset, len(data), chunk_bytes):
        piece = bytes(view[start : start + chunk_bytes])
        if start % chunk_bytes or chunk_bytes != DEFAULT_CHUNK_BYTES:
            digest = await asyncio.to_thread(sha256_hex, piece)
        else:
            key = (start, len(piece))
            hashing = memo.get(key)
            if isinstance(hashing, str):
                yield Chunk(offset=start, data=piece, sha256=hashing)
                continue
            if hashing is None:
                hashing = memo[key] = asyncio.ensure_future(asyncio.to_thread(sha256_hex, piece))
            try:
                # Shielded: a puller that goes away must not cancel the hashing others wait on.
                digest = await asyncio.shield(hashing)
            except Exception:  # not a cancel (a BaseException): only a failed hashing is forgotten
                if memo.get(key) is hashing:
                    del memo[key]  # the next pull tries again
                raise
        yield Chunk(offset=start, data=piece, sha256=digest)


class VersionEncoder:
    """Which kind each version goes out as (full every `full_every`, deltas between), its one write
    to shared storage when there is one, then the store. A delta is taken against the newest
    version held, which is the one before it: the trainer keeps the previous payload anyway (the
    store's `keep` >= 2), so a delta costs no extra copy."""

    def __init__(self, store: VersionStore, config: WeightPublishConfig) -> None:
        self.store, self.config = store, config
        self.files = VersionFiles(config.storage) if config.storage else None

    @property
    def storage(self) -> str:
        return self.files.uri if self.files is not None else ""

    def delta_due(self, version: int) -> PublishedVersion | None:
        """The version a delta of `version` would apply onto, when one is due (else None: full)."""
        prev = self.store.get()
        if self.config.full_every <= 1 or prev is None or prev.version != version - 1:
            return None
        return prev if version - prev.full_version < self.config.full_every else None

    async def put(self, version: int, data: bytes, *, sha256: str,
                  chunk_digests: Mapping[tuple[int, int], str] | None = None, full: bool = False) -> PublishedVersion:
        base = None if full else self.delta_due(version)
        delta = None
        if base is not None:
            delta = await asyncio.to_thread(encode_delta, base.data, data, version=version,
                                            base_version=base.version, sha256=sha256)
            if delta is not None and len(delta.body) >= self.config.max_delta_ratio * len(data):
                delta = None  # most elements changed: an index each costs more than the copy
        delta_bytes = pack(delta) if delta is not None else b""
        if self.files is not None:
            if delta is not None:
                await asyncio.to_thread(self.files.write, version, "delta", delta_bytes)
            else:
                parts = envelope_parts(weight_delta.full(data, version=version, sha256=sha256), body_sha256=sha256)
                await asyncio.to_thread(self.files.write, version, "full", *parts)
        previous_full = self.store.get().full_version if self.store.get() is not None else 0
        published = self.store.put(version, data, sha256=sha256, chunk_digests=chunk_digests, delta=delta,
                                   delta_bytes=delta_bytes)
        if self.files is not None and delta is None:
            # A replica one chain behind still finds its deltas; one further behind starts here. A
            # trainer's first full (a restart) keeps only itself: older chains are another lineage's.
            await asyncio.to_thread(self.files.prune, previous_full or version)
        return published
