"""Hypothesis strategies for protobuf requests, built from their descriptors.

Two kinds: well-typed messages with adversarial values (extreme and negative numbers, NaN,
empty, huge and odd strings, unknown enum values, long repeated fields), and raw bytes a
well-typed client could never send (invalid UTF-8 in a string field, truncated encodings,
wrong wire types, random bytes).
"""

from __future__ import annotations

from typing import Any

from google.protobuf import message_factory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message
from hypothesis import strategies as st

F = FieldDescriptor
_RANGES = {
    F.TYPE_INT32: (-(2**31), 2**31 - 1), F.TYPE_SINT32: (-(2**31), 2**31 - 1), F.TYPE_SFIXED32: (-(2**31), 2**31 - 1),
    F.TYPE_INT64: (-(2**63), 2**63 - 1), F.TYPE_SINT64: (-(2**63), 2**63 - 1), F.TYPE_SFIXED64: (-(2**63), 2**63 - 1),
    F.TYPE_UINT32: (0, 2**32 - 1), F.TYPE_FIXED32: (0, 2**32 - 1),
    F.TYPE_UINT64: (0, 2**64 - 1), F.TYPE_FIXED64: (0, 2**64 - 1),
}
ODD_STRINGS = ("", " ", "\x00", "\u202e", "é" * 40, "../../etc/passwd", "r0:", "r9:x", "{}", "[]", "null",
               "{\"a\":" * 50, "🙂" * 33, "x" * 129)


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    edges = sorted({lo, hi, 0, 1, hi // 2, lo + 1, hi - 1} | ({-1, lo // 2} if lo < 0 else {2}))
    return st.one_of(st.sampled_from(edges), st.integers(lo, hi), st.integers(-3, 300).filter(lambda v: lo <= v <= hi))


def _strings(huge: bool) -> st.SearchStrategy[str]:
    options = [st.text(max_size=40), st.sampled_from(ODD_STRINGS)]
    if huge:
        # Past every field bound (64 KiB..1 MiB) and, at the top, the server's message limit.
        options.append(st.sampled_from([70_000, 1_100_000, 2_500_000]).map(lambda n: "x" * n))
    return st.one_of(*options)


def scalar(field: FieldDescriptor, *, huge: bool) -> st.SearchStrategy[Any]:
    t = field.type
    if t in _RANGES:
        return _ints(*_RANGES[t])
    if t == F.TYPE_DOUBLE:
        return st.floats(allow_nan=True, allow_infinity=True)
    if t == F.TYPE_FLOAT:
        return st.floats(allow_nan=True, allow_infinity=True, width=32)
    if t == F.TYPE_BOOL:
        return st.booleans()
    if t == F.TYPE_STRING:
        return _strings(huge)
    if t == F.TYPE_BYTES:
        return st.binary(max_size=64)
    if t == F.TYPE_ENUM:
        known = [v.number for v in field.enum_type.values]
        # Proto3 enums are open: an unknown number parses and reaches the handler.
        return st.one_of(st.sampled_from(known), st.integers(-(2**31), 2**31 - 1))
    raise TypeError(f"no strategy for field type {t} ({field.full_name})")


def _repeated(elem: st.SearchStrategy[Any], field: FieldDescriptor) -> st.SearchStrategy[list[Any]]:
    options = [st.lists(elem, max_size=6)]
    if field.type in _RANGES:
        lo, hi = _RANGES[field.type]
        # Long lists of extreme values: sizes far past every bound (prompt tokens, batch rows).
        options.append(st.tuples(st.sampled_from([600, 5000, 300_000]), st.sampled_from([lo, hi, 0]))
                       .map(lambda nv: [nv[1]] * nv[0]))
    return st.one_of(*options)


def messages(desc: Descriptor, *, depth: int = 0, huge: bool = True) -> st.SearchStrategy[Message]:
    """Messages of type `desc` with a random subset of fields set to adversarial values."""
    cls = message_factory.GetMessageClass(desc)
    strategies: dict[str, st.SearchStrategy[Any]] = {}
    for f in desc.fields:
        if f.type == F.TYPE_MESSAGE:
            if f.message_type.GetOptions().map_entry or depth >= 2:
                continue
            elem: st.SearchStrategy[Any] = messages(f.message_type, depth=depth + 1, huge=huge)
        else:
            elem = scalar(f, huge=huge and depth == 0)
        strategies[f.name] = _repeated(elem, f) if f.is_repeated else elem

    @st.composite
    def build(draw: st.DrawFn) -> Message:
        msg = cls()
        for f in desc.fields:
            if f.name not in strategies or not draw(st.booleans()):
                continue
            value = draw(strategies[f.name])
            if f.is_repeated:
                getattr(msg, f.name).extend(value)
            elif f.type == F.TYPE_MESSAGE:
                getattr(msg, f.name).CopyFrom(value)
            else:
                setattr(msg, f.name, value)
        return msg

    return build()


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte, n = n & 0x7F, n >> 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _string_fields(desc: Descriptor) -> list[int]:
    return [f.number for f in desc.fields if f.type == F.TYPE_STRING]


def raw_requests(desc: Descriptor) -> st.SearchStrategy[bytes]:
    """Bytes no generated client sends: invalid UTF-8 strings, truncations, wrong wire types, noise."""
    options: list[st.SearchStrategy[bytes]] = [st.binary(min_size=1, max_size=200)]
    strings = _string_fields(desc)
    bad_utf8 = st.sampled_from([b"\xff", b"\xc0\xaf", b"\xed\xa0\x80", b"ok\xfe\xfe", b"\x80" * 10])
    if strings:
        options.append(st.tuples(st.sampled_from(strings), bad_utf8).map(
            lambda nb: _varint(nb[0] << 3 | 2) + _varint(len(nb[1])) + nb[1]))
    valid = messages(desc, huge=False).map(lambda m: m.SerializeToString()).filter(lambda b: len(b) > 1)
    options.append(st.tuples(valid, st.floats(0.05, 0.95)).map(lambda bf: bf[0][: max(1, int(len(bf[0]) * bf[1]))]))
    if desc.fields:
        numbers = [f.number for f in desc.fields]
        # A length-delimited header whose length runs past the end, and a varint where a field wants another type.
        options.append(st.sampled_from(numbers).map(lambda n: _varint(n << 3 | 2) + _varint(1 << 20) + b"abc"))
        options.append(st.sampled_from(numbers).map(lambda n: _varint(n << 3 | 5) + b"\x01"))
    return st.one_of(*options)
