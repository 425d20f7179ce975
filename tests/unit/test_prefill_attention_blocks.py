"""A long prefill attends in query blocks (arlo/model/layers.py `_attend_parts_blocked`): a
4,096-token chunk of a 32k episode against its 18.8k-slot window formed [4,096 x group, 18.8k]
scores per kv head at once (issue 36). Blocks give the unblocked rows exactly, over a cache part
and a part of the chunk's own keys, with padded last blocks."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlo.model import layers


def parts(key: jax.Array, b: int, k: int, h: int, t: int, widths: tuple[int, ...]) -> list:
    out = []
    for i, s in enumerate(widths):
        kk, kv, km = jax.random.split(jax.random.fold_in(key, i), 3)
        mask = jax.random.bernoulli(km, 0.7, (b, t, s)).at[:, :, 0].set(True)  # every row sees a key
        out.append((jax.random.normal(kk, (b, k, h, s)), jax.random.normal(kv, (b, k, s, h)), mask))
    return out


@pytest.mark.parametrize("t", [8, 37])
def test_query_blocks_give_the_unblocked_attention(monkeypatch: pytest.MonkeyPatch, t: int) -> None:
    b, n, k, h = 2, 6, 2, 16
    q = jax.random.normal(jax.random.key(0), (b, t, n, h))
    ps = parts(jax.random.key(1), b, k, h, t, (29, t))
    whole = layers._attend_parts(q, ps, 0.25, 30.0)
    monkeypatch.setattr(layers, "PREFILL_QUERY_CHUNK", 8)
    blocked = layers._attend_parts_blocked(q, ps, 0.25, 30.0)
    assert blocked.shape == whole.shape
    np.testing.assert_allclose(np.asarray(blocked), np.asarray(whole), rtol=1e-5, atol=1e-6)


def test_a_32k_episodes_prefill_chunk_keeps_one_blocks_scores() -> None:
    """Compile only, Qwen2.5-0.5B's attention shape (14 heads, 2 kv heads, head 64): a 4,096-token
    chunk against an 18,816-slot window."""
    b, t, n, k, h, s = 1, 4096, 14, 2, 64, 18_816
    q = jax.ShapeDtypeStruct((b, t, n, h), jnp.bfloat16)
    ps = [(jax.ShapeDtypeStruct((b, k, h, s), jnp.bfloat16), jax.ShapeDtypeStruct((b, k, s, h), jnp.bfloat16),
           jax.ShapeDtypeStruct((b, t, s), jnp.bool_))]

    def temp_bytes(fn) -> int:
        return jax.jit(lambda q, ps: fn(q, ps, 0.125)).lower(q, ps).compile().memory_analysis().temp_size_in_bytes

    whole, blocked = temp_bytes(layers._attend_parts), temp_bytes(layers._attend_parts_blocked)
    print(f"\nprefill attention temporaries, 4,096 x 18,816: {whole / 2**30:.2f} GiB whole, "
          f"{blocked / 2**30:.2f} GiB in blocks of {layers.PREFILL_QUERY_CHUNK}")
    assert blocked < whole / 3
