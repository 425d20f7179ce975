"""Weight versions as files a replica can check on its own: a full payload, or the serving-dtype
elements that changed since the version before (a delta).

A published payload (arlo/model/weights.py, `arlo.weights.v1`) of one model always has the same
layout: the same keys, shapes and dtypes in the same order, so two versions differ only inside
the arrays' raw bytes. A delta lists, array by array, the flat indices of the elements whose bits
changed (as gaps, uint32) and their new values, zlib-compressed; applying it rewrites those
elements in place. At a learning rate of 1e-6 only a few percent of bfloat16 elements change per
step (an Adam step moves an element by at most about lr, and bf16 keeps 8 bits of mantissa), so a
delta is a few percent of a full copy (bench/weight_sync.py --replicas).

Either kind travels in one envelope:

    MAGIC | u32 header length | header (JSON) | body

The header names the payload kind, the version, the version a delta applies onto, the sha256 of
the full weights once applied (what the weight pointer names) and the body's own sha256, so a
torn or corrupted file is refused before it is applied. Applying a chain of deltas checks only
the last result against the pointer: one full hash per install, not one per delta.

    env = encode_delta(old, new, version=8, base_version=7, sha256=sha_new)
    envelope = pack(env)                     # bytes, written once (file or PullWeights)
    got = unpack(envelope)                   # ValueError on a bad magic, header or body
    apply_delta(held_payload, got)           # in place; then sha256 against the pointer
"""

from __future__ import annotations

import hashlib
import json
import struct
import zlib
from dataclasses import dataclass
from typing import Literal

import numpy as np

MAGIC = b"ARLOWV1\n"
PayloadKind = Literal["full", "delta"]
KINDS: tuple[PayloadKind, ...] = ("full", "delta")
_U32 = struct.Struct("<I")
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
NDARRAY_EXT = 1
"""flax.serialization's msgpack ext code for an ndarray (arlo.model.weights.NDARRAY_EXT)."""
COMPRESS_LEVEL = 1
"""zlib's fastest: the gaps compress ~3x at any level, the values hardly at all."""


@dataclass(frozen=True, slots=True)
class Region:
    """One array's raw bytes inside a payload."""

    offset: int
    nbytes: int
    itemsize: int


@dataclass(frozen=True, kw_only=True, slots=True)
class Envelope:
    kind: PayloadKind
    version: int
    base_version: int
    """The version a delta applies onto (version - 1); 0 for a full payload."""
    sha256: str
    """The full weights' sha256 at `version` (for a delta: once applied)."""
    body: bytes | memoryview
    changed: int = 0
    """Elements a delta rewrites."""
    elements: int = 0
    """Elements in the payload's arrays (a delta's changed fraction is changed / elements)."""
    payload_bytes: int = 0
    """The full payload's size: a delta applies only onto a payload of this size."""
    body_sha256: str = ""
    """The body's sha256 as read and checked (`unpack`); for a full payload, the weights' own."""

    @property
    def changed_fraction(self) -> float:
        return self.changed / self.elements if self.elements else 0.0


def pack(env: Envelope) -> bytes:
    return b"".join(envelope_parts(env))


def envelope_parts(env: Envelope, body_sha256: str = "") -> tuple[bytes, bytes | memoryview]:
    """The envelope as (head, body), to write one after the other without joining a full payload
    into a second copy; `body_sha256`: the body's digest when known (a full payload's is the
    version's own), else hashed here."""
    header = json.dumps({"kind": env.kind, "version": env.version, "base_version": env.base_version,
                         "sha256": env.sha256, "body_sha256": body_sha256 or sha256_hex(env.body),
                         "body_bytes": len(env.body), "changed": env.changed, "elements": env.elements,
                         "payload_bytes": env.payload_bytes}).encode()
    return MAGIC + _U32.pack(len(header)) + header, env.body


def unpack(data: bytes | bytearray | memoryview) -> Envelope:
    """The envelope in `data`; ValueError naming what is wrong (magic, header, a torn or corrupted body)."""
    view = memoryview(data)
    if bytes(view[: len(MAGIC)]) != MAGIC:
        raise ValueError("weight file: not an arlo weight envelope (bad magic)")
    try:
        (size,) = _U32.unpack_from(view, len(MAGIC))
        start = len(MAGIC) + _U32.size
        h = json.loads(bytes(view[start : start + size]))
        kind, body = h["kind"], view[start + size :]
        if kind not in KINDS:
            raise ValueError(f"unknown payload kind {kind!r}")
        if len(body) != h["body_bytes"]:
            raise ValueError(f"body holds {len(body)} of {h['body_bytes']} bytes (torn)")
        env = Envelope(kind=kind, version=int(h["version"]), base_version=int(h["base_version"]),
                       sha256=str(h["sha256"]), body=body, changed=int(h["changed"]), elements=int(h["elements"]),
                       payload_bytes=int(h["payload_bytes"]), body_sha256=str(h["body_sha256"]))
        body_sha = env.body_sha256
    except (KeyError, TypeError, struct.error, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"weight file: malformed header ({type(e).__name__}: {e})") from e
    except ValueError as e:
        raise ValueError(f"weight file: {e}") from e
    if sha256_hex(body) != body_sha:
        raise ValueError(f"weight file: version {env.version}'s {kind} body fails its sha256 (corrupted)")
    return env


def full(data: bytes, *, version: int, sha256: str) -> Envelope:
    return Envelope(kind="full", version=version, base_version=0, sha256=sha256, body=data,
                    payload_bytes=len(data))


def encode_delta(old: bytes | bytearray, new: bytes | bytearray, *, version: int, base_version: int,
                 sha256: str) -> Envelope | None:
    """The delta taking payload `old` (version `base_version`) to `new` (`version`, whose sha256 is
    `sha256`); None when the two do not share a layout (another model: only a full payload will do).
    Blocking (a second or so at 1 GB): run it in a worker thread."""
    if len(old) != len(new):
        return None
    regions = payload_regions(new)
    if not _same_framing(old, new, regions):
        return None
    counts, gaps, values = [], [], []
    elements = 0
    for r in regions:
        word = _WORDS[r.itemsize]
        o = np.frombuffer(old, dtype=word, count=r.nbytes // r.itemsize, offset=r.offset)
        n = np.frombuffer(new, dtype=word, count=r.nbytes // r.itemsize, offset=r.offset)
        idx = np.flatnonzero(o != n)  # bits, not values: -0.0 vs 0.0 and NaN payloads count
        elements += n.size
        counts.append(idx.size)
        if idx.size:
            gaps.append(np.diff(idx, prepend=0).astype(np.uint32))
            values.append(n[idx].tobytes())
    table = np.array([(r.offset, r.itemsize, c) for r, c in zip(regions, counts, strict=True)], dtype=np.uint64)
    raw = b"".join([_U32.pack(len(regions)), table.tobytes(), *(g.tobytes() for g in gaps), *values])
    return Envelope(kind="delta", version=version, base_version=base_version, sha256=sha256,
                    body=zlib.compress(raw, COMPRESS_LEVEL), changed=int(sum(counts)), elements=elements,
                    payload_bytes=len(new))


def apply_delta(payload: bytearray, env: Envelope) -> None:
    """Rewrites `payload` (the base version's bytes) into `env.version`'s, in place; ValueError on
    a delta that does not fit it. A failure part-way leaves `payload` neither version: the caller
    drops it (and the sha256 against the pointer would refuse it anyway)."""
    if env.kind != "delta":
        raise ValueError(f"weight file: version {env.version} is a {env.kind} payload, not a delta")
    if len(payload) != env.payload_bytes:
        raise ValueError(f"delta for version {env.version} fits a {env.payload_bytes}-byte payload, "
                         f"not the {len(payload)} bytes held")
    try:
        raw = zlib.decompress(env.body)
    except zlib.error as e:
        raise ValueError(f"delta for version {env.version}: {e}") from e
    (num,) = _U32.unpack_from(raw, 0)
    table = np.frombuffer(raw, dtype=np.uint64, count=3 * num, offset=_U32.size).reshape(num, 3)
    at = _U32.size + table.nbytes
    total = int(table[:, 2].sum())
    gaps = np.frombuffer(raw, dtype=np.uint32, count=total, offset=at)
    at += gaps.nbytes
    for (offset, itemsize, count), start in zip(table.tolist(), np.cumsum([0, *table[:, 2].tolist()]).tolist(),
                                                strict=False):
        if not count:
            continue
        word = _WORDS.get(itemsize)
        if word is None or offset >= len(payload):
            raise ValueError(f"delta for version {env.version}: bad region at {offset}")
        idx = np.cumsum(gaps[start : start + count], dtype=np.int64)
        vals = np.frombuffer(raw, dtype=word, count=count, offset=at)
        at += vals.nbytes
        target = np.frombuffer(payload, dtype=word, count=(len(payload) - offset) // itemsize, offset=offset)
        if idx[-1] >= target.size:
            raise ValueError(f"delta for version {env.version}: index past the payload at {offset}")
        target[idx] = vals
    if at != len(raw):
        raise ValueError(f"delta for version {env.version}: {len(raw) - at} bytes left over")


def _same_framing(old: bytes | bytearray, new: bytes | bytearray, regions: list[Region]) -> bool:
    """Whether everything outside the arrays' raw bytes (keys, shapes, dtypes) is equal."""
    at = 0
    for r in [*regions, Region(len(new), 0, 1)]:
        if old[at : r.offset] != new[at : r.offset]:
            return False
        at = r.offset + r.nbytes
    return True


# -- the payload's layout --------------------------------------------------------------------------
# A reader of just the msgpack the format writes (maps, strings, ints, bools, ext arrays, flax's
# chunked-array maps), walking by lengths: no copy of the arrays, microseconds at any size.


def payload_regions(data: bytes | bytearray | memoryview) -> list[Region]:
    """Where each array's raw bytes lie in an `arlo.weights.v1` payload, in payload order; ValueError
    when `data` is not one."""
    regions: list[Region] = []
    try:
        end = _walk(memoryview(data), 0, regions)
    except (IndexError, struct.error, KeyError) as e:
        raise ValueError(f"weights: not a payload this format writes ({type(e).__name__}: {e})") from e
    if end != len(data):
        raise ValueError(f"weights: {len(data) - end} bytes after the payload")
    return regions


def _walk(v: memoryview, at: int, regions: list[Region]) -> int:
    """Skips the msgpack object at `at`, noting each ndarray ext's raw bytes; returns its end."""
    b = v[at]
    if b <= 0x7F or b >= 0xE0 or b in (0xC0, 0xC2, 0xC3):  # fixint, nil, bools
        return at + 1
    if 0x80 <= b <= 0x8F or b in (0xDE, 0xDF):  # maps
        n, at = _length(v, at, b, 0x80, 0x0F, 0xDE)
        for _ in range(2 * n):
            at = _walk(v, at, regions)
        return at
    if 0x90 <= b <= 0x9F or b in (0xDC, 0xDD):  # arrays
        n, at = _length(v, at, b, 0x90, 0x0F, 0xDC)
        for _ in range(n):
            at = _walk(v, at, regions)
        return at
    if 0xA0 <= b <= 0xBF:
        return at + 1 + (b & 0x1F)
    if b in (0xD9, 0xDA, 0xDB, 0xC4, 0xC5, 0xC6):  # str8/16/32, bin8/16/32
        width = {0xD9: 1, 0xDA: 2, 0xDB: 4, 0xC4: 1, 0xC5: 2, 0xC6: 4}[b]
        return at + 1 + width + int.from_bytes(v[at + 1 : at + 1 + width], "big")
    if b in (0xCC, 0xCD, 0xCE, 0xCF, 0xD0, 0xD1, 0xD2, 0xD3, 0xCA, 0xCB):
        return at + 1 + {0xCC: 1, 0xCD: 2, 0xCE: 4, 0xCF: 8, 0xD0: 1, 0xD1: 2, 0xD2: 4, 0xD3: 8,
                         0xCA: 4, 0xCB: 8}[b]
    if b in (0xC7, 0xC8, 0xC9):  # ext8/16/32: (code, payload)
        width = {0xC7: 1, 0xC8: 2, 0xC9: 4}[b]
        size = int.from_bytes(v[at + 1 : at + 1 + width], "big")
        start = at + 2 + width
        _ndarray_region(v, start, start + size, regions)
        return start + size
    raise ValueError(f"unexpected msgpack type byte 0x{b:02x} at {at}")


def _length(v: memoryview, at: int, b: int, fix: int, mask: int, wide: int) -> tuple[int, int]:
    if fix <= b <= fix + mask:
        return b & mask, at + 1
    width = 2 if b == wide else 4
    return int.from_bytes(v[at + 1 : at + 1 + width], "big"), at + 1 + width


def _ndarray_region(v: memoryview, start: int, end: int, regions: list[Region]) -> None:
    """An ndarray ext's payload is (shape, dtype name, raw bytes): the raw bytes end the ext."""
    import msgpack

    if v[start - 1] != NDARRAY_EXT:
        raise ValueError(f"unexpected ext type {v[start - 1]} at {start - 1}")
    unpacker = msgpack.Unpacker(raw=False)
    unpacker.feed(bytes(v[start : min(end, start + 4096)]))  # the shape and dtype: a few bytes
    unpacker.read_array_header()
    shape, dtype = unpacker.unpack(), unpacker.unpack()
    itemsize = _itemsize(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * itemsize
    regions.append(Region(offset=end - nbytes, nbytes=nbytes, itemsize=itemsize))


def sha256_hex(data: bytes | bytearray | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def _itemsize(name: str) -> int:
    import jax.numpy as jnp  # bfloat16 and friends are known to numpy through JAX's ml_dtypes

    return int(jnp.dtype(name).itemsize)
