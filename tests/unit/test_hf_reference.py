"""arlo vs Hugging Face transformers (PyTorch CPU) on random tiny Llama 3 / Qwen2 / Qwen3 models.

transformers writes the checkpoint (safetensors, single-file and sharded), arlo loads it:
logits on the same tokens agree to 1e-4 in float32 and greedy generation agrees token for
token. Needs the `hf` extra (`pip install -e '.[hf]'`); skipped without it.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from flax import nnx

from arlo.model import ModelConfig
from arlo.model.hf import INDEX_FILE, load_hf_model
from arlo.model.rope import RopeScaling
from tests.support.reference_decode import greedy_decode

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)

_BASE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, initializer_range=0.2,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 16}
YARN_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16}
LINEAR_ROPE = {"rope_type": "linear", "rope_theta": 1000.0, "factor": 2.0}

CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama3-untied": ("LlamaConfig", dict(rope_parameters=LLAMA3_ROPE, tie_word_embeddings=False)),
    "llama-tied-bias-headdim": ("LlamaConfig", dict(tie_word_embeddings=True, attention_bias=True, head_dim=16)),
    "qwen2-tied-yarn": ("Qwen2Config", dict(rope_parameters=YARN_ROPE, tie_word_embeddings=True)),
    "qwen3-untied-linear": ("Qwen3Config", dict(head_dim=16, tie_word_embeddings=False,
                                                rope_parameters=LINEAR_ROPE)),
}


def _hf_model(config_class: str, extra: dict[str, Any]) -> Any:
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**_BASE, **extra)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    # HF initialises norms to 1 and biases to 0; perturb them so their mapping is tested.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Path, str]:
    config_class, extra = CASES[request.param]
    model = _hf_model(config_class, extra)
    path = tmp_path_factory.mktemp(request.param)
    # Shard every other case, small enough to split a layer's tensors across files.
    sharded = sorted(CASES).index(request.param) % 2 == 1
    model.save_pretrained(path, max_shard_size="20KB" if sharded else "1GB")
    assert (path / INDEX_FILE).is_file() == sharded
    return model, path, request.param


@functools.partial(jax.jit, static_argnums=0)
def _forward(graphdef: nnx.GraphDef, state: nnx.State, tokens_bt: jax.Array) -> jax.Array:
    return nnx.merge(graphdef, state)(tokens_bt)


def _tokens(b: int, t: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, _BASE["vocab_size"], (b, t)).astype(np.int32)


def test_config_maps_family_features(case: tuple[Any, Path, str]) -> None:
    _, path, name = case
    cfg = ModelConfig.from_hf_dir(path)
    assert cfg.qkv_bias == (name.startswith("qwen2") or "bias" in name)
    assert cfg.o_bias == ("bias" in name)
    assert cfg.qk_norm == name.startswith("qwen3")
    assert cfg.tie_embeddings == ("tied" in name and "untied" not in name)
    if name == "llama3-untied":
        assert cfg.rope_scaling == RopeScaling(kind="llama3", factor=8.0, original_max_seq_len=16,
                                               low_freq_factor=1.0, high_freq_factor=4.0)
        assert cfg.rope_theta == 500000.0


def test_logits_match(case: tuple[Any, Path, str]) -> None:
    hf_model, path, _ = case
    model = load_hf_model(path)
    tokens = _tokens(2, 40, seed=1)  # past original_max_position_embeddings: scaling matters
    ours = np.asarray(_forward(*nnx.split(model), tokens))
    with torch.no_grad():
        ref = hf_model(torch.from_numpy(tokens).long()).logits.numpy()
    assert ours.shape == ref.shape
    assert np.max(np.abs(ours - ref)) < 1e-4, np.max(np.abs(ours - ref))


def test_greedy_generation_matches(case: tuple[Any, Path, str]) -> None:
    hf_model, path, _ = case
    prompt = _tokens(1, 7, seed=2)[0].tolist()
    steps = 12
    ours = greedy_decode(load_hf_model(path), prompt, steps)
    with torch.no_grad():
        ref = hf_model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=steps,
                                min_new_tokens=steps, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    assert ours == ref[0, len(prompt):].tolist()
