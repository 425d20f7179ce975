"""HF config.json -> ModelConfig and safetensors loading, without torch: checkpoints are
written from our own random models through the inverse mapping (state_to_hf_tensors), single
file, sharded and bfloat16, and every malformed directory gives an error naming the file or
tensor. The numerical comparison against transformers is test_hf_reference.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import safetensors.flax
import safetensors.numpy
from flax import nnx

from arlo.model import ModelConfig, RopeScaling, abstract_model, load_hf_model
from arlo.model.hf import INDEX_FILE, state_to_hf_tensors


def _hf(model_type: str = "qwen3", **extra: Any) -> dict[str, Any]:
    base = dict(model_type=model_type, vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, rms_norm_eps=1e-6,
                hidden_act="silu", tie_word_embeddings=False, rope_theta=10000.0)
    return {**base, **extra}


def test_families_map_onto_config() -> None:
    llama = ModelConfig.from_hf_config(_hf("llama", rope_theta=500000.0, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}))
    assert (llama.head_dim, llama.qkv_bias, llama.o_bias, llama.qk_norm) == (8, False, False, False)
    assert llama.rope_theta == 500000.0 and llama.rope_scaling == RopeScaling(
        kind="llama3", factor=8.0, original_max_seq_len=8192, low_freq_factor=1.0, high_freq_factor=4.0)
    qwen2 = ModelConfig.from_hf_config(_hf("qwen2", tie_word_embeddings=True, rope_scaling={
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}))
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_embeddings) == (True, False, True)
    assert qwen2.rope_scaling == RopeScaling(kind="yarn", factor=4.0, original_max_seq_len=32768)
    # transformers 5 layout; Qwen3's head_dim is its own field.
    qwen3 = ModelConfig.from_hf_config(_hf(head_dim=16, attention_bias=True, rope_parameters={
        "rope_type": "default", "rope_theta": 1e6}), dtype="bfloat16", max_seq_len=64)
    assert (qwen3.head_dim, qwen3.qk_norm, qwen3.qkv_bias, qwen3.o_bias) == (16, True, True, True)
    assert (qwen3.rope_theta, qwen3.rope_scaling, qwen3.dtype, qwen3.max_seq_len) == (1e6, None, "bfloat16", 64)


@pytest.mark.parametrize(("extra", "match"), [
    (dict(model_type="mistral"), r"model_type.*'mistral'.*supported"),
    (dict(use_sliding_window=True), "use_sliding_window"),
    (dict(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 2.0}), r"rope_type.*'dynamic'"),
    (dict(hidden_act="gelu"), "hidden_act"),
    (dict(mlp_bias=True), "mlp_bias"),
    (dict(quantization_config={"quant_method": "gptq"}), "quantization_config"),
    (dict(vocab_size=None), "vocab_size"),
    (dict(num_key_value_heads=3), "num_kv_heads"),
])
def test_unsupported_or_bad_fields_are_named(extra: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ModelConfig.from_hf_config(_hf(**extra))


def _write(path: Path, hf: dict[str, Any], tensors: dict[str, np.ndarray], shards: int = 1) -> None:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf))
    if shards == 1:
        safetensors.numpy.save_file(tensors, str(path / "model.safetensors"))
        return
    names = sorted(tensors)
    weight_map = {}
    for i in range(shards):
        file = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = names[i::shards]
        safetensors.numpy.save_file({n: tensors[n] for n in part}, str(path / file))
        weight_map.update(dict.fromkeys(part, file))
    (path / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _random_state(cfg: ModelConfig, seed: int) -> nnx.State:
    # numpy, not create_model: eager JAX init compiles every op for every new shape (seconds on CPU).
    rng = np.random.default_rng(seed)
    abstract = nnx.state(abstract_model(cfg))
    return jax.tree.map(lambda x: jnp.asarray(rng.standard_normal(x.shape, np.float32)), abstract)


@pytest.fixture(scope="module")
def source() -> tuple[dict[str, Any], ModelConfig, nnx.State]:
    hf = _hf(head_dim=16, attention_bias=True)
    cfg = ModelConfig.from_hf_config(hf)
    return hf, cfg, _random_state(cfg, seed=3)


def _assert_same(a: nnx.State, b: nnx.State) -> None:
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.parametrize("shards", [1, 3])
def test_round_trip(tmp_path: Path, source: tuple[dict[str, Any], ModelConfig, nnx.State], shards: int) -> None:
    hf, cfg, state = source
    tensors = state_to_hf_tensors(state, cfg)
    assert tensors["model.layers.1.self_attn.q_proj.weight"].shape == (4 * 16, 32)  # HF [out, in]
    assert "model.layers.0.self_attn.k_norm.weight" in tensors and "lm_head.weight" in tensors
    _write(tmp_path, hf, tensors, shards)
    _assert_same(nnx.state(load_hf_model(tmp_path)), state)


def test_bfloat16_checkpoint_widens_to_float32(tmp_path: Path,
                                               source: tuple[dict[str, Any], ModelConfig, nnx.State]) -> None:
    hf, cfg, state = source
    tensors = {k: jnp.asarray(v, jnp.bfloat16) for k, v in state_to_hf_tensors(state, cfg).items()}
    tmp_path.mkdir(exist_ok=True)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    safetensors.flax.save_file(tensors, str(tmp_path / "model.safetensors"))
    loaded = nnx.state(load_hf_model(tmp_path))
    rounded = jax.tree.map(lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), state)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(loaded))
    _assert_same(loaded, rounded)


def test_tied_checkpoint_may_carry_lm_head(tmp_path: Path) -> None:
    hf = _hf("qwen2", tie_word_embeddings=True)
    cfg = ModelConfig.from_hf_config(hf)
    state = _random_state(cfg, seed=0)
    tensors = state_to_hf_tensors(state, cfg)
    assert "lm_head.weight" not in tensors
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].copy()
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = np.ones(4, np.float32)  # old HF buffers
    _write(tmp_path, hf, tensors)
    _assert_same(nnx.state(load_hf_model(tmp_path)), state)


def test_malformed_directories_name_the_problem(tmp_path: Path,
                                                source: tuple[dict[str, Any], ModelConfig, nnx.State]) -> None:
    hf, cfg, state = source
    tensors = state_to_hf_tensors(state, cfg)
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(hf))
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(FileNotFoundError, match=r"model\.safetensors.*\.bin"):
        load_hf_model(tmp_path)

    def expect(path: Path, files: dict[str, np.ndarray], match: str, shards: int = 1) -> None:
        _write(path, hf, files, shards)
        with pytest.raises((ValueError, FileNotFoundError), match=match):
            load_hf_model(path)

    expect(tmp_path / "missing", {k: v for k, v in tensors.items() if "layers.1.mlp.up" not in k},
           r"missing tensor 'model\.layers\.1\.mlp\.up_proj\.weight'")
    expect(tmp_path / "extra", {**tensors, "model.layers.0.mlp.up_proj.bias": np.zeros(48, np.float32)},
           r"unexpected tensor 'model\.layers\.0\.mlp\.up_proj\.bias'")
    bad = {**tensors, "model.layers.0.self_attn.o_proj.weight": np.zeros((32, 32), np.float32)}
    expect(tmp_path / "shape", bad, r"o_proj\.weight.*\[32, 32\].*\[32, 64\]")
    _write(tmp_path / "shard", hf, tensors, shards=2)
    (tmp_path / "shard" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match=r"model-00002-of-00002\.safetensors: missing"):
        load_hf_model(tmp_path / "shard")
