"""Model state <-> bytes, for shipping weights between trainer and inference.

Format: msgpack of {"format": FORMAT, "params": {"layers/0/attn/q_dnh": ndarray, ...}},
keys sorted, so equal states give equal bytes (and equal sha256). Restoring checks the
bytes against a `like` state (real or abstract, e.g. `nnx.split(abstract_model(cfg))[1]`)
and reports the first bad path; the result keeps `like`'s variable types and metadata
and, when `like` holds placed arrays, their shardings.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
from collections.abc import Iterator, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import msgpack
import numpy as np
from flax import nnx, serialization

FORMAT = "arlo.weights.v1"


NDARRAY_EXT = 1
"""flax.serialization's msgpack ext code for an ndarray (its `_MsgpackExtType.ndarray`)."""
CHUNKED_ABOVE = 2**30
"""flax's MAX_CHUNK_SIZE: a bigger array is written as a dict of 1 GiB chunks."""


def state_to_bytes(state: nnx.State, dtype: str | None = None) -> bytes:
    """The bytes flax's `msgpack_serialize` writes for the format, one array at a time: each is
    cast (floating arrays, to `dtype` when given), copied to the host and packed before the next,
    so a publish holds about twice the serving bytes at its peak (the packed pieces, then the
    joined whole), not a cast copy of the whole state plus flax's copies of each array."""
    return b"".join(_pieces(state, dtype))


def state_sha256(state: nnx.State, dtype: str | None = None) -> str:
    """`sha256_hex(state_to_bytes(state, dtype))`, holding one array's bytes at a time (a
    checkpoint's checksum of a float32 master copy never materialises its serialisation)."""
    digest = hashlib.sha256()
    for piece in _pieces(state, dtype):
        digest.update(piece)
    return digest.hexdigest()


def _pieces(state: nnx.State, dtype: str | None) -> Iterator[bytes]:
    flat = sorted((_key(path), var) for path, var in _flat(state))
    return _packed(((key, lambda var=var: _cast(var.get_value(), dtype)) for key, var in flat), len(flat))


def _packed(arrays: Iterator[tuple[str, Any]], count: int) -> Iterator[bytes]:
    """The format's pieces for `count` (key, array getter) pairs in key order: each array is
    fetched, copied to the host and packed before the next is fetched."""
    packer = msgpack.Packer(use_bin_type=True)
    yield from (packer.pack_map_header(2), packer.pack("format"), packer.pack(FORMAT), packer.pack("params"),
                packer.pack_map_header(count))
    for key, get in arrays:
        yield packer.pack(key)
        yield from _packed_array(packer, np.asarray(jax.device_get(get())))


@dataclasses.dataclass(frozen=True, slots=True)
class ServingCopy:
    """A state's parameters as the fleet is served them (floating arrays cast to the serving
    dtype), in arrays of their own, on the state's devices: what a publish serialises, taken in
    one jitted call so the next training step may donate the originals at once while the copy
    is serialised beside it (services/trainer/loop.py). Holds one extra copy of the serving
    weights on the device until it is dropped."""

    keys: tuple[str, ...]
    """Sorted, as the format orders them."""
    arrays: tuple[jax.Array, ...]

    def to_bytes(self) -> bytes:
        """Exactly `state_to_bytes(state, dtype)` of the state and dtype it was taken from (no
        lock needed: nothing else holds these arrays). Host copies run ahead of the packing by up
        to PREFETCH_BYTES on an accelerator, where one blocking copy per array costs a round trip
        each (an H200's whole sync-mode publish of the 596k preset, 46 arrays, 2.4 MB: 26.6 ms
        before this; not yet measured after)."""
        arrays = prefetched(self.arrays, PREFETCH_BYTES) if _on_accelerator(self.arrays) else self.arrays
        pairs = ((key, lambda x=x: x) for key, x in zip(self.keys, arrays, strict=True))
        return b"".join(_packed(pairs, len(self.keys)))


PREFETCH_BYTES = 256 * 2**20
"""How far a publish's device-to-host copies may run ahead of the packing: enough to keep the
link busy without starting every transfer of a large model at once. (It bounds transfers in
flight, not host memory: each host copy stays cached on its array until the ServingCopy goes.)"""


def _on_accelerator(arrays: Sequence[jax.Array]) -> bool:
    """Whether the arrays live off the host (on the CPU a host copy is the buffer itself, and
    starting one ahead only costs a call per array)."""
    return bool(arrays) and any(d.platform != "cpu" for d in arrays[0].sharding.device_set)


def prefetched(arrays: Sequence[Any], window_bytes: int) -> Iterator[Any]:
    """`arrays` in order. Before one is handed out, its host copy (`copy_to_host_async`) and
    those of the arrays after it are started, as far as the copies started and not yet handed
    out fit in `window_bytes`; an array bigger than the window starts alone when its turn comes."""
    started = 0
    in_flight = 0
    for i, x in enumerate(arrays):
        while started < len(arrays) and (started == i or in_flight + arrays[started].nbytes <= window_bytes):
            arrays[started].copy_to_host_async()
            in_flight += arrays[started].nbytes
            started += 1
        in_flight -= x.nbytes
        yield x


def serving_copy(state: nnx.State, dtype: str | None = None) -> ServingCopy:
    """`state`'s serving arrays copied (see ServingCopy); raises NonFiniteWeights naming the first
    parameter holding a NaN or inf in `dtype`, as `check_finite` does, in the same jitted call."""
    flat = sorted((_key(path), var.get_value()) for path, var in _flat(state))
    keys = tuple(key for key, _ in flat)
    finite, arrays = _finite_copies([x for _, x in flat], dtype)
    finite = np.asarray(finite)
    if finite.size and not finite.all():
        raise _nonfinite(keys[int(np.flatnonzero(~finite)[0])])
    return ServingCopy(keys=keys, arrays=tuple(arrays))


@functools.partial(jax.jit, static_argnums=1)
def _finite_copies(arrays: list[jax.Array], dtype: str | None) -> tuple[jax.Array, list[jax.Array]]:
    # lax.copy, not the cast alone: an output that is its input unchanged (the serving dtype is
    # the master's) may be handed back as that very array (JAX may forward it), which the next
    # step donates; an explicit copy is a buffer of its own on every backend.
    copies = [jax.lax.copy_p.bind(_cast(x, dtype)) for x in arrays]
    flags = [jnp.all(jnp.isfinite(c)) if jnp.issubdtype(c.dtype, jnp.inexact) else jnp.array(True) for c in copies]
    return (jnp.stack(flags) if flags else jnp.zeros((0,), bool)), copies


def _cast(x: Any, dtype: str | None) -> Any:
    if dtype is None or not jnp.issubdtype(x.dtype, jnp.floating) or x.dtype == jnp.dtype(dtype):
        return x
    return x.astype(dtype)


def _packed_array(packer: msgpack.Packer, arr: np.ndarray) -> list[bytes]:
    if arr.nbytes <= CHUNKED_ABOVE:
        return [_ndarray_ext(packer, arr)]
    step = CHUNKED_ABOVE // arr.dtype.itemsize
    flat = arr.reshape(-1)
    chunks = [flat[i : i + step] for i in range(0, flat.size, step)]
    out = [packer.pack_map_header(3), packer.pack("__msgpack_chunked_array__"), packer.pack(True),
           packer.pack("shape"), packer.pack({str(i): d for i, d in enumerate(arr.shape)}),
           packer.pack("chunks"), packer.pack_map_header(len(chunks))]
    for i, chunk in enumerate(chunks):
        out += [packer.pack(str(i)), _ndarray_ext(packer, chunk)]
    return out


def _ndarray_ext(packer: msgpack.Packer, arr: np.ndarray) -> bytes:
    raw = np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data  # no copy (bfloat16 has no buffer format)
    payload = msgpack.packb((arr.shape, arr.dtype.name, raw), use_bin_type=True)
    return packer.pack(msgpack.ExtType(NDARRAY_EXT, payload))


def state_from_bytes(data: bytes | bytearray, like: nnx.State) -> nnx.State:
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
    host = {key: _checked_leaf(key, params[key], var.get_value()) for key, (_, var) in expected.items()}
    # One transfer call for the leaves that have a place and one for the rest (the default device):
    # per-leaf calls cost their dispatch each (46 leaves of the 596k preset: 11.6 -> 9.9 ms), on the swap's path.
    shardings = {key: _sharding(var.get_value()) for key, (_, var) in expected.items()}
    placed_keys = [key for key, sharding in shardings.items() if sharding is not None]
    free_keys = [key for key, sharding in shardings.items() if sharding is None]
    placed = dict(zip(placed_keys, jax.device_put([host[k] for k in placed_keys], [shardings[k] for k in placed_keys]),
                      strict=True))
    placed.update(zip(free_keys, jax.device_put([host[k] for k in free_keys]), strict=True))
    return nnx.from_flat_state([(path, var.copy(placed[key])) for key, (path, var) in expected.items()])


class NonFiniteWeights(ValueError):
    """A parameter holds NaN or inf: such weights are never published nor installed."""


def nonfinite_param(state: nnx.State, dtype: str | None = None) -> str | None:
    """The path of the first parameter holding a NaN or inf (cast to `dtype` when given, as a
    publish sends it), or None when all are finite.

    One jitted reduction per floating array, on the device (with several processes a
    collective: all of them must call it), the cast fused into it; only one bool per array
    comes to the host.
    """
    flat = [(key, var.get_value()) for key, var in ((_key(p), v) for p, v in _flat(state))]
    floats = [(key, x) for key, x in flat if jnp.issubdtype(jnp.result_type(x), jnp.inexact)]
    if not floats:
        return None
    finite = np.asarray(_all_finite([x for _, x in floats], dtype))
    bad = np.flatnonzero(~finite)
    return floats[int(bad[0])][0] if bad.size else None


def nonfinite_leaf(tree: Any) -> str | None:
    """The path of the first floating leaf of any pytree (an optimizer state, a critic) holding a
    NaN or inf, or None. Device arrays are reduced on the device (a collective with several
    processes, as `nonfinite_param`); host arrays (a checkpoint's host copy) on the host, one
    leaf at a time, so a host copy is never sent back to the device whole."""
    leaves = [(jax.tree_util.keystr(path), x) for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]
              if hasattr(x, "dtype") and jnp.issubdtype(x.dtype, jnp.inexact)]
    on_host = [(key, x) for key, x in leaves if isinstance(x, np.ndarray)]
    on_device = [(key, x) for key, x in leaves if not isinstance(x, np.ndarray)]
    bad = next((key for key, x in on_host if not np.isfinite(x).all()), None)
    if bad is None and on_device:
        finite = np.asarray(_all_finite([x for _, x in on_device], None))
        flagged = np.flatnonzero(~finite)
        bad = on_device[int(flagged[0])][0] if flagged.size else None
    return bad


@functools.partial(jax.jit, static_argnums=1)
def _all_finite(arrays: list[jax.Array], dtype: str | None) -> jax.Array:
    return jnp.stack([jnp.all(jnp.isfinite(_cast(x, dtype))) for x in arrays])


def check_finite(state: nnx.State, dtype: str | None = None) -> None:
    """Raises NonFiniteWeights naming the first parameter that holds a NaN or inf (in `dtype`)."""
    bad = nonfinite_param(state, dtype)
    if bad is not None:
        raise _nonfinite(bad)


def _nonfinite(key: str) -> NonFiniteWeights:
    return NonFiniteWeights(f"weights: parameter {key!r} holds NaN or inf")


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


def _checked_leaf(key: str, array: Any, like: Any) -> np.ndarray:
    if not isinstance(array, np.ndarray):
        raise ValueError(f"weights: {key!r} is not an array (got {type(array).__name__})")
    if array.shape != tuple(like.shape) or array.dtype != like.dtype:
        raise ValueError(f"weights: {key!r} has {array.dtype}{list(array.shape)}, "
                         f"expected {np.dtype(like.dtype)}{list(like.shape)}")
    return array


def _sharding(like: Any) -> jax.sharding.Sharding | None:
    """Where the leaf `like` lives (None: not a jax array, e.g. an abstract state's: the default device)."""
    sharding = getattr(like, "sharding", None)
    return sharding if isinstance(sharding, jax.sharding.Sharding) else None
