"""Transformer building blocks: RMSNorm, embedding, GQA attention (RoPE in rope.py), SwiGLU MLP.

Parameters carry MaxText-style logical axis names in their `out_sharding` metadata
("vocab", "embed", "heads", "kv_heads", "kv", "mlp", "norm"); a trainer maps them onto mesh
axes with `flax.core.spmd.logical_axis_rules(...)` + `nnx.get_partition_spec(state)`.
`eager_sharding=False` keeps construction mesh-free (the CPU default); placement is the
caller's job. Parameters are float32; matmuls run in `cfg.dtype`; norms, softmax and
logits in float32.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
from flax import nnx

from arlo.model import lora
from arlo.model.config import ModelConfig
from arlo.model.kv_cache import write_rows, write_slot
from arlo.model.paged_attention import PagedKernel
from arlo.model.paged_kv import write_token
from arlo.model.rope import RopeScaling, apply_rope

Part = tuple[jax.Array, jax.Array, jax.Array]
"""(keys [b, kv_heads, head_dim, s], values [b, kv_heads, s, head_dim], mask_bts): one span of
attended positions."""

# Large negative instead of -inf, so a fully masked row (padding queries) gives a uniform
# softmax rather than NaNs.
_MASK_VALUE = -1e30


def _param(init: nnx.Initializer, key: jax.Array, shape: tuple[int, ...], axes: tuple[str, ...]) -> nnx.Param:
    return nnx.Param(init(key, shape, jnp.float32), out_sharding=axes, eager_sharding=False)


def _fan_in(in_axis: int | tuple[int, ...], out_axis: int | tuple[int, ...]) -> nnx.Initializer:
    return nnx.initializers.variance_scaling(1.0, "fan_in", "normal", in_axis=in_axis,
                                             out_axis=out_axis)


class RMSNorm(nnx.Module):
    """`unit_offset` (Gemma): the scale is stored as an offset from 1 and applied as (1 + w), as HF
    Gemma stores it, so checkpoints load as-is and weight decay pulls towards the identity."""

    def __init__(self, dim: int, *, eps: float, rngs: nnx.Rngs, unit_offset: bool = False, trained: bool = False):
        del rngs  # ones-initialised (Llama convention, so HF weights load as-is); zeros with the offset
        self.eps = eps
        self.unit_offset = unit_offset
        init = jnp.zeros if unit_offset else jnp.ones
        # `trained` (trainer.lora.train_norms): held as a lora.TrainedNorm, so the scale travels with the adapters.
        kind = lora.TrainedNorm if trained else nnx.Param
        self.scale = kind(init((dim,), jnp.float32), out_sharding=("norm",), eager_sharding=False)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        x = x_btd.astype(jnp.float32)
        x = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps)
        scale = self.scale[...] + 1.0 if self.unit_offset else self.scale[...]
        return (x * scale).astype(x_btd.dtype)


class Embedder(nnx.Module):
    """Token embedding; also the output projection when embeddings are tied."""

    def __init__(self, vocab_size: int, dim: int, *, rngs: nnx.Rngs):
        # std 1/sqrt(dim): tied logits of a unit-RMS hidden state then start with std ~1.
        init = nnx.initializers.normal(stddev=dim**-0.5)
        self.table_vd = _param(init, rngs.params(), (vocab_size, dim), ("vocab", "embed"))

    def encode(self, tokens_bt: jax.Array, dtype: jnp.dtype) -> jax.Array:
        return self.table_vd[...][tokens_bt].astype(dtype)

    def decode(self, x_btd: jax.Array) -> jax.Array:
        table_vd = self.table_vd[...].astype(x_btd.dtype)
        return jnp.einsum("btd,vd->btv", x_btd, table_vd, preferred_element_type=jnp.float32)


class Attention(nnx.Module):
    """Causal grouped-query attention with RoPE and an optional KV cache.

    Optional parts, present as parameters only when the config enables them (so presets
    keep their parameter tree): q/k/v biases (Qwen2), an output bias, and RMSNorm over
    head_dim on queries and keys before RoPE (Qwen3, Gemma 3). A `sliding` layer (Gemma)
    takes its window from the mask the caller passes, and its RoPE from rope_local_theta
    when set; the score scale and soft-cap follow query_pre_attn_scalar and attn_logit_softcap.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs, sliding: bool = False):
        d, n, k, h = cfg.dim, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.theta, self.rope_scaling = _layer_rope(cfg, sliding)
        self.score_scale = (cfg.query_pre_attn_scalar or h) ** -0.5
        self.softcap = cfg.attn_logit_softcap
        self.qkv_bias, self.o_bias, self.qk_norm = cfg.qkv_bias, cfg.o_bias, cfg.qk_norm
        in_init, out_init = _fan_in(0, (1, 2)), _fan_in((0, 1), 2)
        self.q_dnh = _param(in_init, rngs.params(), (d, n, h), ("embed", "heads", "kv"))
        self.k_dkh = _param(in_init, rngs.params(), (d, k, h), ("embed", "kv_heads", "kv"))
        self.v_dkh = _param(in_init, rngs.params(), (d, k, h), ("embed", "kv_heads", "kv"))
        self.o_nhd = _param(out_init, rngs.params(), (n, h, d), ("heads", "kv", "embed"))
        zeros = nnx.initializers.zeros_init()
        if cfg.qkv_bias:
            self.q_bias_nh = _param(zeros, rngs.params(), (n, h), ("heads", "kv"))
            self.k_bias_kh = _param(zeros, rngs.params(), (k, h), ("kv_heads", "kv"))
            self.v_bias_kh = _param(zeros, rngs.params(), (k, h), ("kv_heads", "kv"))
        if cfg.o_bias:
            self.o_bias_d = _param(zeros, rngs.params(), (d,), ("embed",))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(h, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                  trained=lora.trains_norms(cfg))
            self.k_norm = RMSNorm(h, eps=cfg.norm_eps, rngs=rngs, unit_offset=cfg.norm_unit_offset,
                                  trained=lora.trains_norms(cfg))
        self.q_lora = lora.adapter(cfg, "q_proj", (d,), (n, h), ("embed",), ("heads", "kv"), rngs)
        self.k_lora = lora.adapter(cfg, "k_proj", (d,), (k, h), ("embed",), ("kv_heads", "kv"), rngs)
        self.v_lora = lora.adapter(cfg, "v_proj", (d,), (k, h), ("embed",), ("kv_heads", "kv"), rngs)
        self.o_lora = lora.adapter(cfg, "o_proj", (n, h), (d,), ("heads", "kv"), ("embed",), rngs)

    def __call__(
        self,
        x_btd: jax.Array,
        positions_bt: jax.Array,
        mask_bts: jax.Array,
        kv: tuple[jax.Array, jax.Array] | None = None,
        start_b: jax.Array | None = None,
    ) -> tuple[jax.Array, tuple[jax.Array, jax.Array] | None]:
        """Without `kv`, keys are this chunk's own tokens (training). With `kv` (one layer of
        a KVCache: keys [b, kv_heads, head_dim, s], values [b, kv_heads, s, head_dim]), this
        chunk's keys/values are written at slots start_b.. and the query attends over all s
        slots under `mask_bts`."""
        dt = x_btd.dtype
        q_btnh, k_btkh, v_btkh = self._project_qkv(x_btd)
        q_btnh = apply_rope(q_btnh, positions_bt, self.theta, self.rope_scaling)
        k_btkh = apply_rope(k_btkh, positions_bt, self.theta, self.rope_scaling)
        new_kv = None
        if kv is None:  # training: long sequences attend in query blocks (_attend_blocked)
            out_btnh = _attend_blocked(q_btnh, k_btkh, v_btkh, mask_bts, self.score_scale, self.softcap)
        else:
            assert start_b is not None, "a KV cache write needs start_b"
            new_kv = write_rows(kv[0], kv[1], k_btkh, v_btkh, start_b)
            out_bktgh = _attend_parts_blocked(q_btnh, [(new_kv[0].astype(dt), new_kv[1].astype(dt), mask_bts)],
                                              self.score_scale, self.softcap)
            return self._project_out_grouped(out_bktgh), new_kv
        return self._project_out(out_btnh), new_kv

    def decode_buffered(self, x_btd: jax.Array, positions_bt: jax.Array, cache: Part, buf: Part,
                        step: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per row against a read-only cache window plus this chunk's keys/values.

        `cache` and `buf` are (keys, values, mask_bts) in the cache layout; this token's
        key/value go to slot `step` of `buf`, the same slot for every row, so the write is an
        in-place dynamic_update_slice of a small buffer instead of a per-row scatter into the
        window (measured: the scatter was ~15% of a b64 decode step and ~30% at b1).
        """
        q_btnh, k_btkh, v_btkh = self._project_qkv(x_btd)
        q_btnh = apply_rope(q_btnh, positions_bt, self.theta, self.rope_scaling)
        k_btkh = apply_rope(k_btkh, positions_bt, self.theta, self.rope_scaling)
        # The barriers keep XLA:CPU from folding the cache layout's transposes into the
        # projections, which it does by copying the k/v (and o) weights on every step.
        k_btkh, v_btkh = jax.lax.optimization_barrier((k_btkh, v_btkh))
        buf_k, buf_v = write_slot(buf[0], buf[1], k_btkh, v_btkh, step)
        dt = x_btd.dtype
        out_bktgh = _attend_parts(q_btnh, [(cache[0].astype(dt), cache[1].astype(dt), cache[2]),
                                           (buf_k.astype(dt), buf_v.astype(dt), buf[2])],
                                  self.score_scale, self.softcap)
        return self._project_out_grouped(out_bktgh), (buf_k, buf_v)

    def decode_paged(self, x_btd: jax.Array, positions_bt: jax.Array, pages: tuple[jax.Array, jax.Array],
                     tables_bp: jax.Array, kernel: PagedKernel) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        """One token per row, its key/value written into its page, then attention over the row's
        pages in place (a KernelPool layer; arlo/model/paged_attention.py). No sliding window."""
        q_btnh, k_btkh, v_btkh = self._project_qkv(x_btd)
        q_btnh = apply_rope(q_btnh, positions_bt, self.theta, self.rope_scaling)
        k_btkh = apply_rope(k_btkh, positions_bt, self.theta, self.rope_scaling)
        pos_b = positions_bt[:, 0]
        pages = write_token(*pages, k_btkh[:, 0], v_btkh[:, 0], tables_bp, pos_b)
        q_bnh = q_btnh[:, 0] * jnp.asarray(self.score_scale, q_btnh.dtype)
        # The pool is kept in the compute dtype: a cast here would copy the whole layer's pages every step.
        assert pages[0].dtype == q_bnh.dtype, (pages[0].dtype, q_bnh.dtype)
        out_bnh = kernel.attend(q_bnh, *pages, tables_bp, pos_b + 1, cap=self.softcap)
        return self._project_out(out_bnh[:, None]), pages

    def _project_out(self, out_btnh: jax.Array) -> jax.Array:
        dt = out_btnh.dtype
        out_btd = jnp.einsum("btnh,nhd->btd", out_btnh, self.o_nhd[...].astype(dt))
        return self._out_bias(lora.apply(out_btd, self.o_lora, out_btnh))

    def _project_out_grouped(self, out_bktgh: jax.Array) -> jax.Array:
        b, k, t, g, h = out_bktgh.shape
        dt = out_bktgh.dtype
        out_btf = jnp.transpose(out_bktgh, (0, 2, 1, 3, 4)).reshape(b, t, k * g * h)
        out_btf = jax.lax.optimization_barrier(out_btf)  # see decode_buffered
        o_fd = self.o_nhd[...].astype(dt).reshape(k * g * h, -1)
        out_btd = jnp.einsum("btf,fd->btd", out_btf, o_fd)
        return self._out_bias(lora.apply(out_btd, self.o_lora, out_btf, in_dims=1))

    def _out_bias(self, out_btd: jax.Array) -> jax.Array:
        return out_btd + self.o_bias_d[...].astype(out_btd.dtype) if self.o_bias else out_btd

    def _project_qkv(self, x_btd: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
        dt = x_btd.dtype
        q_btnh = jnp.einsum("btd,dnh->btnh", x_btd, self.q_dnh[...].astype(dt))
        k_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.k_dkh[...].astype(dt))
        v_btkh = jnp.einsum("btd,dkh->btkh", x_btd, self.v_dkh[...].astype(dt))
        q_btnh = lora.apply(q_btnh, self.q_lora, x_btd)
        k_btkh = lora.apply(k_btkh, self.k_lora, x_btd)
        v_btkh = lora.apply(v_btkh, self.v_lora, x_btd)
        if self.qkv_bias:
            q_btnh = q_btnh + self.q_bias_nh[...].astype(dt)
            k_btkh = k_btkh + self.k_bias_kh[...].astype(dt)
            v_btkh = v_btkh + self.v_bias_kh[...].astype(dt)
        if self.qk_norm:
            q_btnh, k_btkh = self.q_norm(q_btnh), self.k_norm(k_btkh)
        return q_btnh, k_btkh, v_btkh


def _layer_rope(cfg: ModelConfig, sliding: bool) -> tuple[float, RopeScaling | None]:
    """(theta, scaling) of a layer: Gemma 3's sliding layers have their own plain RoPE."""
    if sliding and cfg.rope_local_theta is not None:
        return cfg.rope_local_theta, None
    return cfg.rope_theta, cfg.rope_scaling


def softcap(scores: jax.Array, cap: float | None) -> jax.Array:
    """cap * tanh(scores / cap) (Gemma 2's attention and final logit soft-capping)."""
    return scores if cap is None else jnp.tanh(scores / cap) * cap


def _attend(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array, scale: float,
            cap: float | None = None) -> jax.Array:
    b, t, n, h = q_btnh.shape
    k = k_bskh.shape[2]
    # Group query heads by the kv head they share, instead of repeating k/v in memory.
    q_btkgh = q_btnh.reshape(b, t, k, n // k, h) * jnp.asarray(scale, q_btnh.dtype)
    scores_bkgts = jnp.einsum("btkgh,bskh->bkgts", q_btkgh, k_bskh, preferred_element_type=jnp.float32)
    scores_bkgts = jnp.where(mask_bts[:, None, None], softcap(scores_bkgts, cap), _MASK_VALUE)
    probs_bkgts = jax.nn.softmax(scores_bkgts, axis=-1).astype(v_bskh.dtype)
    out_btkgh = jnp.einsum("bkgts,bskh->btkgh", probs_bkgts, v_bskh)
    return out_btkgh.reshape(b, t, n, h)


TRAIN_QUERY_CHUNK = 1024
"""Query rows per block of `_attend_blocked` on sequences longer than TRAIN_CHUNKED_ABOVE."""
TRAIN_CHUNKED_ABOVE = 4096
"""Training sequences up to this length attend in one block (the programs they always had)."""


def _attend_blocked(q_btnh: jax.Array, k_bskh: jax.Array, v_bskh: jax.Array, mask_bts: jax.Array, scale: float,
                   cap: float | None = None) -> jax.Array:
    """`_attend` over a training sequence (`mask_bts` [1 or b, t, t]).

    Past TRAIN_CHUNKED_ABOVE tokens the whole [t, t] scores are not formed: a scan takes the
    queries TRAIN_QUERY_CHUNK rows at a time against every key, each block rematerialised in the
    backward pass, so the temporaries are one block's scores instead of t x t per head (the
    `small` preset's step at 16,384 tokens needed 34.7 GiB of temporaries dense, its scores
    alone 8 GiB a layer). Each query row's softmax is the dense path's own row."""
    b, t, n, h = q_btnh.shape
    if t <= TRAIN_CHUNKED_ABOVE:
        return _attend(q_btnh, k_bskh, v_bskh, mask_bts, scale, cap)
    chunk = TRAIN_QUERY_CHUNK
    blocks = -(-t // chunk)
    pad = blocks * chunk - t
    q_pad = jnp.pad(q_btnh, ((0, 0), (0, pad), (0, 0), (0, 0)))
    m_pad = jnp.pad(mask_bts, ((0, 0), (0, pad), (0, 0)))  # padded query rows see nothing
    q_cbqnh = jnp.moveaxis(q_pad.reshape(b, blocks, chunk, n, h), 1, 0)
    m_cbqs = jnp.moveaxis(m_pad.reshape(m_pad.shape[0], blocks, chunk, t), 1, 0)

    @jax.checkpoint
    def block(q: jax.Array, m: jax.Array) -> jax.Array:
        return _attend(q, k_bskh, v_bskh, m, scale, cap)

    out_cbqnh = jax.lax.map(lambda qm: block(*qm), (q_cbqnh, m_cbqs))
    return jnp.moveaxis(out_cbqnh, 0, 1).reshape(b, blocks * chunk, n, h)[:, :t]


def _attend_parts(q_btnh: jax.Array, parts: Sequence[Part], scale: float, cap: float | None = None) -> jax.Array:
    """Attention over the concatenation of `parts` (keys, values, mask_bts) in the cache layout
    (see kv_cache): both products are batched matmuls over (b, kv_head) with the t x group
    query rows as M, so no cache transpose; one softmax spans every part. Returns out_bktgh."""
    b, t, n, h = q_btnh.shape
    k = parts[0][0].shape[1]
    g = n // k
    q_bkmh = jnp.transpose(q_btnh.reshape(b, t, k, g, h), (0, 2, 1, 3, 4)).reshape(b, k, t * g, h)
    q_bkmh = q_bkmh * jnp.asarray(scale, q_bkmh.dtype)
    scores = []
    for k_bkhs, _, mask_bts in parts:
        scores_bkms = jnp.einsum("bkmh,bkhs->bkms", q_bkmh, k_bkhs, preferred_element_type=jnp.float32)
        mask_b1ms = jnp.repeat(mask_bts, g, axis=1)[:, None]  # row m = (t, g), t major
        scores.append(jnp.where(mask_b1ms, softcap(scores_bkms, cap), _MASK_VALUE))
    probs_bkms = jax.nn.softmax(jnp.concatenate(scores, axis=-1), axis=-1)
    out_bkmh, start = None, 0
    for (_, v_bksh, _), part in zip(parts, scores, strict=True):
        width = part.shape[-1]
        out = jnp.einsum("bkms,bksh->bkmh", probs_bkms[..., start: start + width].astype(v_bksh.dtype), v_bksh)
        out_bkmh = out if out_bkmh is None else out_bkmh + out
        start += width
    assert out_bkmh is not None
    return out_bkmh.reshape(b, k, t, g, h)


PREFILL_QUERY_CHUNK = 1024
"""Query rows per block of a prefill longer than this (`_attend_parts_blocked`)."""


def _attend_parts_blocked(q_btnh: jax.Array, parts: Sequence[Part], scale: float,
                          cap: float | None = None) -> jax.Array:
    """`_attend_parts` for a prefill chunk, PREFILL_QUERY_CHUNK query rows at a time.

    A long prefill against a long window formed every score at once: a 4,096-token chunk of a
    32k episode against its 18.8k-slot window is [4,096 x group, 18.8k] floats per kv head and
    layer. A scan over query blocks keeps one block's scores; each query row's softmax is the
    unblocked one's (nothing is differentiated here, so nothing is rematerialised)."""
    b, t, n, h = q_btnh.shape
    if t <= PREFILL_QUERY_CHUNK:
        return _attend_parts(q_btnh, parts, scale, cap)
    chunk = PREFILL_QUERY_CHUNK
    blocks = -(-t // chunk)
    pad = blocks * chunk - t
    q_cbqnh = jnp.moveaxis(jnp.pad(q_btnh, ((0, 0), (0, pad), (0, 0), (0, 0))).reshape(b, blocks, chunk, n, h), 1, 0)
    masks = [jnp.moveaxis(jnp.pad(m, ((0, 0), (0, pad), (0, 0))).reshape(m.shape[0], blocks, chunk, m.shape[-1]), 1, 0)
             for _, _, m in parts]  # padded query rows see nothing; they are cut off below

    def block(args: tuple[jax.Array, list[jax.Array]]) -> jax.Array:
        q, block_masks = args
        return _attend_parts(q, [(k, v, m) for (k, v, _), m in zip(parts, block_masks, strict=True)], scale, cap)

    out_cbktgh = jax.lax.map(block, (q_cbqnh, masks))
    k, g = out_cbktgh.shape[2], out_cbktgh.shape[4]
    return jnp.moveaxis(out_cbktgh, 0, 2).reshape(b, k, blocks * chunk, g, h)[:, :, :t]


# HF's gelu_pytorch_tanh is the tanh approximation of GELU.
ACTIVATIONS = {"silu": jax.nn.silu, "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True)}


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)); GeGLU (gelu_tanh in place of silu) for Gemma."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        d, f = cfg.dim, cfg.mlp_dim
        self.activation = cfg.mlp_activation
        self.gate_df = _param(_fan_in(0, 1), rngs.params(), (d, f), ("embed", "mlp"))
        self.up_df = _param(_fan_in(0, 1), rngs.params(), (d, f), ("embed", "mlp"))
        self.down_fd = _param(_fan_in(0, 1), rngs.params(), (f, d), ("mlp", "embed"))
        self.gate_lora = lora.adapter(cfg, "gate_proj", (d,), (f,), ("embed",), ("mlp",), rngs)
        self.up_lora = lora.adapter(cfg, "up_proj", (d,), (f,), ("embed",), ("mlp",), rngs)
        self.down_lora = lora.adapter(cfg, "down_proj", (f,), (d,), ("mlp",), ("embed",), rngs)

    def __call__(self, x_btd: jax.Array) -> jax.Array:
        dt = x_btd.dtype
        gate_btf = lora.apply(jnp.einsum("btd,df->btf", x_btd, self.gate_df[...].astype(dt)), self.gate_lora, x_btd)
        up_btf = lora.apply(jnp.einsum("btd,df->btf", x_btd, self.up_df[...].astype(dt)), self.up_lora, x_btd)
        hidden_btf = ACTIVATIONS[self.activation](gate_btf) * up_btf
        out_btd = jnp.einsum("btf,fd->btd", hidden_btf, self.down_fd[...].astype(dt))
        return lora.apply(out_btd, self.down_lora, hidden_btf)
