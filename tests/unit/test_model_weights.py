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
