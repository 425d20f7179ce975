from __future__ import annotations

import asyncio
import hashlib

import pytest

from arlo.model.weights import sha256_hex
from services.trainer import publish
from services.trainer.publish import (
    DEFAULT_CHUNK_BYTES,
    Chunk,
    PublishedVersion,
    VersionStore,
    check_chunk_bytes,
    iter_chunks,
)


def test_store_keeps_newest_versions_only() -> None:
    store = VersionStore(keep=2)
    for v in (1, 2, 3):
        store.put(v, bytes([v]) * 10)
    assert store.get(1) is None and store.get(0).version == 3 and store.get(2).version == 2
    with pytest.raises(ValueError):
        store.put(3, b"x")


async def chunks_of(published: PublishedVersion, offset: int, chunk_bytes: int = 65536) -> list[Chunk]:
    return [c async for c in iter_chunks(published, offset=offset, chunk_bytes=chunk_bytes)]


async def test_chunks_reassemble_and_resume_from_offset() -> None:
    data = bytes(range(256)) * 1000
    published = VersionStore().put(1, data)
    chunks = await chunks_of(published, 0)
    assert b"".join(c.data for c in chunks) == data
    assert all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in chunks)
    resumed = await chunks_of(published, chunks[2].offset)
    assert b"".join(c.data for c in resumed) == data[chunks[2].offset:]
    odd = await chunks_of(published, 1000)  # a resume at any offset: its own chunks, their own digests
    assert b"".join(c.data for c in odd) == data[1000:]
    assert all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in odd)
    with pytest.raises(ValueError):
        await chunks_of(published, len(data))


async def test_each_chunk_is_hashed_once_however_many_replicas_pull(monkeypatch: pytest.MonkeyPatch) -> None:
    """Replicas pull a new version at the same moment: each chunk is hashed once for all of them,
    and a later pull (a resume from an aligned offset too) is served from the digests kept."""
    hashed: list[int] = []

    def counted(data: bytes) -> str:
        hashed.append(len(data))
        return sha256_hex(data)

    size = DEFAULT_CHUNK_BYTES
    published = VersionStore().put(1, bytes(range(256)) * (14 * size // 1024))  # 4 chunks, the last short
    monkeypatch.setattr(publish, "sha256_hex", counted)
    pulls = await asyncio.gather(*(chunks_of(published, 0, size) for _ in range(8)))
    assert len(hashed) == 4 and all(pull == pulls[0] for pull in pulls)
    await chunks_of(published, size, size)
    assert len(hashed) == 4
    await chunks_of(published, 1000, size)  # an odd offset: hashed for that pull alone, not kept
    assert len(hashed) == 8 and len(published.chunk_digests) == 4
    # Another chunk size: hashed for that pull alone too, however many sizes a client tries.
    for other in (65536, 65536 * 3, 2 * size):
        await chunks_of(published, 0, other)
    assert len(published.chunk_digests) == 4


async def test_a_puller_that_goes_away_leaves_the_shared_hashing_alone() -> None:
    published = VersionStore().put(1, bytes(range(256)) * 1000)
    gone = asyncio.ensure_future(chunks_of(published, 0))
    await asyncio.sleep(0)
    gone.cancel()
    pulled = await chunks_of(published, 0)
    assert all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in pulled)


def test_chunk_size_bounds() -> None:
    assert check_chunk_bytes(0) == DEFAULT_CHUNK_BYTES
    for bad in (1, 65535, (4 << 20) + 1):
        with pytest.raises(ValueError, match="chunk_bytes"):
            check_chunk_bytes(bad)


@pytest.mark.parametrize("size", [0, 1, DEFAULT_CHUNK_BYTES, 2 * DEFAULT_CHUNK_BYTES + 7])
def test_a_payload_is_hashed_whole_and_by_chunk_as_a_pull_sends_it(size: int) -> None:
    data = bytes(range(256)) * (size // 256) + bytes(size % 256)
    digests = publish.hashed_payload(data)
    assert digests.sha256 == hashlib.sha256(data).hexdigest()
    expected = {(s, len(data[s : s + DEFAULT_CHUNK_BYTES])): hashlib.sha256(data[s : s + DEFAULT_CHUNK_BYTES]).hexdigest()
                for s in range(0, len(data), DEFAULT_CHUNK_BYTES)}
    assert digests.chunks == expected


async def test_a_version_put_with_its_chunk_digests_is_pulled_without_hashing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer hashes a version's chunks when it publishes (beside the whole payload, in a
    thread): a pull at the default chunk size then sends each at once; another size or an odd
    offset is still hashed on the way."""
    data = bytes(range(256)) * 10_000  # 3 chunks of 1 MiB, the last short
    digests = publish.hashed_payload(data)
    published = VersionStore().put(1, data, sha256=digests.sha256, chunk_digests=digests.chunks)
    hashed: list[int] = []

    def counted(piece: bytes) -> str:
        hashed.append(len(piece))
        return sha256_hex(piece)

    monkeypatch.setattr(publish, "sha256_hex", counted)
    pulled = await chunks_of(published, 0, DEFAULT_CHUNK_BYTES)
    assert b"".join(c.data for c in pulled) == data and hashed == []
    assert all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in pulled)
    odd = await chunks_of(published, 1000, DEFAULT_CHUNK_BYTES)
    assert len(hashed) == len(odd) and all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in odd)


def test_a_failure_hashing_the_chunks_fails_the_publish_with_its_cause(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []

    def failing_on_chunks(data: bytes) -> str:
        calls.append(len(data))
        if len(data) <= DEFAULT_CHUNK_BYTES:  # a chunk, on the worker thread
            raise MemoryError("no room")
        return sha256_hex(data)

    monkeypatch.setattr(publish, "sha256_hex", failing_on_chunks)
    with pytest.raises(RuntimeError, match="hashing the payload's chunks failed") as caught:
        publish.hashed_payload(bytes(2 * DEFAULT_CHUNK_BYTES + 1))
    assert isinstance(caught.value.__cause__, MemoryError)
