"""Transformer: shapes, causality, KV-cache path vs full forward, config presets.

Model calls go through jitted functional wrappers (split once, merge inside jit), as
production code does; eager op-by-op dispatch would dominate the test time on CPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import KVCache, ModelConfig, RopeScaling, abstract_model, create_model, init_cache

CFG = ModelConfig.named("tiny")
# Every optional family feature at once: Qwen2 biases, Qwen3 q/k norm and free head_dim, yarn RoPE.
FAMILY_CFG = dataclasses.replace(CFG, head_dim=8, qkv_bias=True, o_bias=True, qk_norm=True,
                                 rope_scaling=RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=8))
Split = tuple[nnx.GraphDef, nnx.State]


@pytest.fixture(scope="module")
def split() -> Split:
    return nnx.split(create_model(CFG, seed=0))


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(tokens_bt)


@functools.partial(jax.jit, static_argnums=0)
def _prefill(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array, lengths_b: jax.Array,
             cache: KVCache, start_b: jax.Array) -> tuple[jax.Array, KVCache]:
    return nnx.merge(graphdef, state).prefill(tokens_bt, lengths_b, cache, start_b=start_b)


@functools.partial(jax.jit, static_argnums=0)
def _decode(graphdef: nnx.GraphDef, state: nnx.State, tokens_b: jax.Array, positions_b: jax.Array,
            cache: KVCache) -> tuple[jax.Array, KVCache]:
    return nnx.merge(graphdef, state).decode_step(tokens_b, positions_b, cache)


def _tokens(b: int, t: int, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.key(seed), (b, t), 0, 256, dtype=jnp.int32)


def _close(a: jax.Array, b: jax.Array) -> None:
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-4, rtol=1e-4)


def test_forward_shape_and_dtype(split: Split) -> None:
    logits_btv = _forward(*split, _tokens(2, 12))
    assert logits_btv.shape == (2, 12, CFG.vocab_size)
    assert logits_btv.dtype == jnp.float32
    assert bool(jnp.all(jnp.isfinite(logits_btv)))


def test_causal(split: Split) -> None:
    tokens = _tokens(2, 12)
    changed = tokens.at[:, 8].set((tokens[:, 8] + 1) % 256)
    a, b = _forward(*split, tokens), _forward(*split, changed)
    np.testing.assert_array_equal(np.asarray(a[:, :8]), np.asarray(b[:, :8]))
    assert not np.allclose(np.asarray(a[:, 8:]), np.asarray(b[:, 8:]))


def test_num_params_matches_model() -> None:
    for cfg in (CFG, dataclasses.replace(CFG, tie_embeddings=False), FAMILY_CFG):
        state = nnx.state(nnx.eval_shape(lambda cfg=cfg: create_model(cfg, seed=0)))
        assert sum(x.size for x in jax.tree.leaves(state)) == cfg.num_params()
    assert 10_000_000 < ModelConfig.named("small").num_params() < 100_000_000


def test_qwen2_4m_preset_is_qwen2_shaped_and_about_4m_parameters() -> None:
    # bench/grpo_tiny.py's `4m` workload compares against a peer's Qwen2-shaped ~4M policy.
    cfg = ModelConfig.named("qwen2-4m")
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm  # Qwen2: q/k/v biases, no q/k norm
    assert cfg.num_kv_heads < cfg.num_heads and cfg.vocab_size == 264  # grouped KV; the byte tokenizer's ids
    assert abs(cfg.num_params() - 4_000_000) <= 400_000
    state = nnx.state(abstract_model(cfg))
    assert sum(x.size for x in jax.tree.leaves(state)) == cfg.num_params()


def test_named_unknown_lists_known() -> None:
    with pytest.raises(ValueError, match="tiny"):
        ModelConfig.named("huge")


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_kv_heads"):
        dataclasses.replace(CFG, num_kv_heads=3)
    with pytest.raises(ValueError, match="dtype"):
        dataclasses.replace(CFG, dtype="float16x")


def test_create_model_deterministic(split: Split) -> None:
    same = nnx.state(create_model(CFG, seed=0))
    other = nnx.state(create_model(CFG, seed=1))
    for a, b in zip(jax.tree.leaves(split[1]), jax.tree.leaves(same), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    table = split[1]["embedder"]["table_vd"].get_value()
    assert not np.array_equal(np.asarray(table), np.asarray(other["embedder"]["table_vd"].get_value()))


def test_params_carry_logical_axes(split: Split) -> None:
    specs = nnx.get_partition_spec(split[1])
    assert tuple(specs["embedder"]["table_vd"].get_value()) == ("vocab", "embed")
    assert tuple(specs["layers"][0]["attn"]["k_dkh"].get_value()) == ("embed", "kv_heads", "kv")
    assert tuple(specs["layers"][1]["mlp"]["down_fd"].get_value()) == ("mlp", "embed")


def _random_state(cfg: ModelConfig) -> nnx.State:
    # numpy instead of create_model: eager JAX init compiles every op per new shape (tens of
    # seconds on a loaded CPU). Every parameter random, biases and norm scales included.
    rng = np.random.default_rng(0)
    abstract = nnx.state(abstract_model(cfg))
    return jax.tree.map(lambda x: jnp.asarray(
        (1.0 if len(x.shape) == 1 else 0.0) + rng.normal(0.0, 0.1 if len(x.shape) == 1 else 0.3, x.shape),
        jnp.float32), abstract)


@pytest.fixture(scope="module")
def family_split() -> Split:
    return nnx.split(abstract_model(FAMILY_CFG))[0], _random_state(FAMILY_CFG)


def test_family_features_params_and_axes(family_split: Split) -> None:
    attn = family_split[1]["layers"][0]["attn"]
    assert attn["q_bias_nh"].shape == (4, 8) and attn["k_bias_kh"].shape == (2, 8)
    assert attn["o_bias_d"].shape == (64,) and attn["q_norm"]["scale"].shape == (8,)
    specs = nnx.get_partition_spec(family_split[1])["layers"][0]["attn"]
    assert tuple(specs["q_bias_nh"].get_value()) == ("heads", "kv")
    assert tuple(specs["v_bias_kh"].get_value()) == ("kv_heads", "kv")
    assert "q_bias_nh" not in nnx.state(abstract_model(CFG))["layers"][0]["attn"]  # presets unchanged


@functools.partial(jax.jit, static_argnums=(0, 3))
def _hidden(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array, remat: str) -> jax.Array:
    return nnx.merge(graphdef, state).hidden(tokens_bt, remat=remat)


def test_family_features_remat_matches(family_split: Split) -> None:
    tokens = _tokens(2, 12, seed=4)
    _close(_hidden(*family_split, tokens, "full"), _hidden(*family_split, tokens, "none"))


@pytest.mark.parametrize("which", ["tiny", "family"])
def test_decode_steps_match_full_forward(split: Split, family_split: Split, which: str) -> None:
    split, cfg = (split, CFG) if which == "tiny" else (family_split, FAMILY_CFG)
    tokens = _tokens(2, 12, seed=1)
    full_btv = _forward(*split, tokens)
    cache = init_cache(cfg, batch=2, length=16)
    zeros = jnp.zeros((2,), jnp.int32)
    logits_bv, cache = _prefill(*split, tokens[:, :4], jnp.array([4, 4]), cache, zeros)
    _close(logits_bv, full_btv[:, 3])
    for pos in range(4, 12):
        logits_bv, cache = _decode(*split, tokens[:, pos], jnp.array([pos, pos]), cache)
        _close(logits_bv, full_btv[:, pos])


def test_rows_at_different_positions(split: Split) -> None:
    """Right-padded prompts of different lengths, then per-row decode positions (the
    continuous-batching case)."""
    tokens = _tokens(2, 12, seed=2)
    lengths = jnp.array([5, 9])
    padded = jnp.where(jnp.arange(12)[None] < lengths[:, None], tokens, 0)
    cache = init_cache(CFG, batch=2, length=16)
    logits_bv, cache = _prefill(*split, padded, lengths, cache, jnp.zeros((2,), jnp.int32))
    step_bv, _ = _decode(*split, tokens[:, 11], lengths, cache)
    # Reference: each row alone, its prompt followed by tokens[:, 11], right-padded to 12.
    for row in range(2):
        n = int(lengths[row])
        seq = jnp.zeros((1, 12), jnp.int32).at[0, :n].set(tokens[row, :n]).at[0, n].set(tokens[row, 11])
        ref_tv = _forward(*split, seq)[0]
        _close(logits_bv[row], ref_tv[n - 1])
        _close(step_bv[row], ref_tv[n])


def test_chunked_prefill_with_start(split: Split) -> None:
    tokens = _tokens(2, 12, seed=3)
    cache = init_cache(CFG, batch=2, length=16)
    _, cache = _prefill(*split, tokens[:, :4], jnp.array([4, 4]), cache, jnp.zeros((2,), jnp.int32))
    chunk = jnp.pad(tokens[:, 4:], ((0, 0), (0, 4)))  # 8 real tokens, right-padded like a bucket
    logits_bv, _ = _prefill(*split, chunk[:, :4], jnp.array([4, 4]), cache, jnp.array([4, 4]))
    _close(logits_bv, _forward(*split, tokens)[:, 7])


def test_bfloat16_compute_keeps_float32_params(split: Split) -> None:
    cfg = dataclasses.replace(CFG, dtype="bfloat16")
    graphdef_bf16 = nnx.split(nnx.eval_shape(lambda: create_model(cfg, seed=0)))[0]
    tokens = _tokens(2, 12)
    # Same float32 weights, bf16 matmuls: close to, not equal to, the float32 model.
    logits = _forward(graphdef_bf16, split[1], tokens)
    assert logits.dtype == jnp.float32
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(split[1]))
    assert float(jnp.max(jnp.abs(logits - _forward(*split, tokens)))) < 0.3
