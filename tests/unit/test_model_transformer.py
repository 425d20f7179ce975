"""Transformer: shapes, causality, KV-cache path vs full forward, config presets."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import ModelConfig, Transformer, create_model, init_cache

CFG = ModelConfig.named("tiny")


@pytest.fixture(scope="module")
def model() -> Transformer:
    return create_model(CFG, seed=0)


def _tokens(b: int, t: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (b, t), 0, 256, dtype=jnp.int32)


def test_forward_shape_and_dtype(model: Transformer) -> None:
    logits_btv = model(_tokens(2, 7))
    assert logits_btv.shape == (2, 7, CFG.vocab_size)
    assert logits_btv.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits_btv)))


def test_causal(model: Transformer) -> None:
    tokens = _tokens(1, 12)
    changed = tokens.at[0, 8].set((tokens[0, 8] + 1) % 256)
    a, b = model(tokens), model(changed)
    np.testing.assert_array_equal(np.asarray(a[:, :8]), np.asarray(b[:, :8]))
    assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


def test_num_params_matches_model() -> None:
    for cfg in (CFG, dataclasses.replace(CFG, tie_embeddings=False)):
        _, state = nnx.split(create_model(cfg, seed=0))
        assert sum(x.size for x in jax.tree.leaves(state)) == cfg.num_params()
    assert 10_000_000 < ModelConfig.named("small").num_params() < 100_000_000


def test_named_unknown_lists_known() -> None:
    with pytest.raises(ValueError, match="tiny"):
        ModelConfig.named("huge")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(CFG, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(CFG, dtype="float16x")


def test_create_model_deterministic() -> None:
    s0 = nnx.split(create_model(CFG, seed=3))[1]
    s1 = nnx.split(create_model(CFG, seed=3))[1]
    s2 = nnx.split(create_model(CFG, seed=4))[1]
    for a, b in zip(jax.tree.leaves(s0), jax.tree.leaves(s1), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(s0["embedder"]["table_vd"][...]),
                              np.asarray(s2["embedder"]["table_vd"][...]))


def test_params_carry_logical_axes(model: Transformer) -> None:
    specs = nnx.get_partition_spec(nnx.state(model))
    assert tuple(specs["embedder"]["table_vd"][...]) == ("vocab", "embed")
    assert tuple(specs["layers"][0]["attn"]["k_dkh"][...]) == ("embed", "kv_heads", "kv")
    assert tuple(specs["layers"][1]["mlp"]["down_fd"][...]) == ("mlp", "embed")


def test_decode_steps_match_full_forward(model: Transformer) -> None:
    tokens = _tokens(2, 10, seed=1)
    full_btv = model(tokens)
    cache = init_cache(CFG, batch=2, length=16)
    logits_bv, cache = model.prefill(tokens[:, :3], jnp.array([3, 3]), cache)
    np.testing.assert_allclose(logits_bv, full_btv[:, 2], atol=1e-4, rtol=1e-4)
    for pos in range(3, 10):
        logits_bv, cache = model.decode_step(tokens[:, pos], jnp.array([pos, pos]), cache)
        np.testing.assert_allclose(logits_bv, full_btv[:, pos], atol=1e-4, rtol=1e-4)


def test_rows_at_different_positions(model: Transformer) -> None:
    """Right-padded prompts of different lengths, then per-row decode positions (the
    continuous-batching case)."""
    tokens = _tokens(2, 9, seed=2)
    lengths = np.array([4, 7])
    padded = jnp.where(jnp.arange(9)[None] < lengths[:, None], tokens, 0)
    cache = init_cache(CFG, batch=2, length=16)
    logits_bv, cache = model.prefill(padded, jnp.asarray(lengths), cache)
    next_b = jnp.array([5, 6], jnp.int32)
    step_bv, _ = model.decode_step(next_b, jnp.asarray(lengths), cache)
    for row, n in enumerate(lengths):
        seq = jnp.concatenate([tokens[row, :n], next_b[row : row + 1]])[None]
        ref = model(seq)[0]
        np.testing.assert_allclose(logits_bv[row], ref[n - 1], atol=1e-4, rtol=1e-4)
        np.testing.assert_allclose(step_bv[row], ref[n], atol=1e-4, rtol=1e-4)


def test_chunked_prefill_with_start(model: Transformer) -> None:
    tokens = _tokens(1, 8, seed=3)
    cache = init_cache(CFG, batch=1, length=8)
    _, cache = model.prefill(tokens[:, :5], jnp.array([5]), cache)
    logits_bv, _ = model.prefill(tokens[:, 5:], jnp.array([3]), cache, start_b=jnp.array([5]))
    np.testing.assert_allclose(logits_bv[0], model(tokens)[0, 7], atol=1e-4, rtol=1e-4)


def test_bfloat16_compute_keeps_float32_params() -> None:
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    model = create_model(cfg, seed=0)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.state(model)))
    logits = model(_tokens(1, 6))
    assert logits.dtype == jnp.float32
    ref = create_model(CFG, seed=0)(_tokens(1, 6))
    # bf16 matmuls: loosely equal to the float32 model with the same weights.
    assert float(jnp.max(jnp.abs(logits - ref))) < 0.3
