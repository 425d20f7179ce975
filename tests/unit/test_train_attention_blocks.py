"""Training attention past TRAIN_CHUNKED_ABOVE tokens goes in query blocks (arlo/model/layers.py
`_attend_blocked`), so a 16k-token episode's step does not form [t, t] scores per head: the fault it
fixes is the `small` preset's RL step at 16,384 tokens needing 34.7 GiB of temporaries (8 GiB of
scores a layer), more than the host. The blocks give the dense path's hidden states and gradients."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import layers
from arlo.model.config import ModelConfig
from arlo.model.transformer import create_model


def grads_and_hidden(cfg: ModelConfig, tokens: jax.Array, **kw) -> tuple[np.ndarray, list[np.ndarray]]:
    graphdef, state = nnx.split(create_model(cfg, 0))

    def loss(state: nnx.State) -> tuple[jax.Array, jax.Array]:
        h = nnx.merge(graphdef, state).hidden(tokens, **kw)
        return (h.astype(jnp.float32) ** 2).mean(), h

    (_, h), g = jax.value_and_grad(loss, has_aux=True)(state)
    return np.asarray(h), [np.asarray(x) for x in jax.tree.leaves(g)]


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("remat", ["none", "full"])
def test_query_blocks_match_the_dense_attention(monkeypatch: pytest.MonkeyPatch, packed: bool, remat: str) -> None:
    cfg = dataclasses.replace(ModelConfig.named("tiny"), sliding_window=9)  # a window too: its mask is causal
    t = 37  # not a multiple of the block: the last block is padded
    tokens = jax.random.randint(jax.random.key(1), (2, t), 0, cfg.vocab_size)
    kw = {"remat": remat}
    if packed:
        seg = np.zeros((2, t), np.int32)
        seg[0, :20], seg[0, 20:33], seg[1, :37] = 1, 2, 1
        pos = np.concatenate([np.arange(20), np.arange(13), np.zeros(4, int)])
        kw |= {"segment_ids_bt": jnp.asarray(seg), "positions_bt": jnp.asarray(np.stack([pos, np.arange(t)]))}
    dense_h, dense_g = grads_and_hidden(cfg, tokens, **kw)
    monkeypatch.setattr(layers, "TRAIN_CHUNKED_ABOVE", 16)
    monkeypatch.setattr(layers, "TRAIN_QUERY_CHUNK", 8)
    block_h, block_g = grads_and_hidden(cfg, tokens, **kw)
    real = np.ones((2, t), bool) if not packed else np.asarray(kw["segment_ids_bt"]) > 0
    np.testing.assert_allclose(block_h[real], dense_h[real], rtol=1e-5, atol=1e-5)
    for a, b in zip(block_g, dense_g, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)


def test_a_16k_token_step_of_the_small_preset_fits_in_a_few_gib() -> None:
    """Compile only: temporaries of a forward and backward (remat full) of one 16,384-token row."""
    cfg = dataclasses.replace(ModelConfig.named("small"), max_seq_len=16_384)
    graphdef, state = nnx.split(nnx.eval_shape(lambda: create_model(cfg, 0)))

    def loss(state: nnx.State, tokens: jax.Array) -> jax.Array:
        return (nnx.merge(graphdef, state).hidden(tokens, remat="full") ** 2).mean()

    tokens = jax.ShapeDtypeStruct((1, 16_384), jnp.int32)
    compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
    temp_gib = compiled.memory_analysis().temp_size_in_bytes / 2**30
    assert temp_gib < 4, temp_gib  # measured 2.9 GiB (34.7 GiB with the [t, t] scores)
