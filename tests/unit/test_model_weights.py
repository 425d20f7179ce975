"""Weights <-> bytes: exact round trip, determinism, clear errors on bad input."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest
from flax import nnx, serialization

from arlo.model import (
    ModelConfig,
    abstract_model,
    create_model,
    sha256_hex,
    state_from_bytes,
    state_to_bytes,
)

CFG = ModelConfig.named("tiny")


@pytest.fixture(scope="module")
def state() -> nnx.State:
    return nnx.state(create_model(CFG, seed=0))


@pytest.fixture(scope="module")
def data(state: nnx.State) -> bytes:
    return state_to_bytes(state)


def test_round_trip_is_exact(state: nnx.State, data: bytes) -> None:
    restored = state_from_bytes(data, state)
    assert jax.tree.structure(restored) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert state_to_bytes(restored) == data


def test_restore_into_abstract_state(state: nnx.State, data: bytes) -> None:
    graphdef, like = nnx.split(abstract_model(CFG))
    model = nnx.merge(graphdef, state_from_bytes(data, like))
    np.testing.assert_array_equal(model.embedder.table_vd.get_value(), state["embedder"]["table_vd"].get_value())


def test_bytes_are_deterministic(data: bytes) -> None:
    again = state_to_bytes(nnx.state(create_model(CFG, seed=0)))
    assert again == data and sha256_hex(again) == sha256_hex(data)
    assert len(sha256_hex(data)) == 64


def test_corrupt_bytes(state: nnx.State, data: bytes) -> None:
    for bad in (b"", b"not msgpack at all \xc1", data[: len(data) // 2]):
        with pytest.raises(ValueError, match="weights"):
            state_from_bytes(bad, state)
    with pytest.raises(ValueError, match="format"):
        state_from_bytes(serialization.msgpack_serialize({"format": "other", "params": {}}), state)


def test_mismatches_name_the_path(state: nnx.State, data: bytes) -> None:
    wider = nnx.state(nnx.eval_shape(lambda: create_model(dataclasses.replace(CFG, mlp_dim=128), seed=0)))
    with pytest.raises(ValueError, match=r"layers/0/mlp/down_fd"):
        state_from_bytes(data, wider)
    untied = nnx.state(nnx.eval_shape(lambda: create_model(dataclasses.replace(CFG, tie_embeddings=False), 0)))
    with pytest.raises(ValueError, match="missing parameter 'lm_head_dv'"):
        state_from_bytes(data, untied)
    with pytest.raises(ValueError, match="unexpected parameter 'lm_head_dv'"):
        state_from_bytes(state_to_bytes(nnx.state(create_model(dataclasses.replace(CFG, tie_embeddings=False),
                                                                0))), state)
    tree = serialization.msgpack_restore(data)
    tree["params"]["final_norm/scale"] = tree["params"]["final_norm/scale"].astype(np.float16)
    with pytest.raises(ValueError, match="final_norm/scale.*float16"):
        state_from_bytes(serialization.msgpack_serialize(tree), state)


def flax_bytes(state: nnx.State, dtype: str | None = None) -> bytes:
    """The format as flax writes it, from the whole state cast at once (what publishes did before)."""
    from arlo.model.source import cast_state
    from arlo.model.weights import FORMAT, _flat, _key

    if dtype is not None:
        state = cast_state(state, dtype)
    params = {_key(path): np.asarray(jax.device_get(var.get_value())) for path, var in _flat(state)}
    return serialization.msgpack_serialize({"format": FORMAT, "params": dict(sorted(params.items()))})


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_streamed_bytes_equal_flax_msgpack_serialize(state: nnx.State, dtype: str | None) -> None:
    # Inference restores with flax's msgpack_restore and the pointer carries the bytes' sha256:
    # the array-at-a-time writer must give exactly flax's bytes, cast included.
    assert state_to_bytes(state, dtype) == flax_bytes(state, dtype)


def test_arrays_past_flax_chunk_size_are_written_chunked_as_flax_does(state: nnx.State, monkeypatch) -> None:
    import arlo.model.weights as weights

    small = 4096  # bytes: the tiny model's bigger matrices become several chunks
    monkeypatch.setattr(weights, "CHUNKED_ABOVE", small)
    monkeypatch.setattr(serialization, "MAX_CHUNK_SIZE", small)
    data = state_to_bytes(state)
    assert data == flax_bytes(state)
    restored = state_from_bytes(data, state)
    for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(restored), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_weight_that_overflows_the_serving_dtype_is_not_finite(state: nnx.State) -> None:
    from arlo.model.weights import nonfinite_param

    flat = list(nnx.to_flat_state(state))
    path, var = next((p, v) for p, v in flat if v.get_value().ndim == 2)
    big = var.get_value().at[0, 0].set(3.4e38)  # finite in float32, inf once rounded to bfloat16
    broken = nnx.from_flat_state([(p, v.copy(big) if p == path else v) for p, v in flat])
    assert nonfinite_param(broken) is None
    assert nonfinite_param(broken, "bfloat16") == "/".join(str(k) for k in path)


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_the_streamed_checksum_is_the_bytes_checksum(state: nnx.State, dtype: str | None) -> None:
    from arlo.model.weights import state_sha256

    assert state_sha256(state, dtype) == sha256_hex(state_to_bytes(state, dtype))


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_a_serving_copy_serialises_to_flaxs_bytes_after_its_originals_are_donated(dtype: str | None) -> None:
    # An overlapped publish (services/trainer/loop.py) copies the weights, then serialises the copy
    # while the next step donates the originals: the copy must be buffers of its own, and its
    # bytes exactly what an inline publish of the same state writes (flax's, cast included).
    from arlo.model.weights import serving_copy

    state = nnx.state(create_model(CFG, seed=1))
    expected = flax_bytes(state, dtype)
    copy = serving_copy(state, dtype)
    donate = jax.jit(lambda tree: jax.tree.map(lambda x: x + 1, tree), donate_argnums=0)
    donate(jax.tree.map(lambda v: v, nnx.to_pure_dict(state)))  # the step that comes next
    assert all(x.is_deleted() for x in jax.tree.leaves(nnx.to_pure_dict(state)))
    assert copy.to_bytes() == expected


def test_a_serving_copy_names_a_parameter_not_finite_in_the_serving_dtype(state: nnx.State) -> None:
    from arlo.model.weights import NonFiniteWeights, serving_copy

    flat = list(nnx.to_flat_state(state))
    path, var = next((p, v) for p, v in flat if v.get_value().ndim == 2)
    big = var.get_value().at[0, 0].set(3.4e38)  # finite in float32, inf once rounded to bfloat16
    broken = nnx.from_flat_state([(p, v.copy(big) if p == path else v) for p, v in flat])
    assert serving_copy(broken).to_bytes() == state_to_bytes(broken)
    with pytest.raises(NonFiniteWeights, match="/".join(str(k) for k in path)):
        serving_copy(broken, "bfloat16")


class _RecordedArray:
    """Stands in for a device array only to record when its host copy was started (on the CPU a
    real one's `copy_to_host_async` leaves no trace to check the window against)."""

    def __init__(self, nbytes: int, log: list[str], name: str) -> None:
        self.nbytes, self.log, self.name = nbytes, log, name

    def copy_to_host_async(self) -> None:
        self.log.append(f"start {self.name}")


@pytest.mark.parametrize(("sizes", "window", "expected"), [
    # all fit: every copy starts before the first array is packed
    ([10, 10, 10], 100, "start 0,start 1,start 2,take 0,take 1,take 2"),
    # a window of two arrays: the third starts only once the first is handed out
    ([10, 10, 10, 10], 20, "start 0,start 1,take 0,start 2,take 1,start 3,take 2,take 3"),
    # an array bigger than the window still starts, alone, when its turn comes
    ([10, 50, 10], 20, "start 0,take 0,start 1,take 1,start 2,take 2"),
])
def test_a_publish_starts_host_copies_ahead_within_its_window(sizes: list[int], window: int, expected: str) -> None:
    from arlo.model.weights import prefetched

    log: list[str] = []
    arrays = [_RecordedArray(n, log, str(i)) for i, n in enumerate(sizes)]
    for x in prefetched(arrays, window):
        log.append(f"take {x.name}")
    assert ",".join(log) == expected

