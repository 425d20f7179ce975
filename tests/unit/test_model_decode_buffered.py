"""The engine's chunked decode path (`decode_step_buffered` + `write_band`) against the full forward.

Rows sit at different positions (continuous batching): the read-only cache holds each
row's prompt, the chunk's own keys/values go to a small buffer, and the buffer written
back into the cache must leave it as a plain per-token decode would.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import KVCache, ModelConfig, create_model, init_cache
from arlo.model.kv_cache import write_band
from tests.unit.test_model_transformer import CFG, FAMILY_CFG, _forward, _prefill, _tokens

STEPS = 4


@functools.partial(jax.jit, static_argnums=0)
def _chunk(graphdef: nnx.GraphDef, state: nnx.State, tokens_bk: jax.Array, base_b: jax.Array,
           cache: KVCache) -> tuple[jax.Array, KVCache]:
    """Feeds tokens_bk[:, i] at base_b + i for i < STEPS; returns logits [STEPS, b, v] and the cache."""
    model = nnx.merge(graphdef, state)
    buf = init_cache(model.cfg, batch=tokens_bk.shape[0], length=STEPS)

    def step(buf: KVCache, i: jax.Array) -> tuple[KVCache, jax.Array]:
        logits_bv, buf = model.decode_step_buffered(tokens_bk[:, i], base_b + i, base_b, cache, buf, i)
        return buf, logits_bv

    buf, logits_kbv = jax.lax.scan(step, buf, jnp.arange(STEPS, dtype=jnp.int32))
    return logits_kbv, write_band(cache, buf, jnp.arange(tokens_bk.shape[0], dtype=jnp.int32), base_b)


@pytest.mark.parametrize("cfg", [CFG, FAMILY_CFG], ids=["tiny", "family"])
def test_buffered_chunks_match_full_forward(cfg: ModelConfig) -> None:
    split = nnx.split(create_model(cfg, seed=0))
    tokens = _tokens(2, 14, seed=4)
    lengths = jnp.array([3, 6], jnp.int32)
    padded = jnp.where(jnp.arange(14)[None] < lengths[:, None], tokens, 0)
    cache = init_cache(cfg, batch=2, length=16)
    _, cache = _prefill(*split, padded, lengths, cache, jnp.zeros((2,), jnp.int32))
    refs = [_forward(*split, tokens[row: row + 1])[0] for row in range(2)]
    base = lengths
    for _ in range(2):  # two chunks: the second reads what the first wrote back
        cols = base[:, None] + jnp.arange(STEPS)
        logits_kbv, cache = _chunk(*split, jnp.take_along_axis(tokens, cols, axis=1), base, cache)
        for row in range(2):
            want = refs[row][int(base[row]): int(base[row]) + STEPS]
            np.testing.assert_allclose(np.asarray(logits_kbv[:, row]), np.asarray(want), atol=1e-4, rtol=1e-4)
        base = base + STEPS
