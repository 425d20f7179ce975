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
import jax.numpy as jnp
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


class NonFiniteWeights(ValueError):
    """A parameter holds NaN or inf: such weights are never published nor installed."""


def nonfinite_param(state: nnx.State) -> str | None:
    """The path of the first parameter holding a NaN or inf, or None when all are finite.

    One jitted reduction per floating array, on the device (with several processes a
    collective: all of them must call it); only one bool per array comes to the host.
    """
    flat = [(key, var.get_value()) for key, var in ((_key(p), v) for p, v in _flat(state))]
    floats = [(key, x) for key, x in flat if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not floats:
        return None
    finite = np.asarray(_all_finite([x for _, x in floats]))
    bad = np.flatnonzero(~finite)
    return floats[int(bad[0])][0] if bad.size else None


@jax.jit
def _all_finite(arrays: list[jax.Array]) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(x)) for x in arrays])


def check_finite(state: nnx.State) -> None:
    """Raises NonFiniteWeights naming the first parameter that holds a NaN or inf."""
    bad = nonfinite_param(state)
    if bad is not None:
        raise NonFiniteWeights(f"weights: parameter {bad!r} holds NaN or inf")


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
