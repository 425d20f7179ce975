"""`arlo.model.export`: a policy out to a Hugging Face directory that transformers loads with the
same logits (1e-4, float32), single-file and sharded, float32 and bfloat16, each family; the byte
tokenizer's files encode and render chats to ByteTokenizer's ids through transformers itself."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from arlo.model import ModelConfig, create_model, get_tokenizer
from arlo.model.export import export_hf, hf_config, model_type_of
from arlo.model.hf import INDEX_FILE, load_hf_model

_SKIP = "needs the hf extra: pip install -e '.[hf]'"
torch = pytest.importorskip("torch", reason=_SKIP)
transformers = pytest.importorskip("transformers", reason=_SKIP)

TINY = ModelConfig.named("tiny")
FAMILIES = {
    "llama": (TINY, "LlamaForCausalLM"),
    "qwen2": (dataclasses.replace(TINY, qkv_bias=True), "Qwen2ForCausalLM"),
    "qwen3": (dataclasses.replace(TINY, qk_norm=True, tie_embeddings=False), "Qwen3ForCausalLM"),
}


def _perturbed(cfg: ModelConfig) -> nnx.Module:
    # Random init leaves norms at 1 and biases at 0; move them so their mapping is checked.
    model = create_model(cfg, 0)
    graphdef, state = nnx.split(model)
    rng = np.random.default_rng(1)
    flat = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if "scale" in str(path[-1]) or "bias" in str(path[-1]):
            value = value + 0.1 * jnp.asarray(rng.standard_normal(value.shape), value.dtype)
        flat.append((path, var.copy(value)))
    return nnx.merge(graphdef, nnx.from_flat_state(flat))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_transformers_loads_the_export_with_equal_logits(family: str, tmp_path: Path) -> None:
    cfg, architecture = FAMILIES[family]
    model = _perturbed(cfg)
    out = tmp_path / family
    result = export_hf(nnx.split(model)[1], cfg, out, tokenizer=get_tokenizer("byte"), max_shard_bytes=1 << 17)
    assert (out / INDEX_FILE).is_file() and len([f for f in result.files if f.endswith(".safetensors")]) > 1
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").eval()
    assert type(hf).__name__ == architecture
    tokens = np.random.default_rng(0).integers(0, 263, (2, 19))
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    ours = np.asarray(model(jnp.asarray(tokens)))
    assert np.abs(ours - theirs).max() < 1e-4
    # And back into arlo, bit for bit.
    assert np.array_equal(np.asarray(load_hf_model(out)(jnp.asarray(tokens))), ours)


def test_bfloat16_export_halves_the_bytes_and_loads(tmp_path: Path) -> None:
    cfg = FAMILIES["qwen2"][0]
    state = nnx.split(_perturbed(cfg))[1]
    f32 = export_hf(state, cfg, tmp_path / "f32", tokenizer=get_tokenizer("byte"))
    bf16 = export_hf(state, cfg, tmp_path / "bf16", tokenizer=get_tokenizer("byte"), dtype="bfloat16")
    assert bf16.num_bytes * 2 == f32.num_bytes
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype=torch.float32).eval()
    tokens = np.arange(24).reshape(2, 12)
    with torch.no_grad():
        theirs = hf(torch.tensor(tokens)).logits.numpy()
    # Rounded weights differ from the float32 ones; both sides read the same rounded weights.
    assert np.abs(np.asarray(load_hf_model(tmp_path / "bf16")(jnp.asarray(tokens))) - theirs).max() < 1e-4


def test_byte_tokenizer_files_give_byte_tokenizer_ids(tmp_path: Path) -> None:
    export_hf(nnx.split(create_model(TINY, 0))[1], TINY, tmp_path, tokenizer=get_tokenizer("byte"))
    hf_tok = transformers.AutoTokenizer.from_pretrained(tmp_path)
    ours = get_tokenizer("byte")
    for text in ["12*3=", "héllo ✓\n\tx", "  calc 4 * 5", ""]:
        assert hf_tok.encode(text, add_special_tokens=False) == ours.encode(text)
        assert hf_tok.decode(ours.encode(text)) == text
    chat = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "7*8="},
            {"role": "assistant", "content": "calc 7*8"}, {"role": "tool", "content": "56"}]
    rendered = hf_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
    ids = rendered["input_ids"] if isinstance(rendered, dict) or hasattr(rendered, "keys") else rendered
    assert list(ids) == ours.encode_messages([(m["role"], m["content"]) for m in chat],
                                             add_generation_prompt=True, add_bos=True)
    generation = json.loads((tmp_path / "generation_config.json").read_text())
    assert generation["eos_token_id"] == ours.eos_id


def test_export_refuses_a_non_empty_directory_and_leaves_nothing_half_written(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("x")
    with pytest.raises(FileExistsError, match="not an empty directory"):
        export_hf(nnx.split(create_model(TINY, 0))[1], TINY, tmp_path / "out", tokenizer=get_tokenizer("byte"))
    with pytest.raises(ValueError, match="needs the directory"):
        fake = type("T", (), {"name": "/some/dir", "stop_token_ids": [1], "pad_id": 0})()
        export_hf(nnx.split(create_model(TINY, 0))[1], TINY, tmp_path / "new", tokenizer=fake)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_config_maps_back_to_itself() -> None:
    for cfg, _ in FAMILIES.values():
        assert ModelConfig.from_hf_config(hf_config(cfg, eos_ids=[2])) == cfg
    with pytest.raises(ValueError, match="no Hugging Face family"):
        model_type_of(dataclasses.replace(TINY, o_bias=True))
