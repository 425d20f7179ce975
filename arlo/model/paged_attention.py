"""Decode attention read straight from the paged KV pool: JAX's Pallas kernels, or their reference.

`inference.attention_kernel: pallas` decodes the vLLM way: each step writes its token's key and
value into the token's page (`paged_kv.write_token`), then one query per row attends over the
row's pages through its page table, with no dense window gathered. The kernels are the ones JAX
ships (`jax.experimental.pallas.ops`): Triton on a GPU, Mosaic on a TPU. Both read the pool as
[kv_heads, pages, page_size, head_dim] for keys and values alike (`paged_kv.KernelPool`), take
the query already scaled and apply the logit soft-cap themselves; neither has a sliding window,
so a model with sliding layers keeps the gather path (the engine says so at start).

On a mesh of `tensor` alone (inference tensor parallelism) the kernel runs under shard_map, each
device over its own kv heads and the query heads that read them (`PagedKernel.heads_axis`): a
pallas_call is not partitioned by XLA. A mesh that spreads pages over data axes is refused (a
row's pages would live on several devices).

On a CPU the GPU kernel runs in Pallas interpret mode: the same kernel body, evaluated by XLA,
so the tests check the kernel's indexing, masking and online softmax against `reference` here;
it is for tests, not speed. `reference` is the pure-JAX form (gather the pages, one softmax).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

GPU_K_SPLITS = 16
"""Partitions of a row's pages the GPU kernel spreads over thread blocks (its default)."""
PAGES_PER_BLOCK = 8
"""Pages one kernel iteration loads (both kernels' block of keys)."""
_MASK = -0.7 * float(jnp.finfo(jnp.float32).max)


@dataclass(frozen=True)
class PagedKernel:
    """Which kernel a decode step runs, and where: hashable, a static argument of the programs."""

    name: str
    """"gpu", "tpu", "interpret" (the GPU kernel on a CPU) or "reference" (`kernel_for`)."""
    mesh: Mesh | None = None
    """The inference mesh (tensor axis only); None on one device."""
    heads_axis: str | None = None
    """The mesh axis the kv heads (and the pool's first dim) are split over; None: replicated."""

    def attend(self, q_bnh: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables_bp: jax.Array,
               lengths_b: jax.Array, *, cap: float | None) -> jax.Array:
        """`attend_pages` with this kernel, per device on a mesh."""
        run = functools.partial(attend_pages, cap=cap, kernel=self.name)
        if self.mesh is None:
            return run(q_bnh, k_pages, v_pages, tables_bp, lengths_b)
        heads, pages = P(None, self.heads_axis, None), P(self.heads_axis, None, None, None)
        return jax.shard_map(run, mesh=self.mesh, in_specs=(heads, pages, pages, P(), P()), out_specs=heads,
                             check_vma=False)(q_bnh, k_pages, v_pages, tables_bp, lengths_b)


def kernel_for(platform: str) -> str:
    """The Pallas kernel a device platform runs: "tpu", "gpu", or "interpret" (the GPU kernel
    evaluated by XLA, on a CPU)."""
    return {"tpu": "tpu", "gpu": "gpu", "cuda": "gpu", "rocm": "gpu"}.get(platform, "interpret")


def attend_pages(q_bnh: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables_bp: jax.Array,
                 lengths_b: jax.Array, *, cap: float | None, kernel: str) -> jax.Array:
    """Each row's one query (scaled) over positions [0, lengths_b) of its pages -> [b, n, h].

    `k_pages`/`v_pages`: one layer of the pool, [kv_heads, pages, page_size, head_dim];
    `tables_bp` int32 [b, P]: entries at or past a row's length are never read (they may point
    at the null page). `kernel`: "reference", "gpu", "tpu" or "interpret"."""
    lengths_b = lengths_b.astype(jnp.int32)
    if kernel == "reference":
        return reference(q_bnh, k_pages, v_pages, tables_bp, lengths_b, cap=cap)
    if kernel == "tpu":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention

        tables_bp = _pad_pages(tables_bp, PAGES_PER_BLOCK)
        return paged_attention(q_bnh, k_pages, v_pages, lengths_b, tables_bp, attn_logits_soft_cap=cap,
                               pages_per_compute_block=min(PAGES_PER_BLOCK, tables_bp.shape[1]))
    from jax.experimental.pallas.ops.gpu.paged_attention import paged_attention

    splits, per_block = _gpu_blocks(tables_bp.shape[1])
    tables_bp = _pad_pages(tables_bp, splits * per_block)
    return paged_attention(q_bnh, k_pages, v_pages, tables_bp, lengths_b, k_splits=splits,
                           pages_per_compute_block=per_block, attn_logits_soft_cap=cap,
                           interpret=kernel == "interpret")


def _gpu_blocks(pages: int) -> tuple[int, int]:
    """(k_splits, pages_per_compute_block) for a table of `pages` entries: the kernel needs the
    table to split evenly into k_splits partitions of whole blocks (short tables use fewer), and
    Triton a power-of-two block of keys (page_size is one, so the pages per block are too)."""
    splits = min(GPU_K_SPLITS, pages)
    per_partition = -(-pages // splits)
    return splits, min(PAGES_PER_BLOCK, 1 << (per_partition - 1).bit_length())


def _pad_pages(tables_bp: jax.Array, multiple: int) -> jax.Array:
    """The table widened to a multiple of `multiple` entries (the added ones lie past every row's
    length, so the kernels never read them; they name the null page)."""
    extra = -tables_bp.shape[1] % multiple
    return jnp.pad(tables_bp, ((0, 0), (0, extra))) if extra else tables_bp


@functools.partial(jax.jit, static_argnames=("cap",))
def reference(q_bnh: jax.Array, k_pages: jax.Array, v_pages: jax.Array, tables_bp: jax.Array,
              lengths_b: jax.Array, *, cap: float | None) -> jax.Array:
    """`attend_pages` in plain JAX: the pages gathered in table order, one masked softmax in float32."""
    b, n, h = q_bnh.shape
    kv, _, page, _ = k_pages.shape
    s = tables_bp.shape[1] * page
    k_bksh = jnp.transpose(k_pages[:, tables_bp], (1, 0, 2, 3, 4)).reshape(b, kv, s, h)
    v_bksh = jnp.transpose(v_pages[:, tables_bp], (1, 0, 2, 3, 4)).reshape(b, kv, s, h)
    q_bkgh = q_bnh.reshape(b, kv, n // kv, h)
    scores = jnp.einsum("bkgh,bksh->bkgs", q_bkgh, k_bksh, preferred_element_type=jnp.float32)
    valid_bs = jnp.arange(s, dtype=jnp.int32)[None] < lengths_b[:, None]
    if cap is not None:  # layers.softcap (imported there from here would be a cycle)
        scores = jnp.tanh(scores / cap) * cap
    scores = jnp.where(valid_bs[:, None, None], scores, _MASK)
    probs = jax.nn.softmax(scores, axis=-1)
    out = jnp.einsum("bkgs,bksh->bkgh", probs, v_bksh.astype(jnp.float32))
    return out.reshape(b, n, h).astype(q_bnh.dtype)
