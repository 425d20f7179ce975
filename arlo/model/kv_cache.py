"""The decode-time KV cache: per layer, keys and values at absolute-position slots."""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from arlo.model.config import ModelConfig


class KVCache(NamedTuple):
    """Slot s of row b holds the key/value of the token at absolute position s.

    A NamedTuple is a pytree, so a cache passes through jit, while_loop and donation as
    is. One array per layer (not one stacked array) so each layer's write is an in-place
    update of its own buffer.
    """

    k: tuple[jax.Array, ...]
    """num_layers arrays of [batch, length, num_kv_heads, head_dim]."""
    v: tuple[jax.Array, ...]

    @property
    def batch(self) -> int:
        return self.k[0].shape[0]

    @property
    def length(self) -> int:
        return self.k[0].shape[1]


def init_cache(cfg: ModelConfig, *, batch: int, length: int, dtype: jnp.dtype | None = None) -> KVCache:
    """Zeros of static shape; `dtype` defaults to the model's compute dtype."""
    shape = (batch, length, cfg.num_kv_heads, cfg.head_dim)
    dt = cfg.compute_dtype if dtype is None else dtype
    return KVCache(k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
                   v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)))


def broadcast_cache(cache: KVCache, batch: int) -> KVCache:
    """Repeat a batch-1 cache (one prefilled prompt) to `batch` rows."""
    def rows(x: jax.Array) -> jax.Array:
        return jnp.broadcast_to(x, (batch, *x.shape[1:]))

    return jax.tree.map(rows, cache)
