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
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from arlo.model.config import ModelConfig
from arlo.model.kv_cache import KVCache, cache_shapes, cache_shardings, init_cache


def pool_shapes(cfg: ModelConfig, *, pages: int, page_size: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(one layer's key pages shape, one layer's value pages shape)."""
    return cache_shapes(cfg, batch=pages, length=page_size)


def init_pool(cfg: ModelConfig, *, pages: int, page_size: int, dtype: jnp.dtype | None = None) -> KVCache:
    """Zeros: `pages` rows of `page_size` positions (a KVCache whose batch axis is the page)."""
    return init_cache(cfg, batch=pages, length=page_size, dtype=dtype)


def pool_shardings(cfg: ModelConfig, mesh: Mesh, *, pages: int, page_size: int) -> KVCache:
    """Pages over the data-parallel axes, kv heads over `tensor`, each only where it divides."""
    return cache_shardings(cfg, mesh, batch=pages, length=page_size)


def table_pages(window: int, page_size: int) -> int:
    """Pages a window of `window` positions spans."""
    return -(-window // page_size)


def _gather_full(pool: KVCache, tables_rp: jax.Array) -> KVCache:
    """Rows' whole pages in table order: [r, kv, h, P * page] keys, [r, kv, P * page, h] values."""
    def keys(x: jax.Array) -> jax.Array:
        g = x[tables_rp]  # r p k h s
        r, p, k, h, s = g.shape
        return jnp.transpose(g, (0, 2, 3, 1, 4)).reshape(r, k, h, p * s)

    def values(x: jax.Array) -> jax.Array:
        g = x[tables_rp]  # r p k s h
        r, p, k, s, h = g.shape
        return jnp.transpose(g, (0, 2, 1, 3, 4)).reshape(r, k, p * s, h)

    return KVCache(k=tuple(keys(x) for x in pool.k), v=tuple(values(x) for x in pool.v))


def gather_pages(pool: KVCache, tables_rp: jax.Array, window: int) -> KVCache:
    """The dense window [0, window) of each row, read through its page table (a copy)."""
    page = pool.length
    full = _gather_full(pool, tables_rp[:, : table_pages(window, page)])
    return KVCache(k=tuple(x[..., :window] for x in full.k), v=tuple(x[:, :, :window] for x in full.v))


def write_prefill(pool: KVCache, win: KVCache, src_tables_rp: jax.Array, dst_tables_jp: jax.Array,
                  src_row_j: jax.Array, first_page_r: jax.Array, span: int) -> KVCache:
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
    k = tuple(p.at[ids].set(pages_of(x, t).reshape(-1, *p.shape[1:]).astype(p.dtype))
              for p, x, t in zip(pool.k, win.k, tail.k, strict=True))
    v = tuple(p.at[ids].set(value_pages_of(x, t).reshape(-1, *p.shape[1:]).astype(p.dtype))
              for p, x, t in zip(pool.v, win.v, tail.v, strict=True))
    return KVCache(k=k, v=v)


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
