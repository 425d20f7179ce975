"""Model state <-> bytes, for shipping weights between trainer and inference.

Format: msgpack of {"format": FORMAT, "params": {"layers/0/attn/q_dnh": ndarray, ...}},
keys sorted, so equal states give equal bytes (and equal sha256). Restoring checks the
bytes against a `like` state (real or abstract, e.g. `nnx.split(abstract_model(cfg))[1]`)
and reports the first bad path; the result keeps `like`'s variable types and metadata
and, when `like` holds placed arrays, their shardings.
"""

from __future__ import annotations

import hashlib
from typing import Any

import jax
import numpy as np
from flax import nnx, serialization

FORMAT = "arlo.weights.v1"


def state_to_bytes(state: nnx.State) -> bytes:
    params = {_key(path): np.asarray(jax.device_get(var.get_value())) for path, var in _flat(state)}
    return serialization.msgpack_serialize({"format": FORMAT, "params": dict(sorted(params.items()))})


def state_from_bytes(data: bytes, like: nnx.State) -> nnx.State:
    """Raises ValueError on corrupt bytes, a different format, or any missing, unexpected,
    mis-shaped or mis-typed parameter (naming its path)."""
    params = _unpack(data)
    expected = {_key(path): (path, var) for path, var in _flat(like)}
    missing = sorted(expected.keys() - params.keys())
    if missing:
        raise ValueError(f"weights: missing parameter {missing[0]!r} ({len(missing)} missing)")
    unexpected = sorted(params.keys() - expected.keys())
    if unexpected:
        raise ValueError(f"weights: unexpected parameter {unexpected[0]!r} ({len(unexpected)} unexpected)")
    restored = []
    for key, (path, var) in expected.items():
        restored.append((path, var.copy(_load_leaf(key, params[key], var.get_value()))))
    return nnx.from_flat_state(restored)


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _flat(state: nnx.State) -> list[tuple[tuple[Any, ...], nnx.Variable]]:
    return list(nnx.to_flat_state(state))


def _key(path: tuple[Any, ...]) -> str:
    return "/".join(str(part) for part in path)


def _unpack(data: bytes) -> dict[str, Any]:
    try:
        tree = serialization.msgpack_restore(data)
    except Exception as e:  # msgpack raises a zoo of types on garbage; one clear error instead
        raise ValueError(f"weights: corrupt bytes ({type(e).__name__}: {e})") from e
    if not isinstance(tree, dict) or tree.get("format") != FORMAT or not isinstance(tree.get("params"), dict):
        found = tree.get("format") if isinstance(tree, dict) else type(tree).__name__
        raise ValueError(f"weights: expected format {FORMAT!r}, found {found!r}")
    return tree["params"]


def _load_leaf(key: str, array: Any, like: Any) -> jax.Array:
    if not isinstance(array, np.ndarray):
        raise ValueError(f"weights: {key!r} is not an array (got {type(array).__name__})")
    if array.shape != tuple(like.shape) or array.dtype != like.dtype:
        raise ValueError(f"weights: {key!r} has {array.dtype}{list(array.shape)}, "
                         f"expected {np.dtype(like.dtype)}{list(like.shape)}")
    sharding = getattr(like, "sharding", None)
    return jax.device_put(array, sharding) if isinstance(sharding, jax.sharding.Sharding) else jax.device_put(array)
