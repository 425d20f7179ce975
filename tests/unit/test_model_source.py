"""`arlo.model.source`: a preset or a local HF directory resolved once; every file a service would
read is checked up front, and each error names the file."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from flax import nnx

from arlo.model import ModelConfig, create_model, get_tokenizer
from arlo.model.export import export_hf
from arlo.model.source import check_model_dir, resolve_model


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    cfg = ModelConfig.named("tiny")
    out = tmp_path_factory.mktemp("ckpt") / "model"
    export_hf(nnx.split(create_model(cfg, 7))[1], cfg, out, tokenizer=get_tokenizer("byte"), max_shard_bytes=1 << 17)
    return out


def test_a_checkpoint_is_version_zero_and_brings_its_tokenizer(checkpoint: Path) -> None:
    source = resolve_model(name="tiny", path=str(checkpoint), tokenizer="byte", seed=0, max_seq_len=64)
    assert source.cfg.max_seq_len == 64 and source.checkpoint == checkpoint
    assert source.tokenizer_name == str(checkpoint) and source.tokenizer().eos_id == get_tokenizer("byte").eos_id
    loaded = source.initial_state(jax.devices()[0])
    expected = nnx.split(create_model(ModelConfig.named("tiny"), 7))[1]
    for (path, a), (_, b) in zip(nnx.to_flat_state(loaded), nnx.to_flat_state(expected), strict=True):
        assert np.array_equal(np.asarray(a.get_value()), np.asarray(b.get_value())), path


def test_a_preset_is_random_init_from_the_seed() -> None:
    source = resolve_model(name="tiny", path="", tokenizer="byte", seed=3, dtype="bfloat16")
    assert source.checkpoint is None and source.cfg.dtype == "bfloat16"
    with pytest.raises(ValueError, match="unknown model config 'qwen2.5-0.5b'"):
        resolve_model(name="qwen2.5-0.5b", path="", tokenizer="byte", seed=0)


@pytest.mark.parametrize(("breakage", "match"), [
    ("rm config.json", r"config\.json: missing"),
    ("rm tokenizer.json", r"tokenizer\.json: missing"),
    ("rm shard", r"model-00001-of-\d+\.safetensors: missing; model\.safetensors\.index\.json lists it"),
    ("rm weights", r"missing model\.safetensors"),
    ("no template", r"tokenizer_config\.json: no chat_template"),
    ("arch", r"architectures: 'MistralForCausalLM' is not supported"),
    ("sliding", r"use_sliding_window"),
])
def test_each_missing_or_unsupported_piece_is_named(checkpoint: Path, tmp_path: Path, breakage: str,
                                                    match: str) -> None:
    broken = tmp_path / "m"
    broken.mkdir()
    for f in checkpoint.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    if breakage == "rm config.json":
        (broken / "config.json").unlink()
    elif breakage == "rm tokenizer.json":
        (broken / "tokenizer.json").unlink()
    elif breakage == "rm shard":
        next(broken.glob("model-00001-*.safetensors")).unlink()
    elif breakage == "rm weights":
        for f in broken.glob("*.safetensors*"):
            f.unlink()
    elif breakage == "no template":
        tc = json.loads((broken / "tokenizer_config.json").read_text())
        del tc["chat_template"]
        (broken / "tokenizer_config.json").write_text(json.dumps(tc))
    elif breakage == "arch":
        (broken / "config.json").write_text(json.dumps({**config, "architectures": ["MistralForCausalLM"]}))
    elif breakage == "sliding":
        (broken / "config.json").write_text(json.dumps({**config, "use_sliding_window": True}))
    with pytest.raises(ValueError, match=match):
        check_model_dir(broken)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama3", "gemma2", "gemma3"])
def test_checkpoints_written_by_transformers_resolve_with_every_eos_id(family: str, tmp_path: Path) -> None:
    pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
    from tests.support.hf_checkpoints import write_checkpoint

    path = write_checkpoint(tmp_path / family, family, max_shard_size="100KB")
    source = resolve_model(name="tiny", path=str(path), tokenizer="", seed=0)
    generation = json.loads((path / "generation_config.json").read_text())
    tok = source.tokenizer()
    # The turn's end first (what the rollout appends when a turn is cut), then every other eos id.
    assert sorted(tok.stop_token_ids) == sorted(generation["eos_token_id"])
    assert source.cfg.vocab_size >= tok.vocab_size and source.checkpoint == path
