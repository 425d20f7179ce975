"""The paged KV pool on the device: fixed-size pages, read and written through page tables.

Per layer, keys are [pages, kv_heads, head_dim, page_size] and values [pages, kv_heads,
page_size, head_dim]: a page is a run of `page_size` positions in `kv_cache.py`'s layout, so a
gather of a row's pages by its page table, flattened, is exactly the dense window the model's
prefill and chunked decode already read (`gather_pages`). That is the pure-JAX path: it runs on
every platform, and costs one copy of the window per program, as the dense cache's row gather
did. Page 0 is the null page (services/inference/pages.py): table entries past a sequence's
pages point at it, and the writes that land there are never read.

Writes go back page by page (`write_prefill`: the pages a prefill chunk covers, into the table
of every sample that reads the row) or position by position (`write_positions`: a decode
chunk's band). A shared page is only ever written with the same values by every sample that
holds it (they share one prompt row), so duplicate indices in one scatter are harmless.

`KernelPool` is the same pool in the layout JAX's Pallas paged-attention kernels read (keys and
values both [kv_heads, pages, page_size, head_dim], `inference.attention_kernel: pallas`): every
function here takes either, and `gather_pages` returns the dense window layout from both, so
prefill is one code path. Its decode writes each token as it goes (`write_token`) and attends
the pages in place (arlo/model/paged_attention.py).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from arlo.model.config import ModelConfig
from arlo.model.kv_cache import KVCache, cache_shapes, cache_shardings, init_cache


class KernelPool(NamedTuple):
    """The pool as the Pallas kernels read it: per layer, keys and values [kv, pages, page, h]."""

    k: tuple[jax.Array, ...]
    v: tuple[jax.Array, ...]

    @property
    def length(self) -> int:
        """Positions per page (a KVCache pool's `length` is its page size too)."""
        return self.k[0].shape[2]

    def nbytes(self) -> int:
        return sum(x.size * x.dtype.itemsize for x in (*self.k, *self.v))


Pool = KVCache | KernelPool


def pool_shapes(cfg: ModelConfig, *, pages: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(one layer's key pages shape, one layer's value pages shape)."""
    return cache_shapes(cfg, batch=pages, length=page_size)


def init_pool(cfg: ModelConfig, *, pages: int, page_size: int, dtype: jnp.dtype | None = None,
              kernel_layout: bool = False) -> Pool:
    """Zeros: `pages` rows of `page_size` positions (a KVCache whose batch axis is the page), or
    with `kernel_layout` a KernelPool of the same pages."""
    if not kernel_layout:
        return init_cache(cfg, batch=pages, length=page_size, dtype=dtype)
    shape = (cfg.num_kv_heads, pages, page_size, cfg.head_dim)
    dt = cfg.compute_dtype if dtype is None else dtype
    return KernelPool(k=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)),
                      v=tuple(jnp.zeros(shape, dt) for _ in range(cfg.num_layers)))


def pool_shardings(cfg: ModelConfig, mesh: Mesh, *, pages: int, page_size: int, kernel_layout: bool = False) -> Pool:
    """Pages over the data-parallel axes, kv heads over `tensor`, each only where it divides; a
    KernelPool's kv heads alone (`kernel_heads_axis`: its mesh has no data axes to split)."""
    if not kernel_layout:
        return cache_shardings(cfg, mesh, batch=pages, length=page_size)
    one = NamedSharding(mesh, PartitionSpec(kernel_heads_axis(cfg, mesh)))
    return KernelPool(k=(one,) * cfg.num_layers, v=(one,) * cfg.num_layers)


def kernel_heads_axis(cfg: ModelConfig, mesh: Mesh) -> str | None:
    """The mesh axis a KernelPool's kv heads split over: `tensor` where it divides them, else None."""
    ways = mesh.shape.get("tensor", 1)
    return "tensor" if ways > 1 and cfg.num_kv_heads % ways == 0 else None


def table_pages(window: int, page_size: int) -> int:
    """Pages a window of `window` positions spans."""
    return -(-window // page_size)


def _gather_full(pool: Pool, tables_rp: jax.Array) -> KVCache:
    """Rows' whole pages in table order: [r, kv, h, P * page] keys, [r, kv, P * page, h] values."""
    if isinstance(pool, KernelPool):  # x[:, tables] is [kv, r, p, page, h]
        (r, p), (kv, _, page, h) = tables_rp.shape, pool.k[0].shape
        return KVCache(k=tuple(jnp.transpose(x[:, tables_rp], (1, 0, 4, 2, 3)).reshape(r, kv, h, p * page)
                               for x in pool.k),
                       v=tuple(jnp.transpose(x[:, tables_rp], (1, 0, 2, 3, 4)).reshape(r, kv, p * page, h)
                               for x in pool.v))

    def keys(x: jax.Array) -> jax.Array:
        g = x[tables_rp]  # r p k h s
        r, p, k, h, s = g.shape
        return jnp.transpose(g, (0, 2, 3, 1, 4)).reshape(r, k, h, p * s)

    def values(x: jax.Array) -> jax.Array:
        g = x[tables_rp]  # r p k s h
        r, p, k, s, h = g.shape
        return jnp.transpose(g, (0, 2, 1, 3, 4)).reshape(r, k, p * s, h)

    return KVCache(k=tuple(keys(x) for x in pool.k), v=tuple(values(x) for x in pool.v))


def gather_pages(pool: Pool, tables_rp: jax.Array, window: int) -> KVCache:
    """The dense window [0, window) of each row, read through its page table (a copy)."""
    page = pool.length
    full = _gather_full(pool, tables_rp[:, : table_pages(window, page)])
    return KVCache(k=tuple(x[..., :window] for x in full.k), v=tuple(x[:, :, :window] for x in full.v))


def write_prefill(pool: Pool, win: KVCache, src_tables_rp: jax.Array, dst_tables_jp: jax.Array,
                  src_row_j: jax.Array, first_page_r: jax.Array, span: int) -> Pool:
    """Writes pages first_page_r[r] .. + span of each window row r (a prefill's chunk, `win` as
    the model left it) into the pages of every sample j that reads row src_row_j[j].

    The window may end inside a page: the rest of that page is read back from the pool through
    the row's own table first, so a page is always written whole. Callers guarantee
    (first_page + span) * page_size covers no more than the window's pages.
    """
    page, w = pool.length, win.length
    pages_w = table_pages(w, page)
    tail = _gather_full(pool, src_tables_rp[:, :pages_w])  # the positions past the window, unchanged
    first_j = first_page_r[src_row_j]
    dst_jn = jnp.take_along_axis(dst_tables_jp, first_j[:, None] + jnp.arange(span, dtype=jnp.int32)[None], axis=1)

    def pages_of(x_rkhs: jax.Array, t_rkhs: jax.Array) -> jax.Array:  # keys [r, k, h, w]
        full = jnp.concatenate([x_rkhs, t_rkhs[..., w:]], axis=-1)
        r, k, h, _ = full.shape
        paged = jnp.transpose(full.reshape(r, k, h, pages_w, page), (0, 3, 1, 2, 4))  # r p k h s
        return jax.vmap(lambda rows, f: jax.lax.dynamic_slice_in_dim(rows, f, span, 0))(paged[src_row_j], first_j)

    def value_pages_of(x_rksh: jax.Array, t_rksh: jax.Array) -> jax.Array:  # values [r, k, w, h]
        full = jnp.concatenate([x_rksh, t_rksh[:, :, w:]], axis=2)
        r, k, _, h = full.shape
        paged = jnp.transpose(full.reshape(r, k, pages_w, page, h), (0, 2, 1, 3, 4))  # r p k s h
        return jax.vmap(lambda rows, f: jax.lax.dynamic_slice_in_dim(rows, f, span, 0))(paged[src_row_j], first_j)

    ids = dst_jn.reshape(-1)
    kernel = isinstance(pool, KernelPool)

    def put(p: jax.Array, pages_n: jax.Array, order: tuple[int, ...]) -> jax.Array:
        pages_n = pages_n.astype(p.dtype)  # [n, kv, h, page] keys, [n, kv, page, h] values
        return p.at[:, ids].set(jnp.transpose(pages_n, order)) if kernel else p.at[ids].set(pages_n)

    k = tuple(put(p, pages_of(x, t).reshape(-1, *x.shape[1:3], page), (1, 0, 3, 2))
              for p, x, t in zip(pool.k, win.k, tail.k, strict=True))
    v = tuple(put(p, value_pages_of(x, t).reshape(-1, x.shape[1], page, x.shape[3]), (1, 0, 2, 3))
              for p, x, t in zip(pool.v, win.v, tail.v, strict=True))
    return type(pool)(k=k, v=v)


def write_token(k_pages: jax.Array, v_pages: jax.Array, k_bkh: jax.Array, v_bkh: jax.Array, tables_bp: jax.Array,
                pos_b: jax.Array) -> tuple[jax.Array, jax.Array]:
    """One KernelPool layer with row b's key/value written at position pos_b[b] of its pages
    (a decode step's own token; callers keep pos_b within the table's reach)."""
    page = k_pages.shape[2]
    ids = jnp.take_along_axis(tables_bp, (pos_b // page)[:, None], axis=1)[:, 0]
    offs = pos_b % page
    # Advanced indices (ids, offs) side by side: their dim replaces them in place -> [kv, b, h].
    return (k_pages.at[:, ids, offs].set(jnp.transpose(k_bkh, (1, 0, 2)).astype(k_pages.dtype)),
            v_pages.at[:, ids, offs].set(jnp.transpose(v_bkh, (1, 0, 2)).astype(v_pages.dtype)))


def write_positions(pool: KVCache, buf: KVCache, tables_rp: jax.Array, start_r: jax.Array) -> KVCache:
    """Writes the `buf.length` positions of buffer row r at positions start_r[r].. of row r's pages
    (a decode chunk's own keys/values). Callers keep the positions within the table's reach and
    point the entries a row does not hold at the null page."""
    page = pool.length
    cols = start_r[:, None] + jnp.arange(buf.length, dtype=jnp.int32)  # [r, steps]
    ids = jnp.take_along_axis(tables_rp, cols // page, axis=1)
    offs = cols % page
    # Advanced indices (ids, offs) split by slices: their dims come first -> [r, steps, k, h].
    return KVCache(k=tuple(c.at[ids, :, :, offs].set(jnp.transpose(x, (0, 3, 1, 2)).astype(c.dtype))
                           for c, x in zip(pool.k, buf.k, strict=True)),
                   v=tuple(c.at[ids, :, offs].set(jnp.transpose(x, (0, 2, 1, 3)).astype(c.dtype))
                           for c, x in zip(pool.v, buf.v, strict=True)))
