"""Stream entry encoding: a trajectory travels as {"id": <trajectory id>, "pb": <protobuf bytes>}.

The id is duplicated outside the protobuf so a consumer can check the payload belongs to
the entry (a truncated or swapped payload fails the check) and tools can read ids cheaply.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError
from redis.typing import EncodableT, FieldT

from arlo.proto.v1 import common_pb2

ID_FIELD = b"id"
PB_FIELD = b"pb"


class MalformedEntry(ValueError):
    """A stream entry that cannot become a Trajectory; `reason` says why."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def encode(traj: common_pb2.Trajectory) -> dict[FieldT, EncodableT]:
    if not traj.id:
        raise ValueError("trajectory.id: must be non-empty (the trainer de-duplicates on it)")
    return {ID_FIELD: traj.id.encode(), PB_FIELD: traj.SerializeToString()}


def _as_bytes(value: Any) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


def decode(fields: Mapping[Any, Any]) -> common_pb2.Trajectory:
    """The trajectory of an entry's fields; raises MalformedEntry."""
    norm = {_as_bytes(k): v for k, v in fields.items()}
    missing = [f.decode() for f in (ID_FIELD, PB_FIELD) if f not in norm]
    if missing:
        raise MalformedEntry(f"missing field(s) {missing}")
    raw_id, payload = norm[ID_FIELD], norm[PB_FIELD]
    if not isinstance(payload, bytes):
        # A client with decode_responses=True hands us str: the bytes are already lost.
        raise MalformedEntry("payload is not bytes (client decodes responses?)")
    traj = common_pb2.Trajectory()
    try:
        traj.ParseFromString(payload)
    except DecodeError as e:
        raise MalformedEntry(f"payload is not a Trajectory: {e}") from None
    try:
        entry_id = _as_bytes(raw_id).decode()
    except UnicodeDecodeError:
        raise MalformedEntry("id field is not UTF-8") from None
    if not traj.id:
        raise MalformedEntry("trajectory has no id")
    if traj.id != entry_id:
        raise MalformedEntry(f"id mismatch: field {entry_id!r}, payload {traj.id!r}")
    return traj


def dead_fields(fields: Mapping[Any, Any], *, reason: str, entry_id: str, consumer: str) -> dict[FieldT, EncodableT]:
    """The raw fields plus why and where they were set aside (prefixed so no raw field is overwritten)."""
    out: dict[FieldT, EncodableT] = {_as_bytes(k): v for k, v in fields.items()}
    out[b"dead:reason"] = reason.encode()
    out[b"dead:entry_id"] = entry_id.encode()
    out[b"dead:consumer"] = consumer.encode()
    return out


def parse_stream_id(entry_id: str) -> tuple[int, int]:
    """'1700000000000-3' -> (1700000000000, 3), for ordering ids."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
