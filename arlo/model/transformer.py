"""Decoder-only transformer: embed -> N x (norm, GQA attention, norm, SwiGLU) -> norm -> logits.

Two entry points share the layers:
- `__call__(tokens_bt)`: full causal forward for training, logits for every position.
- `prefill` / `decode_step`: the KV-cache path for generation. Cache slots are absolute
  positions, so the causal mask is just `slot <= position`; slots beyond a row's position
  hold stale or padding keys and are masked, never cleared.
- `decode_step_buffered`: the engine's chunked decode, over a read-only cache plus a small
  per-chunk buffer of the chunk's own keys/values (no per-step scatter into the cache).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model.config import ModelConfig
from arlo.model.kv_cache import KVCache
from arlo.model.layers import MLP, Attention, Embedder, Part, RMSNorm


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs)
        self.attn = Attention(cfg, rngs=rngs)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs)
        self.mlp = MLP(cfg, rngs=rngs)

    def __call__(
        self,
        x_btd: jax.Array,
        positions_bt: jax.Array,
        mask_bts: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        start_b: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        h_btd, new_kv = self.attn(self.attn_norm(x_btd), positions_bt, mask_bts, kv, start_b)
        x_btd = x_btd + h_btd
        return x_btd + self.mlp(self.mlp_norm(x_btd)), new_kv

    def decode_buffered(self, x_btd: jax.Array, positions_bt: jax.Array, cache: Part, buf: Part,
                        step: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        h_btd, new_buf = self.attn.decode_buffered(self.attn_norm(x_btd), positions_bt, cache, buf, step)
        x_btd = x_btd + h_btd
        return x_btd + self.mlp(self.mlp_norm(x_btd)), new_buf


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = Embedder(cfg.vocab_size, cfg.dim, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs)
        if not cfg.tie_embeddings:
            init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")
            self.lm_head_dv = nnx.Param(init(rngs.params(), (cfg.dim, cfg.vocab_size), jnp.float32),
                                        out_sharding=("embed", "vocab"), eager_sharding=False)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Causal forward over whole sequences; returns float32 logits_btv."""
        return self._logits(self.hidden(tokens_bt))

    def hidden(self, tokens_bt: jax.Array, *, remat: str = "none") -> jax.Array:
        """Final-normed hidden states h_btd (logits = `logits_from_hidden(h)`).

        `remat` trades compute for memory in training: "full" recomputes each layer in the
        backward pass, "dots" keeps only the matmul outputs (`dots_with_no_batch_dims_saveable`).
        """
        t = tokens_bt.shape[1]
        positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_bt.shape)
        mask_bts = jnp.tril(jnp.ones((t, t), jnp.bool_))[None]
        x_btd = self.embedder.encode(tokens_bt, self.cfg.compute_dtype)
        if remat == "none":
            for layer in self.layers:
                x_btd = layer(x_btd, positions_bt, mask_bts)[0]
        else:
            x_btd = _scan_layers_remat(list(self.layers), x_btd, positions_bt, mask_bts, remat)
        return self.final_norm(x_btd)

    def logits_from_hidden(self, h_btd: jax.Array) -> jax.Array:
        return self._logits(h_btd)

    def prefill(
        self, tokens_bt: jax.Array, lengths_b: jax.Array, cache: KVCache, *, start_b: jax.Array | None = None
    ) -> tuple[jax.Array, KVCache]:
        """Write a right-padded chunk into the cache at positions start_b.. (default 0).

        Returns the float32 logits after each row's last real token (index lengths_b - 1 of
        the chunk), i.e. the next-token distribution, and the updated cache. Padding
        tokens are written too; they sit beyond the row's position and get overwritten by
        later decode steps before anything attends to them.
        """
        if start_b is None:
            start_b = jnp.zeros(tokens_bt.shape[:1], jnp.int32)
        x_btd, cache = self._forward_cached(tokens_bt, start_b, cache)
        last_b = jnp.asarray(lengths_b, jnp.int32) - 1
        x_bd = jnp.take_along_axis(x_btd, last_b[:, None, None], axis=1)[:, 0]
        return self._logits(self.final_norm(x_bd[:, None]))[:, 0], cache

    def decode_step(
        self, tokens_b: jax.Array, positions_b: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """Feed one token per row at its own position; returns (logits_bv float32, cache)."""
        x_btd, cache = self._forward_cached(tokens_b[:, None], jnp.asarray(positions_b, jnp.int32), cache)
        return self._logits(self.final_norm(x_btd))[:, 0], cache

    def decode_step_buffered(
        self, tokens_b: jax.Array, positions_b: jax.Array, base_b: jax.Array, cache: KVCache, buf: KVCache,
        step: jax.Array,
    ) -> tuple[jax.Array, KVCache]:
        """`decode_step` for a chunk of decode steps over a read-only `cache`.

        `cache` holds each row's keys/values below base_b (the row's position when the chunk
        began) and is not written; the chunk's own keys/values go to `buf` (same layout, one
        slot per step) at slot `step`, and slots <= step of `buf` are attended too. The
        caller writes `buf` back into its cache once per chunk (`kv_cache.write_band`).
        Returns (logits_bv float32, buf).
        """
        positions_bt = jnp.asarray(positions_b, jnp.int32)[:, None]
        cache_mask_bts = jnp.arange(cache.length, dtype=jnp.int32)[None, None, :] < base_b[:, None, None]
        buf_mask_bts = jnp.broadcast_to(jnp.arange(buf.length, dtype=jnp.int32) <= step,
                                        (tokens_b.shape[0], 1, buf.length))
        x_btd = self.embedder.encode(tokens_b[:, None], self.cfg.compute_dtype)
        new_k, new_v = [], []
        for i, layer in enumerate(self.layers):
            x_btd, (k, v) = layer.decode_buffered(x_btd, positions_bt, (cache.k[i], cache.v[i], cache_mask_bts),
                                                  (buf.k[i], buf.v[i], buf_mask_bts), step)
            new_k.append(k)
            new_v.append(v)
        return self._logits(self.final_norm(x_btd))[:, 0], KVCache(k=tuple(new_k), v=tuple(new_v))

    def _forward_cached(
        self, tokens_bt: jax.Array, start_b: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        t = tokens_bt.shape[1]
        positions_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)
        mask_bts = jnp.arange(cache.length, dtype=jnp.int32)[None, None, :] <= positions_bt[:, :, None]
        x_btd = self.embedder.encode(tokens_bt, self.cfg.compute_dtype)
        new_k, new_v = [], []
        for layer, k_bskh, v_bskh in zip(self.layers, cache.k, cache.v, strict=True):
            x_btd, kv = layer(x_btd, positions_bt, mask_bts, (k_bskh, v_bskh), start_b)
            assert kv is not None
            new_k.append(kv[0])
            new_v.append(kv[1])
        return x_btd, KVCache(k=tuple(new_k), v=tuple(new_v))

    def _logits(self, x_btd: jax.Array) -> jax.Array:
        if self.cfg.tie_embeddings:
            return self.embedder.decode(x_btd)
        head_dv = self.lm_head_dv[...].astype(x_btd.dtype)
        return jnp.einsum("btd,dv->btv", x_btd, head_dv, preferred_element_type=jnp.float32)


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _scan_layers_remat(layers: list[Block], x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array,
                       remat: str) -> jax.Array:
    """Runs the layers as a lax.scan over their stacked parameters, each step rematerialised.

    A Python loop of jax.checkpoint'ed layers does not lower memory on XLA:CPU (the unrolled
    program keeps every layer's attention intermediates: measured, same plan with and without
    remat); a scan forces one layer's activations at a time. Stacking copies the parameters
    once per step, which is small next to the activations it saves.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; use none, {', '.join(REMAT_POLICIES)}")
    splits = [nnx.split(layer) for layer in layers]
    graphdef = splits[0][0]
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *(state for _, state in splits))

    @functools.partial(jax.checkpoint, policy=REMAT_POLICIES[remat])
    def body(x: jax.Array, state: nnx.State) -> tuple[jax.Array, None]:
        return nnx.merge(graphdef, state)(x, positions_bt, mask_bts)[0], None

    return jax.lax.scan(body, x_btd, stacked)[0]


def create_model(cfg: ModelConfig, seed: int) -> Transformer:
    """Deterministic: the same cfg and seed give the same weights (on one platform)."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """Shapes and dtypes only, no allocation: a `like` for restoring weights."""
    return nnx.eval_shape(lambda: create_model(cfg, 0))
