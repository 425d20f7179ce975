"""The decode-time KV cache: per layer, keys and values at absolute-position slots.

Layout (measured on XLA:CPU, `bench/decode.py`): keys are stored [batch, kv_heads,
head_dim, length] and values [batch, kv_heads, length, head_dim], so both attention
products are plain batched matmuls over (batch, kv_heads) with the contracted dimension
where a matmul wants it: scores = q[g, h] @ K[h, s], out = p[g, s] @ V[s, h]. The
[batch, length, kv_heads, head_dim] layout it replaced made XLA transpose the whole
cache of every layer on every decode step (a b64 step: 127 ms -> under half that).
Batch and kv_heads lead, so a mesh shards slots over `data` and heads over `tensor`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arlo.model.config import ModelConfig
from arlo.model.sharding import BATCH_AXES, fit_spec

SEQ_AXIS_K = 3
SEQ_AXIS_V = 2


class KVCache(NamedTuple):
    """Slot s of row b holds the key/value of the token at absolute position s.

    A NamedTuple is a pytree, so a cache passes through jit, while_loop and donation as
    is. One array per layer (not one stacked array) so each layer's write is an in-place
    update of its own buffer.
    """

    k: tuple[jax.Array, ...]
    """num_layers arrays of [batch, num_kv_heads, head_dim, length] (keys transposed)."""
    v: tuple[jax.Array, ...]
    """num_layers arrays of [batch, num_kv_heads, length, head_dim]."""

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:
        return self.k[0].shape[SEQ_AXIS_K]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (*self.k, *self.v))


def cache_shapes(cfg: ModelConfig, *, batch: int, length: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(one layer's key shape, one layer's value shape)."""
    k, h = cfg.num_kv_heads, cfg.head_dim
    return (batch, k, h, length), (batch, k, length, h)


def init_cache(cfg: ModelConfig, *, batch: int, length: int, dtype: jnp.dtype | None = None) -> KVCache:
    """Zeros of static shape; `dtype` defaults to the model's compute dtype."""
    k_shape, v_shape = cache_shapes(cfg, batch=batch, length=length)
    dt = cfg.compute_dtype if dtype is None else dtype
    return KVCache(k=tuple(jnp.zeros(k_shape, dt) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(v_shape, dt) for _ in range(cfg.num_layers)))


def write_rows(k_bkhs: jax.Array, v_bksh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
               start_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One layer's (keys, values) with t new tokens per row written at positions start_b..

    Rows start at different positions (continuous batching). dynamic_update_slice clamps
    an out-of-range start, so callers guarantee start + t <= length.
    """
    k_new = jnp.transpose(k_btkh, (0, 2, 3, 1)).astype(k_bkhs.dtype)  # b k h t
    v_new = jnp.transpose(v_btkh, (0, 2, 1, 3)).astype(v_bksh.dtype)  # b k t h

    def row_k(c: jax.Array, n: jax.Array, s: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(c, n, (0, 0, s))

    def row_v(c: jax.Array, n: jax.Array, s: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice(c, n, (0, s, 0))

    return jax.vmap(row_k)(k_bkhs, k_new, start_b), jax.vmap(row_v)(v_bksh, v_new, start_b)


def write_slot(k_bkhs: jax.Array, v_bksh: jax.Array, k_btkh: jax.Array, v_btkh: jax.Array,
               start: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`write_rows` with one start for every row: a dynamic_update_slice, in place."""
    k_new = jnp.transpose(k_btkh, (0, 2, 3, 1)).astype(k_bkhs.dtype)
    v_new = jnp.transpose(v_btkh, (0, 2, 1, 3)).astype(v_bksh.dtype)
    zero = jnp.zeros((), jnp.int32)
    start = jnp.asarray(start, jnp.int32)
    return (jax.lax.dynamic_update_slice(k_bkhs, k_new, (zero, zero, zero, start)),
            jax.lax.dynamic_update_slice(v_bksh, v_new, (zero, zero, start, zero)))


def write_band(cache: KVCache, buf: KVCache, rows: jax.Array, start_b: jax.Array) -> KVCache:
    """Writes all `buf.length` positions of buffer row r at positions start_b[r].. of cache row
    rows[r] (a decode chunk's new keys/values, into a dense cache: the model tests' reference;
    the engine's paged pool is written by `paged_kv.write_positions`); callers guarantee
    start + length <= cache length."""
    cols = start_b[:, None] + jnp.arange(buf.length, dtype=jnp.int32)  # [r, steps]
    # Advanced indices (rows, cols) split by slices: their dims come first -> [r, steps, k, h].
    return KVCache(k=tuple(c.at[rows[:, None], :, :, cols].set(jnp.transpose(x, (0, 3, 1, 2)).astype(c.dtype))
                           for c, x in zip(cache.k, buf.k, strict=True)),
                   v=tuple(c.at[rows[:, None], :, cols].set(jnp.transpose(x, (0, 2, 1, 3)).astype(c.dtype))
                           for c, x in zip(cache.v, buf.v, strict=True)))


def cache_shardings(cfg: ModelConfig, mesh: Mesh, *, batch: int, length: int) -> KVCache:
    """A NamedSharding per cache array: rows (slots) over the data-parallel axes, kv heads over
    `tensor` (as the k/v projections that write them), each only where it divides."""
    batch_axes = tuple(a for a in BATCH_AXES if a in mesh.axis_names) or None
    heads_axis = "tensor" if "tensor" in mesh.axis_names else None
    k_shape, v_shape = cache_shapes(cfg, batch=batch, length=length)
    spec = PartitionSpec(batch_axes, heads_axis)
    k = NamedSharding(mesh, fit_spec(mesh, k_shape, spec))
    v = NamedSharding(mesh, fit_spec(mesh, v_shape, spec))
    return KVCache(k=(k,) * cfg.num_layers, v=(v,) * cfg.num_layers)
