"""A trained policy out to a Hugging Face directory: the inverse of `arlo.model.hf`.

Writes `config.json` (the family's `model_type` and `architectures`), the weights as
safetensors (one file, or shards of at most `max_shard_bytes` with
`model.safetensors.index.json`), `generation_config.json` (every stop id as
`eos_token_id`) and the tokenizer files: copied from the checkpoint the run started from,
or the byte tokenizer's own (`arlo.model.byte_tokenizer_file`). The result loads with
`transformers.AutoModelForCausalLM.from_pretrained` and `AutoTokenizer.from_pretrained`.

Memory: tensors are converted to HF layout one at a time and written shard by shard, so
the host holds at most one shard of HF-layout copies beside the state itself.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import ml_dtypes
import numpy as np
import safetensors.numpy
from flax import nnx

from arlo.budget import runs_under
from arlo.model.byte_tokenizer_file import write_byte_tokenizer
from arlo.model.config import ModelConfig
from arlo.model.hf import INDEX_FILE, SINGLE_FILE, tensor_maps
from arlo.model.hf_gemma import GEMMA_ARCHITECTURES, GEMMA_MODEL_TYPES, gemma_hf_config, gemma_model_type
from arlo.model.tokenizer import Tokenizer

# Files of a tokenizer directory that travel with an export (whichever exist).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                   "vocab.json", "merges.txt", "added_tokens.json")
EXPORT_DTYPES = ("float32", "bfloat16")
_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
                  "qwen3_moe": "Qwen3MoeForCausalLM", **GEMMA_ARCHITECTURES}


@dataclass(frozen=True, kw_only=True, slots=True)
class ExportResult:
    out: Path
    files: tuple[str, ...]
    num_bytes: int
    """Bytes of the weight files."""


def export_hf(state: nnx.State, cfg: ModelConfig, out: str | Path, *, tokenizer: Tokenizer,
              tokenizer_dir: str | Path | None = None, dtype: str = "float32",
              max_shard_bytes: int = 2 << 30, base_config: dict[str, Any] | None = None) -> ExportResult:
    """Writes the model with parameters `state` to `out` (created; must be empty if it exists).

    `tokenizer_dir` is the HF directory the tokenizer came from (its files are copied); None
    with the byte tokenizer writes that one's files. `base_config` (the source checkpoint's
    config.json) keeps fields this mapping does not own (token ids, names) where they agree.
    The directory is assembled under a temporary name and renamed into place, so a crash
    never leaves a half-written export at `out`.
    """
    if dtype not in EXPORT_DTYPES:
        raise ValueError(f"export dtype: expected one of {EXPORT_DTYPES}, got {dtype!r}")
    if max_shard_bytes < 1 << 16:
        raise ValueError(f"export max_shard_bytes: must be >= 64 KiB, got {max_shard_bytes}")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise FileExistsError(f"{target}: exists and is not an empty directory; export writes a new directory")
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        num_bytes = _write_weights(state, cfg, staging, dtype, max_shard_bytes)
        stop_ids = list(tokenizer.stop_token_ids)
        config = hf_config(cfg, dtype=dtype, base=base_config, eos_ids=stop_ids,
                           bos_id=getattr(tokenizer, "bos_id", None), pad_id=tokenizer.pad_id)
        (staging / "config.json").write_text(json.dumps(config, indent=2))
        generation = {"eos_token_id": stop_ids if len(stop_ids) > 1 else stop_ids[0], "pad_token_id": tokenizer.pad_id}
        if getattr(tokenizer, "bos_id", None) is not None:
            generation["bos_token_id"] = tokenizer.bos_id
        (staging / "generation_config.json").write_text(json.dumps(generation, indent=2))
        _write_tokenizer(staging, tokenizer, tokenizer_dir)
        if target.exists():
            target.rmdir()
        os.replace(staging, target)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ExportResult(out=target, files=tuple(sorted(p.name for p in target.iterdir())), num_bytes=num_bytes)


def model_type_of(cfg: ModelConfig) -> str:
    """The HF family whose modeling code computes exactly this config."""
    gemma = gemma_model_type(cfg)
    if gemma is not None:
        if cfg.moe is not None:
            raise ValueError("export: routed experts in a Gemma config have no Hugging Face family")
        return gemma
    if cfg.moe is not None and not cfg.qk_norm:
        raise ValueError("export: routed experts without qk_norm have no Hugging Face family (Qwen3-MoE has qk_norm)")
    if cfg.qk_norm:
        if cfg.qkv_bias != cfg.o_bias:
            raise ValueError("export: qk_norm with q/k/v biases but no o bias has no Hugging Face family")
        return "qwen3" if cfg.moe is None else "qwen3_moe"
    if cfg.qkv_bias and not cfg.o_bias:
        return "qwen2"
    if cfg.qkv_bias != cfg.o_bias:
        raise ValueError("export: an o bias without q/k/v biases has no Hugging Face family")
    return "llama"


def hf_config(cfg: ModelConfig, *, dtype: str = "float32", base: dict[str, Any] | None = None,
              eos_ids: Sequence[int] = (), bos_id: int | None = None, pad_id: int | None = None) -> dict[str, Any]:
    """config.json for `cfg`: what `arlo.model.hf_config.config_from_hf` maps back to `cfg`."""
    model_type = model_type_of(cfg)
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": s.kind, "rope_theta": cfg.rope_theta, "factor": s.factor}
        if s.original_max_seq_len:
            rope["original_max_position_embeddings"] = s.original_max_seq_len
        if s.kind == "llama3":
            rope.update(low_freq_factor=s.low_freq_factor, high_freq_factor=s.high_freq_factor)
        if s.kind == "yarn":
            rope.update(beta_fast=s.beta_fast, beta_slow=s.beta_slow, truncate=s.truncate)
            if s.attention_factor is not None:
                rope["attention_factor"] = s.attention_factor
    ours: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[model_type]], "model_type": model_type,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.dim, "intermediate_size": cfg.mlp_dim,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "hidden_act": "silu",
        "tie_word_embeddings": cfg.tie_embeddings, "rope_parameters": rope, "rope_theta": cfg.rope_theta,
        "dtype": dtype, "use_cache": True,
    }
    if model_type != "qwen2":
        ours["attention_bias"] = cfg.qkv_bias
    if model_type == "qwen2":
        ours["use_sliding_window"] = False
    if model_type in GEMMA_MODEL_TYPES:
        del ours["hidden_act"]  # Gemma's modeling reads hidden_activation
        ours.update(gemma_hf_config(cfg, model_type, rope))
    if cfg.moe is not None:
        ours.update(num_experts=cfg.moe.num_experts, num_experts_per_tok=cfg.moe.top_k,
                    moe_intermediate_size=cfg.moe.mlp_dim, norm_topk_prob=cfg.moe.norm_topk_prob,
                    decoder_sparse_step=cfg.moe.sparse_step, mlp_only_layers=list(cfg.moe.dense_layers),
                    use_sliding_window=False)
    ids = {"eos_token_id": (list(eos_ids) if len(eos_ids) > 1 else eos_ids[0]) if eos_ids else None,
           "bos_token_id": bos_id, "pad_token_id": pad_id}
    kept = {k: v for k, v in (base or {}).items() if k not in ours and k not in _DROPPED_BASE_KEYS}
    return {**kept, **{k: v for k, v in ids.items() if v is not None}, **ours}


# Keys of a source config.json that describe the old weights or another layout, never copied.
_DROPPED_BASE_KEYS = ("rope_scaling", "torch_dtype", "quantization_config", "layer_types", "sliding_window",
                      "max_window_layers", "transformers_version",
                      "num_local_experts")  # transformers 5's name for num_experts, which `ours` writes


def _write_weights(state: nnx.State, cfg: ModelConfig, out: Path, dtype: str, max_shard_bytes: int) -> int:
    values = {"/".join(str(p) for p in path): var for path, var in nnx.to_flat_state(state)}
    shards = list(_plan_shards(cfg, max_shard_bytes, 2 if dtype == "bfloat16" else 4))
    weight_map: dict[str, str] = {}
    total = 0
    held: tuple[str, np.ndarray] | None = None  # one parameter on the host: an expert stack serves E tensors
    for index, names in enumerate(shards):
        file = SINGLE_FILE if len(shards) == 1 else f"model-{index + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {}
        for m in names:
            if held is None or held[0] != m.key:
                held = (m.key, np.asarray(jax.device_get(values[m.key].get_value()), np.float32))
            hf = np.ascontiguousarray(m.to_hf(m.part(held[1])))
            tensors[m.hf_name] = hf.astype(ml_dtypes.bfloat16) if dtype == "bfloat16" else hf
            total += tensors[m.hf_name].nbytes
        safetensors.numpy.save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys((m.hf_name for m in names), file))
        del tensors
    if len(shards) > 1:
        index_doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / INDEX_FILE).write_text(json.dumps(index_doc, indent=2))
    return total


def _plan_shards(cfg: ModelConfig, max_shard_bytes: int, itemsize: int) -> Iterator[list[Any]]:
    """Tensor maps grouped into shards of at most max_shard_bytes (a bigger tensor alone)."""
    shapes = _param_shapes(cfg)
    yield from runs_under(tensor_maps(cfg), lambda m: int(np.prod(m.part_shape(shapes[m.key]))) * itemsize, max_shard_bytes)


def _param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    from arlo.model.transformer import abstract_model

    _, abstract = nnx.split(abstract_model(cfg))
    return {"/".join(str(p) for p in path): tuple(var.get_value().shape) for path, var in nnx.to_flat_state(abstract)}


def _write_tokenizer(out: Path, tokenizer: Tokenizer, tokenizer_dir: str | Path | None) -> None:
    if tokenizer_dir is None:
        if tokenizer.name != "byte":
            raise ValueError(f"export: tokenizer {tokenizer.name!r} needs the directory its files came from")
        write_byte_tokenizer(out)
        return
    source = Path(tokenizer_dir)
    copied = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    if "tokenizer.json" not in copied:
        raise FileNotFoundError(f"{source / 'tokenizer.json'}: missing; export copies the run's tokenizer files")
    for name in copied:
        shutil.copyfile(source / name, out / name)
