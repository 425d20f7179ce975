from __future__ import annotations

import hashlib

import pytest

from services.trainer.publish import DEFAULT_CHUNK_BYTES, VersionStore, check_chunk_bytes, iter_chunks


def test_store_keeps_newest_versions_only() -> None:
    store = VersionStore(keep=2)
    for v in (1, 2, 3):
        store.put(v, bytes([v]) * 10)
    assert store.get(1) is None and store.get(0).version == 3 and store.get(2).version == 2
    with pytest.raises(ValueError):
        store.put(3, b"x")


def test_chunks_reassemble_and_resume_from_offset() -> None:
    data = bytes(range(256)) * 1000
    chunks = list(iter_chunks(data, offset=0, chunk_bytes=65536))
    assert b"".join(c.data for c in chunks) == data
    assert all(hashlib.sha256(c.data).hexdigest() == c.sha256 for c in chunks)
    resumed = list(iter_chunks(data, offset=chunks[2].offset, chunk_bytes=65536))
    assert b"".join(c.data for c in resumed) == data[chunks[2].offset:]
    with pytest.raises(ValueError):
        list(iter_chunks(data, offset=len(data), chunk_bytes=65536))


def test_chunk_size_bounds() -> None:
    assert check_chunk_bytes(0) == DEFAULT_CHUNK_BYTES
    for bad in (1, 65535, (4 << 20) + 1):
        with pytest.raises(ValueError, match="chunk_bytes"):
            check_chunk_bytes(bad)
