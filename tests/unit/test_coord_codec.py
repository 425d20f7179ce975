"""Pure parts of arlo.coord: key names, entry encoding, pointer state conversions."""

from __future__ import annotations

import pytest

from arlo.coord import Keys, WeightPointerState, codec
from arlo.proto.v1 import common_pb2


def _traj(traj_id: str = "t1") -> common_pb2.Trajectory:
    return common_pb2.Trajectory(id=traj_id, run_id="r", token_ids=[1, 2, 3], logprobs=[0.0, -0.5, -1.0])


def test_keys_are_namespaced_by_run() -> None:
    k = Keys("run-1")
    assert k.traj == "arlo:run-1:traj"
    assert k.traj_dead == "arlo:run-1:traj:dead"
    assert k.weights == "arlo:run-1:weights"
    assert k.weights_events == "arlo:run-1:weights:events"
    assert k.seen("abc") == "arlo:run-1:seen:abc"
    assert k.status("inference", "10.0.0.1:50051") == "arlo:run-1:status:inference:10.0.0.1:50051"
    assert k.statuses == "arlo:run-1:statuses"
    assert k.rollout_inflight == "arlo:run-1:rollout:inflight"


@pytest.mark.parametrize("bad", ["", "a b", "run*", "x:y", "a[1]"])
def test_keys_reject_run_ids_that_break_the_namespace(bad: str) -> None:
    with pytest.raises(ValueError, match="run_id"):
        Keys(bad)


def test_status_key_rejects_colon_in_service() -> None:
    with pytest.raises(ValueError, match="service"):
        Keys("r").status("a:b", "i")


def test_encode_decode_round_trip() -> None:
    traj = _traj()
    fields = codec.encode(traj)
    assert fields[b"id"] == b"t1"
    assert codec.decode(fields) == traj


def test_encode_requires_an_id() -> None:
    with pytest.raises(ValueError, match="id"):
        codec.encode(common_pb2.Trajectory())


@pytest.mark.parametrize(
    ("fields", "reason"),
    [
        ({b"pb": _traj().SerializeToString()}, "missing field"),
        ({b"id": b"t1"}, "missing field"),
        ({}, "missing field"),
        ({b"id": b"t1", b"pb": b"\xff\xff\xff garbage"}, "not a Trajectory"),
        ({b"id": b"t2", b"pb": _traj("t1").SerializeToString()}, "id mismatch"),
        ({b"id": b"", b"pb": b""}, "no id"),
        ({b"id": b"t1", b"pb": "text"}, "not bytes"),
    ],
)
def test_decode_names_why_an_entry_is_malformed(fields: dict[bytes, object], reason: str) -> None:
    with pytest.raises(codec.MalformedEntry, match=reason):
        codec.decode(fields)


def test_dead_fields_keep_raw_fields_and_add_reason() -> None:
    out = codec.dead_fields({b"id": b"x", b"reason": b"raw"}, reason="bad", entry_id="1-0", consumer="c")
    assert out[b"reason"] == b"raw"  # a raw field of that name is not overwritten
    assert out[b"dead:reason"] == b"bad"
    assert out[b"dead:entry_id"] == b"1-0"


def test_stream_ids_order_numerically() -> None:
    assert codec.parse_stream_id("10-2") > codec.parse_stream_id("9-30")
    assert codec.parse_stream_id("5") == (5, 0)


def test_pointer_state_proto_and_hash_round_trip() -> None:
    state = WeightPointerState(version=4, source="grpc://h:1", sha256="ab" * 32, checkpoint_version=2,
                               checkpoint_uri="file:///c/2", time=1.5)
    assert WeightPointerState.from_proto(state.to_proto()) == state
    raw = {b"version": b"4", b"source": b"grpc://h:1", b"sha256": ("ab" * 32).encode(),
           b"checkpoint_version": b"2", b"checkpoint_uri": b"file:///c/2", b"time": b"1.5"}
    assert WeightPointerState.from_hash(raw) == state


def test_pointer_state_from_a_checkpoint_only_hash() -> None:
    state = WeightPointerState.from_hash({b"checkpoint_version": b"3", b"checkpoint_uri": b"u"})
    assert (state.version, state.checkpoint_version, state.source) == (0, 3, "")
