"""Hugging Face `config.json` -> ModelConfig, for the Llama and Qwen2/Qwen3 families.

Reads both layouts HF has used: transformers 5's `rope_parameters` and 4.x's top-level
`rope_theta` + `rope_scaling` (with "type" or "rope_type"). Anything that would change the
math and is not implemented here (sliding windows, MLP biases, partial rotary, dynamic or
long RoPE, quantized weights) is an error naming the field, never silently ignored.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arlo.model.rope import ROPE_KINDS, RopeScaling

if TYPE_CHECKING:
    from arlo.model.config import ModelConfig

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")
CONFIG_FILE = "config.json"


def read_hf_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / CONFIG_FILE
    if not file.is_file():
        raise FileNotFoundError(f"{file}: missing; a Hugging Face model directory needs {CONFIG_FILE}")
    try:
        data = json.loads(file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: not valid JSON ({e})") from e
    if not isinstance(data, dict):
        raise ValueError(f"{file}: expected a JSON object")
    return data


def config_from_hf(cls: type[ModelConfig], hf: dict[str, Any], overrides: dict[str, Any]) -> ModelConfig:
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type: {model_type!r} is not supported; "
                         f"supported: {list(SUPPORTED_MODEL_TYPES)}")
    _reject_unsupported(hf)
    heads = _int(hf, "num_attention_heads")
    dim = _int(hf, "hidden_size")
    head_dim = hf.get("head_dim") or dim // heads
    theta, scaling = _rope(hf)
    # Qwen2 hard-codes q/k/v biases and no o bias; Llama and Qwen3 put all four behind one flag.
    attention_bias = bool(hf.get("attention_bias", False))
    qkv_bias = True if model_type == "qwen2" else attention_bias
    o_bias = False if model_type == "qwen2" else attention_bias
    cfg = cls(
        vocab_size=_int(hf, "vocab_size"),
        dim=dim,
        num_layers=_int(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=head_dim,
        mlp_dim=_int(hf, "intermediate_size"),
        max_seq_len=_int(hf, "max_position_embeddings"),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=qkv_bias,
        o_bias=o_bias,
        qk_norm=model_type == "qwen3",
    )
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _int(hf: dict[str, Any], key: str) -> int:
    value = hf.get(key)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"config.json {key}: expected an integer, got {value!r}")
    return value


def _reject_unsupported(hf: dict[str, Any]) -> None:
    checks = [
        ("hidden_act", hf.get("hidden_act", "silu") == "silu", "only silu (SwiGLU) is implemented"),
        ("mlp_bias", not hf.get("mlp_bias", False), "MLP biases are not implemented"),
        ("use_sliding_window", not hf.get("use_sliding_window", False), "sliding-window attention is not "
         "implemented"),
        ("layer_types", all(t == "full_attention" for t in hf.get("layer_types") or []),
         "only full_attention layers are implemented"),
        ("quantization_config", "quantization_config" not in hf, "quantized checkpoints are not supported"),
        ("partial_rotary_factor", _rope_params(hf).get("partial_rotary_factor", 1.0) == 1.0,
         "partial rotary embeddings are not implemented"),
    ]
    for field, ok, why in checks:
        if not ok:
            raise ValueError(f"config.json {field}={hf.get(field)!r}: {why}")


def _rope_params(hf: dict[str, Any]) -> dict[str, Any]:
    """transformers 5 `rope_parameters`, or the 4.x `rope_theta` + `rope_scaling` pair merged."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        return dict(params)
    merged = dict(hf.get("rope_scaling") or {})
    if "rope_theta" in hf:
        merged["rope_theta"] = hf["rope_theta"]
    return merged


def _rope(hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    params = _rope_params(hf)
    theta = float(params.get("rope_theta", 10000.0))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ROPE_KINDS:
        raise ValueError(f"config.json rope_type: {kind!r} is not supported; supported: "
                         f"{['default', *ROPE_KINDS]}")
    if params.get("mscale") or params.get("mscale_all_dim"):
        raise ValueError("config.json rope_parameters.mscale: yarn with mscale is not supported")
    factor = params.get("factor")
    if factor is None:
        raise ValueError(f"config.json rope_parameters.factor: {kind} needs a factor")
    optional = {"low_freq_factor": "low_freq_factor", "high_freq_factor": "high_freq_factor",
                "beta_fast": "beta_fast", "beta_slow": "beta_slow", "attention_factor": "attention_factor",
                "truncate": "truncate"}
    kwargs = {ours: params[theirs] for theirs, ours in optional.items() if params.get(theirs) is not None}
    original = params.get("original_max_position_embeddings") or hf.get("max_position_embeddings") or 0
    try:
        return theta, RopeScaling(kind=kind, factor=float(factor), original_max_seq_len=int(original), **kwargs)
    except ValueError as e:
        raise ValueError(f"config.json rope_parameters: {e}") from e
