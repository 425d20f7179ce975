"""Decoder-only transformer: embed -> N x (norm, GQA attention, norm, SwiGLU) -> norm -> logits.

Two entry points share the layers:
- `__call__(tokens_bt)`: full causal forward for training, logits for every position.
  `hidden` also takes packed rows (several episodes per row: `segment_ids_bt`, `positions_bt`).
- `prefill` / `decode_step`: the KV-cache path for generation. Cache slots are absolute
  positions, so the causal mask is just `slot <= position`; slots beyond a row's position
  hold stale or padding keys and are masked, never cleared.
- `decode_step_buffered`: the engine's chunked decode, over a read-only cache plus a small
  per-chunk buffer of the chunk's own keys/values (no per-step scatter into the cache).

Sliding-window layers (Gemma) take every path's mask with keys `sliding_window` or more
positions behind the query dropped (`_layer_masks`). The dense cache still keeps every
position for them, so masking is all the window needs; a ring buffer of `sliding_window`
slots per sliding layer would save their cache memory and is a later optimisation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model import lora
from arlo.model.config import ModelConfig
from arlo.model.kv_cache import KVCache
from arlo.model.layers import MLP, Attention, Embedder, Part, RMSNorm, softcap
from arlo.model.moe import MoE, Routing
from arlo.model.paged_attention import PagedKernel
from arlo.model.paged_kv import KernelPool

Masks = tuple[jax.Array, jax.Array]
"""(full-attention mask_bts, sliding-window mask_bts): each layer takes the one of its kind."""


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sliding: bool = False, moe: bool = False):
        self.sliding = sliding
        self.post_norms = cfg.post_norms
        self.attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                 trained=lora.trains_norms(cfg))
        self.attn = Attention(cfg, rngs=rngs, sliding=sliding)
        self.mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                trained=lora.trains_norms(cfg))
        self.mlp = MoE(cfg, rngs=rngs) if moe else MLP(cfg, rngs=rngs)  # routed experts: moe.py
        if cfg.post_norms:  # Gemma: parameters only when enabled, so presets keep their tree
            self.post_attn_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                          trained=lora.trains_norms(cfg))
            self.post_mlp_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                         trained=lora.trains_norms(cfg))

    def __call__(
        self,
        x_btd: jax.Array,
        positions_bt: jax.Array,
        mask_bts: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        start_b: jax.Array | None = None,
        experts: list[jax.Array] | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """`experts`: a routed layer appends the experts it chose ([b, t, top_k]) to it (recording)."""
        h_btd, new_kv = self.attn(self.attn_norm(x_btd), positions_bt, mask_bts, kv, start_b)
        x_btd = x_btd + self._post(h_btd, "post_attn_norm")
        return x_btd + self._post(self._mlp(self.mlp_norm(x_btd), experts), "post_mlp_norm"), new_kv

    def decode_buffered(self, x_btd: jax.Array, positions_bt: jax.Array, cache: Part, buf: Part,
                        step: jax.Array, experts: list[jax.Array] | None = None,
                        ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        h_btd, new_buf = self.attn.decode_buffered(self.attn_norm(x_btd), positions_bt, cache, buf, step)
        x_btd = x_btd + self._post(h_btd, "post_attn_norm")
        return x_btd + self._post(self._mlp(self.mlp_norm(x_btd), experts), "post_mlp_norm"), new_buf

    def decode_paged(self, x_btd: jax.Array, positions_bt: jax.Array, pages: tuple[jax.Array, jax.Array],
                     tables_bp: jax.Array, kernel: PagedKernel, experts: list[jax.Array] | None = None,
                     ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        h_btd, pages = self.attn.decode_paged(self.attn_norm(x_btd), positions_bt, pages, tables_bp, kernel)
        x_btd = x_btd + self._post(h_btd, "post_attn_norm")
        return x_btd + self._post(self._mlp(self.mlp_norm(x_btd), experts), "post_mlp_norm"), pages

    def _mlp(self, x_btd: jax.Array, experts: list[jax.Array] | None) -> jax.Array:
        if experts is None or not isinstance(self.mlp, MoE):
            return self.mlp(x_btd)
        y_btd, routing = self.mlp.routed(x_btd)
        experts.append(routing.experts_btk)
        return y_btd

    def routed(self, x_btd: jax.Array, positions_bt: jax.Array, mask_bts: jax.Array,
               experts_btk: jax.Array | None, count_bt: jax.Array | None,
               replay_bt: jax.Array | None = None) -> tuple[jax.Array, Routing]:
        """`__call__` without a cache for a routed layer, its routing in (replay, at `replay_bt`'s
        tokens) and out (moe.MoE.routed)."""
        h_btd, _ = self.attn(self.attn_norm(x_btd), positions_bt, mask_bts)
        x_btd = x_btd + self._post(h_btd, "post_attn_norm")
        y_btd, routing = self.mlp.routed(self.mlp_norm(x_btd), experts_btk, count_bt, replay_bt)
        return x_btd + self._post(y_btd, "post_mlp_norm"), routing

    def _post(self, h_btd: jax.Array, norm: str) -> jax.Array:
        """Gemma's norm on a sublayer's output before the residual add; identity without post_norms."""
        return getattr(self, norm)(h_btd) if self.post_norms else h_btd


class Transformer(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        self.embedder = Embedder(cfg.vocab_size, cfg.dim, rngs=rngs)
        self.layers = nnx.List([Block(cfg, rngs=rngs, sliding=cfg.is_sliding(i),
                                           moe=cfg.moe is not None and cfg.moe.routed(i))
                                     for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.dim, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                  trained=lora.trains_norms(cfg))
        if not cfg.tie_embeddings:
            init = nnx.initializers.variance_scaling(1.0, "fan_in", "normal")
            self.lm_head_dv = nnx.Param(init(rngs.params(), (cfg.dim, cfg.vocab_size), jnp.float32),
                                        out_sharding=("embed", "vocab"), eager_sharding=False)

    def __call__(self, tokens_bt: jax.Array) -> jax.Array:
        """Causal forward over whole sequences; returns float32 logits_btv."""
        return self._logits(self.hidden(tokens_bt))

    def hidden(self, tokens_bt: jax.Array, *, remat: str = "none", segment_ids_bt: jax.Array | None = None,
               positions_bt: jax.Array | None = None) -> jax.Array:
        """Final-normed hidden states h_btd (logits = `logits_from_hidden(h)`).

        `remat` trades compute for memory in training: "full" recomputes each layer in the
        backward pass, "dots" keeps only the matmul outputs (`dots_with_no_batch_dims_saveable`).
        Packed rows (services/trainer/packing.py): `segment_ids_bt` (0 = padding, 1.. one per
        episode) keeps attention inside each episode, `positions_bt` gives RoPE each episode's
        own positions; see `_train_layout`.
        """
        positions_bt, masks = self._train_layout(tokens_bt, segment_ids_bt, positions_bt)
        x_btd = self._embed(tokens_bt)
        if remat == "none":
            for layer in self.layers:
                x_btd = layer(x_btd, positions_bt, masks[layer.sliding])[0]
        else:
            x_btd = _scan_layers_remat(list(self.layers), x_btd, positions_bt, masks, remat)
        return self.final_norm(x_btd)

    def hidden_routed(self, tokens_bt: jax.Array, *, remat: str = "none", experts_lbtk: jax.Array | None = None,
                      count_bt: jax.Array | None = None, segment_ids_bt: jax.Array | None = None,
                      positions_bt: jax.Array | None = None,
                      replay_bt: jax.Array | None = None) -> tuple[jax.Array, tuple[Routing, ...]]:
        """`hidden` with the routed layers' Routing (moe.py), one per routed layer in order:
        the experts each token used and the load-balancing statistics over `count_bt`'s tokens.
        `experts_lbtk` ([routed layers, b, t, top_k]) replays recorded experts instead of routing,
        at the tokens `replay_bt` (0/1 [b, t]) marks when given, at every token without it.
        With `remat`, each layer is rematerialised on its own (no scan: the Routing is per layer).
        `segment_ids_bt` / `positions_bt`: packed rows, as in `hidden`."""
        positions_bt, masks = self._train_layout(tokens_bt, segment_ids_bt, positions_bt)
        if remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"unknown remat policy {remat!r}; use none, {', '.join(REMAT_POLICIES)}")
        x_btd, routings = self._embed(tokens_bt), []
        for layer in self.layers:
            def run(layer: Block, x: jax.Array, experts: jax.Array | None) -> tuple[jax.Array, Routing | None]:
                if isinstance(layer.mlp, MoE):
                    return layer.routed(x, positions_bt, masks[layer.sliding], experts, count_bt, replay_bt)
                return layer(x, positions_bt, masks[layer.sliding])[0], None

            if remat != "none":
                run = nnx.remat(run, policy=REMAT_POLICIES[remat])
            experts = None if experts_lbtk is None or not isinstance(layer.mlp, MoE) else experts_lbtk[len(routings)]
            x_btd, routing = run(layer, x_btd, experts)
            routings += [routing] if routing is not None else []
        return self.final_norm(x_btd), tuple(routings)

    def logits_from_hidden(self, h_btd: jax.Array) -> jax.Array:
        return self._logits(h_btd)

    def prefill(
        self, tokens_bt: jax.Array, lengths_b: jax.Array, cache: KVCache, *, start_b: jax.Array | None = None,
        with_experts: bool = False,
    ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
        """Write a right-padded chunk into the cache at positions start_b.. (default 0).

        Returns the float32 logits after each row's last real token (index lengths_b - 1 of
        the chunk), i.e. the next-token distribution, and the updated cache. Padding
        tokens are written too; they sit beyond the row's position and get overwritten by
        later decode steps before anything attends to them. `with_experts` (a model with routed
        experts): also the experts every routed layer chose at that last real token, int32
        [b, routed layers, top_k] (what routing replay records for the token sampled from it).
        """
        if start_b is None:
            start_b = jnp.zeros(tokens_bt.shape[:1], jnp.int32)
        experts: list[jax.Array] | None = [] if with_experts else None
        x_btd, cache = self._forward_cached(tokens_bt, start_b, cache, experts)
        last_b = jnp.asarray(lengths_b, jnp.int32) - 1
        x_bd = jnp.take_along_axis(x_btd, last_b[:, None, None], axis=1)[:, 0]
        logits_bv = self._logits(self.final_norm(x_bd[:, None]))[:, 0]
        if experts is None:
            return logits_bv, cache
        return logits_bv, cache, _stack_experts(experts, last_b)

    def decode_step(
        self, tokens_b: jax.Array, positions_b: jax.Array, cache: KVCache
    ) -> tuple[jax.Array, KVCache]:
        """Feed one token per row at its own position; returns (logits_bv float32, cache)."""
        x_btd, cache = self._forward_cached(tokens_b[:, None], jnp.asarray(positions_b, jnp.int32), cache)
        return self._logits(self.final_norm(x_btd))[:, 0], cache

    def decode_step_buffered(
        self, tokens_b: jax.Array, positions_b: jax.Array, base_b: jax.Array, cache: KVCache, buf: KVCache,
        step: jax.Array, *, with_experts: bool = False,
    ) -> tuple[jax.Array, KVCache] | tuple[jax.Array, KVCache, jax.Array]:
        """`decode_step` for a chunk of decode steps over a read-only `cache`.

        `cache` holds each row's keys/values below base_b (the row's position when the chunk
        began) and is not written; the chunk's own keys/values go to `buf` (same layout, one
        slot per step) at slot `step`, and slots <= step of `buf` are attended too. The
        caller writes `buf` back into its cache once per chunk (`kv_cache.write_band`).
        Returns (logits_bv float32, buf); `with_experts` (a model with routed experts): plus the
        experts every routed layer chose for the fed token, int32 [b, routed layers, top_k].
        """
        positions_bt = jnp.asarray(positions_b, jnp.int32)[:, None]
        cache_pos_bs = jnp.arange(cache.length, dtype=jnp.int32)[None, :]
        cache_masks = self._layer_masks(cache_pos_bs[:, None, :] < base_b[:, None, None], positions_bt, cache_pos_bs)
        buf_mask_bts = jnp.broadcast_to(jnp.arange(buf.length, dtype=jnp.int32) <= step,
                                        (tokens_b.shape[0], 1, buf.length))
        # Buffer slot j holds position base_b + j (the caller writes it back there).
        buf_pos_bs = base_b[:, None] + jnp.arange(buf.length, dtype=jnp.int32)[None, :]
        buf_masks = self._layer_masks(buf_mask_bts, positions_bt, buf_pos_bs)
        x_btd = self._embed(tokens_b[:, None])
        new_k, new_v = [], []
        experts: list[jax.Array] | None = [] if with_experts else None
        for i, layer in enumerate(self.layers):
            cache_part = (cache.k[i], cache.v[i], cache_masks[layer.sliding])
            buf_part = (buf.k[i], buf.v[i], buf_masks[layer.sliding])
            x_btd, (k, v) = layer.decode_buffered(x_btd, positions_bt, cache_part, buf_part, step, experts)
            new_k.append(k)
            new_v.append(v)
        return _decoded(self._logits(self.final_norm(x_btd))[:, 0], KVCache(k=tuple(new_k), v=tuple(new_v)), experts)

    def decode_step_paged(
        self, tokens_b: jax.Array, positions_b: jax.Array, pool: KernelPool, tables_bp: jax.Array, *,
        kernel: PagedKernel,
        with_experts: bool = False,
    ) -> tuple[jax.Array, KernelPool] | tuple[jax.Array, KernelPool, jax.Array]:
        """`decode_step` on the paged pool in the kernels' layout: each layer writes the fed token's
        key/value into its row's page at positions_b and attends the row's pages in place
        (arlo/model/paged_attention.py `kernel`). Returns (logits_bv float32, pool), plus the
        experts as `decode_step_buffered` with `with_experts`. Every layer must be full attention."""
        assert not any(layer.sliding for layer in self.layers), "paged decode has no sliding window"
        positions_bt = jnp.asarray(positions_b, jnp.int32)[:, None]
        x_btd = self._embed(tokens_b[:, None])
        new_k, new_v = [], []
        experts: list[jax.Array] | None = [] if with_experts else None
        for layer, k_pages, v_pages in zip(self.layers, pool.k, pool.v, strict=True):
            x_btd, (k_pages, v_pages) = layer.decode_paged(x_btd, positions_bt, (k_pages, v_pages), tables_bp,
                                                           kernel, experts)
            new_k.append(k_pages)
            new_v.append(v_pages)
        return _decoded(self._logits(self.final_norm(x_btd))[:, 0], KernelPool(k=tuple(new_k), v=tuple(new_v)),
                        experts)

    def _forward_cached(
        self, tokens_bt: jax.Array, start_b: jax.Array, cache: KVCache, experts: list[jax.Array] | None = None,
    ) -> tuple[jax.Array, KVCache]:
        t = tokens_bt.shape[1]
        positions_bt = start_b[:, None] + jnp.arange(t, dtype=jnp.int32)
        slots_bs = jnp.arange(cache.length, dtype=jnp.int32)[None, :]
        masks = self._layer_masks(slots_bs[:, None, :] <= positions_bt[:, :, None], positions_bt, slots_bs)
        x_btd = self._embed(tokens_bt)
        new_k, new_v = [], []
        for layer, k_bskh, v_bskh in zip(self.layers, cache.k, cache.v, strict=True):
            x_btd, kv = layer(x_btd, positions_bt, masks[layer.sliding], (k_bskh, v_bskh), start_b, experts)
            assert kv is not None
            new_k.append(kv[0])
            new_v.append(kv[1])
        return x_btd, KVCache(k=tuple(new_k), v=tuple(new_v))

    def _embed(self, tokens_bt: jax.Array) -> jax.Array:
        dt = self.cfg.compute_dtype
        x_btd = self.embedder.encode(tokens_bt, dt)
        # Gemma: sqrt(dim) rounded to the compute dtype first, as HF rounds it to the weights' dtype.
        return x_btd * jnp.asarray(self.cfg.dim**0.5, dt) if self.cfg.embed_scale else x_btd

    def _train_layout(self, tokens_bt: jax.Array, segment_ids_bt: jax.Array | None,
                      positions_bt: jax.Array | None) -> tuple[jax.Array, Masks]:
        """(positions_bt, masks) of a training forward. Without segments or positions, exactly the
        arrays (and so the compiled program) of a plain causal forward; with segments, causal AND
        same segment AND not padding, the sliding window measured in the episodes' positions
        (within one segment those differ as the columns do)."""
        t = tokens_bt.shape[1]
        if positions_bt is None:
            positions_bt = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), tokens_bt.shape)
            if segment_ids_bt is None:  # the operations, in the order, of the unpacked forward
                mask_bts = jnp.tril(jnp.ones((t, t), jnp.bool_))[None]
                return positions_bt, self._layer_masks(mask_bts, positions_bt[:1], positions_bt[:1])
        causal_bts = jnp.tril(jnp.ones((t, t), jnp.bool_))[None]
        mask_bts = causal_bts if segment_ids_bt is None else causal_bts & segment_mask_bts(segment_ids_bt)
        return positions_bt, self._layer_masks(mask_bts, positions_bt, positions_bt)

    def _layer_masks(self, mask_bts: jax.Array, q_pos_bt: jax.Array, k_pos_bs: jax.Array) -> Masks:
        """(mask_bts, the same without keys sliding_window or more positions behind the query)
        for query positions q_pos_bt and key positions k_pos_bs (HF: kv > q - sliding_window)."""
        window = self.cfg.sliding_window
        if window is None:
            return mask_bts, mask_bts
        return mask_bts, mask_bts & (q_pos_bt[:, :, None] - k_pos_bs[:, None, :] < window)

    def _logits(self, x_btd: jax.Array) -> jax.Array:
        if self.cfg.tie_embeddings:
            logits_btv = self.embedder.decode(x_btd)
        else:
            head_dv = self.lm_head_dv[...].astype(x_btd.dtype)
            logits_btv = jnp.einsum("btd,dv->btv", x_btd, head_dv, preferred_element_type=jnp.float32)
        return softcap(logits_btv, self.cfg.final_logit_softcap)


def _decoded(logits_bv: jax.Array, cache: KVCache | KernelPool, experts: list[jax.Array] | None,
             ) -> tuple[jax.Array, KVCache | KernelPool] | tuple[jax.Array, KVCache | KernelPool, jax.Array]:
    """A one-token decode's (logits, cache), plus the experts each routed layer chose when recorded."""
    if experts is None:
        return logits_bv, cache
    return logits_bv, cache, _stack_experts(experts, jnp.zeros(logits_bv.shape[:1], jnp.int32))


def _stack_experts(experts: list[jax.Array], index_b: jax.Array) -> jax.Array:
    """int32 [b, routed layers, top_k]: each routed layer's experts ([b, t, top_k]) at column index_b."""
    if not experts:
        raise ValueError("with_experts: the model has no routed experts")
    at = [jnp.take_along_axis(e, index_b[:, None, None], axis=1)[:, 0] for e in experts]
    return jnp.stack(at, axis=1).astype(jnp.int32)


def segment_mask_bts(segment_ids_bt: jax.Array) -> jax.Array:
    """[b, t, t]: query t may see key s of the same segment, and padding (segment 0) sees nothing
    (its softmax is uniform over masked scores, finite, and no loss reads it)."""
    same = segment_ids_bt[:, :, None] == segment_ids_bt[:, None, :]
    return same & (segment_ids_bt[:, None, :] != 0)


REMAT_POLICIES = {
    "full": None,  # save nothing: recompute the whole layer
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _scan_layers_remat(layers: list[Block], x_btd: jax.Array, positions_bt: jax.Array, masks: Masks,
                       remat: str) -> jax.Array:
    """Runs the layers as a lax.scan over their stacked parameters, each layer rematerialised.

    A Python loop of jax.checkpoint'ed layers does not lower memory on XLA:CPU (the unrolled
    program keeps every layer's attention intermediates: measured, same plan with and without
    remat); a scan forces one layer's activations at a time. Stacking copies the parameters
    once per step, which is small next to the activations it saves. Layers of different kinds
    (Gemma's sliding and full layers) cannot share one scan body, so a step runs one period of
    the kinds' pattern (1 layer for uniform models, 2 for Gemma 2, 6 for Gemma 3) and the layers
    past the last whole period run as one shorter step.
    """
    if remat not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {remat!r}; use none, {', '.join(REMAT_POLICIES)}")
    kinds = [(layer.sliding, isinstance(layer.mlp, MoE)) for layer in layers]
    period = next(p for p in range(1, len(kinds) + 1) if all(k == kinds[i % p] for i, k in enumerate(kinds)))
    whole = len(layers) // period * period
    x_btd = _scan_periods(layers[:whole], period, x_btd, positions_bt, masks, remat)
    if whole < len(layers):
        x_btd = _scan_periods(layers[whole:], len(layers) - whole, x_btd, positions_bt, masks, remat)
    return x_btd


def _scan_periods(layers: list[Block], period: int, x_btd: jax.Array, positions_bt: jax.Array, masks: Masks,
                  remat: str) -> jax.Array:
    """Scan step i runs layers i*period .. (i+1)*period - 1, each under jax.checkpoint."""
    graphdefs, stacked = [], []
    for offset in range(period):
        splits = [nnx.split(layer) for layer in layers[offset::period]]
        graphdefs.append(splits[0][0])
        stacked.append(jax.tree.map(lambda *xs: jnp.stack(xs), *(state for _, state in splits)))

    def one_layer(graphdef: nnx.GraphDef, x: jax.Array, state: nnx.State) -> jax.Array:
        layer = nnx.merge(graphdef, state)
        return layer(x, positions_bt, masks[layer.sliding])[0]

    run = jax.checkpoint(one_layer, policy=REMAT_POLICIES[remat], static_argnums=(0,))

    def body(x: jax.Array, states: tuple[nnx.State, ...]) -> tuple[jax.Array, None]:
        for graphdef, state in zip(graphdefs, states, strict=True):
            x = run(graphdef, x, state)
        return x, None

    return jax.lax.scan(body, x_btd, tuple(stacked))[0]


def create_model(cfg: ModelConfig, seed: int) -> Transformer:
    """Deterministic: the same cfg and seed give the same weights (on one platform). LoRA
    adapters draw from their own stream, so the base weights do not depend on them."""
    return Transformer(cfg, rngs=nnx.Rngs(params=seed, lora=jax.random.fold_in(jax.random.key(seed), 1)))


def abstract_model(cfg: ModelConfig) -> Transformer:
    """Shapes and dtypes only, no allocation: a `like` for restoring weights."""
    return nnx.eval_shape(lambda: create_model(cfg, 0))
