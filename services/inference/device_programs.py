"""The engine's jitted programs: a prefill and a decode chunk, over the paged KV pool.

- prefill(rows m, tokens t, window w, samples j): gathers the window [0, w) of each prompt row
  through its table, runs the model's prefill from the row's start, writes the pages the chunk
  covers into the table of every sample that reads the row, and samples every first token.
- decode chunk, gather path (inference.attention_kernel: xla): gathers each row's window once,
  runs `steps` tokens as one lax.scan over that read-only window plus a [b, steps] buffer of the
  chunk's own keys/values, then writes the buffer into each row's pages once.
- decode chunk, in place (pallas): each step writes its token into the row's page and attends the
  row's pages with JAX's paged-attention kernel (arlo/model/paged_attention.py); no window.

Both decode forms share `_decode_loop`: sampling, stop ids and max tokens on the device with
per-row parameters. Weights are a traced argument and the pool is donated; the static arguments
(graphdef, steps, window or kernel, sharding, `top`) pick the compiled program.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from arlo.model.config import ModelConfig
from arlo.model.kv_cache import KVCache, init_cache
from arlo.model.lora import select_adapters
from arlo.model.paged_attention import PagedKernel, kernel_for
from arlo.model.paged_kv import KernelPool, gather_pages, kernel_heads_axis, write_positions, write_prefill
from arlo.model.sampling import sample, sample_with_top
from arlo.model.sharding import BATCH_AXES
from arlo.routing_replay import routing_shape


class SampleParams(NamedTuple):
    """Per-row sampling knobs; rows may all differ, one program serves them."""

    temperature: np.ndarray
    top_k: np.ndarray
    top_p: np.ndarray
    min_p: np.ndarray
    seed: np.ndarray
    """[r, 2] uint32: the request's 64-bit seed."""
    sample: np.ndarray
    """[r] uint32: the sample's index within its request (its own stream)."""


class PrefillBatch(NamedTuple):
    src_table: np.ndarray  # [m, P] page table each prompt row reads
    tokens: np.ndarray  # [m, t]
    lengths: np.ndarray  # [m] tokens of this chunk that are real
    starts: np.ndarray  # [m] position of the chunk's first token (a page boundary)
    dst_table: np.ndarray  # [j, P] page table of each sample
    src_row: np.ndarray  # [j] prompt row each sample reads
    count: np.ndarray  # [j] index of the token sampled in its sample (> 0 when resumed)
    params: SampleParams  # [j]
    adapter: np.ndarray  # [m] LoRA adapter slot of each prompt row (0 without several)


class DecodeBatch(NamedTuple):
    table: np.ndarray  # [b, P]
    token: np.ndarray  # [b] newest token, not yet fed
    pos: np.ndarray  # [b] where it is fed
    count: np.ndarray  # [b] tokens generated so far
    max_tokens: np.ndarray  # [b]
    stop_ids: np.ndarray  # [b, MAX_STOP_IDS], -1 padded
    live: np.ndarray  # [b] False on padding rows
    params: SampleParams  # [b]
    adapter: np.ndarray  # [b] LoRA adapter slot of each row (0 without several)


def _row_keys(params: SampleParams) -> jax.Array:
    """One stream per sample: fold_in(fold_in(key(seed_lo), seed_hi), sample index)."""
    def one(seed_2: jax.Array, index: jax.Array) -> jax.Array:
        key = jax.random.fold_in(jax.random.key(seed_2[0]), seed_2[1])
        return jax.random.fold_in(key, index)

    return jax.vmap(one)(params.seed, params.sample)


def _draw(logits_rv: jax.Array, row_keys: jax.Array, count_r: jax.Array, params: SampleParams,
          top: int) -> tuple[jax.Array, jax.Array, dict[str, jax.Array]]:
    """-> (token_r, logprob_r, extra): extra holds top_ids [r, top] and top_logprobs [r, top] when
    `top` (static) > 0, else nothing (the program is then `sample` alone)."""
    # The step key depends only on the token's index in its sample: chunking and batching
    # never change which random numbers a sample sees.
    keys = jax.vmap(jax.random.fold_in)(row_keys, count_r.astype(jnp.uint32))
    knobs = {"temperature": params.temperature, "top_k": params.top_k, "top_p": params.top_p, "min_p": params.min_p}
    if not top:
        return *sample(logits_rv, keys, **knobs), {}
    token, logprob, top_ids, top_logprobs = sample_with_top(logits_rv, keys, top=top, **knobs)
    return token, logprob, {"top_ids": top_ids, "top_logprobs": top_logprobs}


def _keep_layout(cache: KVCache | KernelPool, sharding: KVCache | KernelPool | None) -> KVCache | KernelPool:
    # On a mesh the cache leaves every program sharded as it came in: the next call then
    # finds the layout it was compiled for, and the donated buffers are reused.
    return cache if sharding is None else jax.lax.with_sharding_constraint(cache, sharding)


def _records_experts(model) -> bool:  # noqa: ANN001 (the merged Transformer)
    """Static: the programs of a model with routed experts also return the experts chosen at each
    sampled token's predicting position (routing replay); a dense model's programs are unchanged."""
    return routing_shape(model.cfg) is not None


def _prefill(graphdef: nnx.GraphDef, window: int, span: int, sharding: KVCache | None, state: nnx.State,
             cache: KVCache, batch: PrefillBatch, top: int = 0) -> tuple[KVCache, tuple]:
    """-> (cache, (token_j, logprob_j, extra)): extra, named as `Emitted`'s fields, holds experts_jlk
    for a model with routed experts, chosen at each row's last real token (the position the
    sample's token is drawn from), and top_ids_jk / top_logprobs_jk when `top` > 0."""
    model = select_adapters(nnx.merge(graphdef, state), batch.adapter)
    win = gather_pages(cache, batch.src_table, window)
    if _records_experts(model):
        logits_mv, win, experts_mlk = model.prefill(batch.tokens, batch.lengths, win, start_b=batch.starts,
                                                    with_experts=True)
    else:
        (logits_mv, win), experts_mlk = model.prefill(batch.tokens, batch.lengths, win, start_b=batch.starts), None
    first_page = batch.starts // cache.length
    cache = write_prefill(cache, win, batch.src_table, batch.dst_table, batch.src_row, first_page, span)
    token, logprob, extra = _draw(logits_mv[batch.src_row], _row_keys(batch.params), batch.count, batch.params, top)
    if experts_mlk is not None:
        extra["experts"] = experts_mlk[batch.src_row]
    return _keep_layout(cache, sharding), (token, logprob, extra)


def _decode(graphdef: nnx.GraphDef, steps: int, window: int, sharding: KVCache | None, state: nnx.State,
            cache: KVCache, batch: DecodeBatch, top: int = 0) -> tuple[KVCache, tuple]:
    """-> (cache, (token_kb, logprob_kb, emitted_kb, extra)): per step; extra, named as `Emitted`'s
    fields, holds experts_kblk for a model with routed experts, chosen at the fed token (the
    position the step's token is drawn from), and top_ids_kbn / top_logprobs_kbn when `top` > 0."""
    model = select_adapters(nnx.merge(graphdef, state), batch.adapter)
    win = gather_pages(cache, batch.table, window)  # read-only in the loop: valid below batch.pos
    records = _records_experts(model)

    def forward(buf: KVCache, token: jax.Array, pos: jax.Array, i: jax.Array) -> tuple:
        out = model.decode_step_buffered(token, pos, batch.pos, win, buf, i, with_experts=records)
        return out[0], out[1], out[2] if records else None

    buf = init_cache(model.cfg, batch=batch.table.shape[0], length=steps)
    buf, out = _decode_loop(batch, steps, top, buf, forward)
    return _keep_layout(write_positions(cache, buf, batch.table, batch.pos), sharding), out


def _decode_paged(graphdef: nnx.GraphDef, steps: int, kernel: PagedKernel, sharding: KernelPool | None,
                  state: nnx.State, pool: KernelPool, batch: DecodeBatch, top: int = 0) -> tuple[KernelPool, tuple]:
    """`_decode` against the pages in place (inference.attention_kernel: pallas): every step writes
    its token's keys/values into the row's page and attends the row's pages with the paged
    attention `kernel` (arlo/model/paged_attention.py); no window, no buffer, no write-back."""
    model = select_adapters(nnx.merge(graphdef, state), batch.adapter)
    records = _records_experts(model)

    def forward(pool: KernelPool, token: jax.Array, pos: jax.Array, i: jax.Array) -> tuple:
        out = model.decode_step_paged(token, pos, pool, batch.table, kernel=kernel, with_experts=records)
        return out[0], out[1], out[2] if records else None

    pool, out = _decode_loop(batch, steps, top, pool, forward)
    return _keep_layout(pool, sharding), out


def _decode_loop(batch: DecodeBatch, steps: int, top: int, kv: Any, forward: Any) -> tuple[Any, tuple]:
    """The chunk's lax.scan: `forward(kv, token_b, pos_b, i) -> (logits_bv, kv, experts or None)`
    feeds one token per row; sampling, stop ids and max tokens run here. -> (kv, per-step out)."""
    row_keys = _row_keys(batch.params)

    def step(carry: tuple, i: jax.Array) -> tuple[tuple, tuple[jax.Array, ...]]:
        kv, token, pos, count, stopped = carry
        active = batch.live & ~stopped & (count < batch.max_tokens)
        # Finished rows still run (the batch is static); what they write lands past their end.
        logits, kv, experts = forward(kv, token, pos, i)
        new, logprob, extra = _draw(logits, row_keys, count, batch.params, top)
        if experts is not None:
            extra["experts"] = experts
        hit = jnp.any(new[:, None] == batch.stop_ids, axis=1)
        token = jnp.where(active, new, token)
        return (kv, token, pos + active, count + active, stopped | (active & hit)), (new, logprob, active, extra)

    start = (kv, batch.token, batch.pos, batch.count, jnp.zeros_like(batch.live))
    (kv, *_), out = jax.lax.scan(step, start, jnp.arange(steps, dtype=jnp.int32))
    return kv, out


def decode_kernel(setting: str, cfg: ModelConfig, mesh: Mesh | None, platform: str = "") -> PagedKernel | None:
    """The paged-attention kernel `inference.attention_kernel` asks for on this device and mesh, or
    None (gather); a model or mesh the kernels cannot serve is refused by name. `platform`: the
    device's (default: JAX's first device)."""
    if setting == "xla":
        return None
    if setting != "pallas":
        raise ValueError(f"inference.attention_kernel: {setting!r} is not one of 'xla', 'pallas'")
    if any(cfg.is_sliding(i) for i in range(cfg.num_layers)):
        raise ValueError("inference.attention_kernel: 'pallas' has no sliding window, and this model has "
                         "sliding-window layers (model.layer_types); use 'xla'")
    name = kernel_for(platform or jax.devices()[0].platform)
    if name == "tpu" and cfg.head_dim % 128:
        raise ValueError(f"inference.attention_kernel: 'pallas' on a TPU needs a head_dim that is a multiple of "
                         f"128 (Mosaic's block), and this model's is {cfg.head_dim}; use 'xla'")
    if mesh is None:
        return PagedKernel(name)
    spread = {a: mesh.shape[a] for a in BATCH_AXES if mesh.shape.get(a, 1) > 1}
    if spread:
        raise ValueError(f"inference.attention_kernel: 'pallas' reads a row's pages on one device, and "
                         f"inference.mesh spreads pages over {spread}; use a mesh of tensor alone, or 'xla'")
    return PagedKernel(name, mesh=mesh, heads_axis=kernel_heads_axis(cfg, mesh))


# Module-level so every engine over the same graphdef shares the compiled programs.
# `top` is a static keyword: callers that leave it out (memory_plan's K = 0) lower the plain programs.
prefill_jit = jax.jit(_prefill, static_argnums=(0, 1, 2, 3), static_argnames=("top",), donate_argnums=(5,))
decode_jit = jax.jit(_decode, static_argnums=(0, 1, 2, 3), static_argnames=("top",), donate_argnums=(5,))
decode_paged_jit = jax.jit(_decode_paged, static_argnums=(0, 1, 2, 3), static_argnames=("top",), donate_argnums=(5,))
