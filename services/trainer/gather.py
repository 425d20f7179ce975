"""Whole arrays in one process's memory, from parameters that may be sharded across hosts."""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from arlo.model.source import cast_state
from arlo.model.weights import check_finite, state_sha256, state_to_bytes


def host_state(state: Any) -> Any:
    """`state` with every array whole in this process's memory.

    With several processes this is a collective (every process must call it at the same
    point): parameters sharded across hosts (fsdp) are not addressable from one process, and
    publishing or checksumming them needs them whole. With one process it returns `state`.
    """
    if jax.process_count() == 1:
        return state
    from jax.experimental import multihost_utils

    return multihost_utils.process_allgather(state, tiled=True)


def state_bytes(state: nnx.State, dtype: str | None = None) -> bytes:
    """`state_to_bytes` of the whole state with its floating arrays in `dtype` (the serving
    dtype), from any process (all processes call it together).

    Raises NonFiniteWeights (on every process alike, before any gather) when a parameter holds
    NaN or inf in that dtype: such a version must never reach the fleet. One process casts each
    array as it packs it; several gather the state cast as a whole (the gather moves whole arrays)."""
    check_finite(state, dtype)
    if jax.process_count() > 1 and dtype is not None:
        state = cast_state(state, dtype)
    return state_to_bytes(host_state(state), dtype)


def state_digest(state: nnx.State) -> str:
    """sha256 of `state_to_bytes` of the whole state, from any process (all call it together),
    one array's bytes at a time."""
    return state_sha256(host_state(state))
