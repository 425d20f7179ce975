"""Hugging Face `config.json` -> ModelConfig, for the Llama, Qwen2/Qwen3, Qwen3-MoE and Gemma 2/3
families (Gemma's own fields in hf_gemma.py).

Reads both layouts HF has used: transformers 5's `rope_parameters` and 4.x's top-level
`rope_theta` + `rope_scaling` (with "type" or "rope_type"). Anything that would change the
math and is not implemented here (sliding windows, MLP biases, partial rotary, dynamic or
long RoPE, quantized weights, a vision tower) is an error naming the field, never silently ignored;
`from_hf_dir` puts the file's path in place of "config.json".
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arlo.model.hf_gemma import GEMMA_MODEL_TYPES, gemma_fields
from arlo.model.rope import ROPE_KINDS, RopeScaling

if TYPE_CHECKING:
    from arlo.model.config import ModelConfig, MoeShape

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen3_moe", *GEMMA_MODEL_TYPES)
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


def config_from_hf(cls: type[ModelConfig], hf: dict[str, Any], overrides: dict[str, Any],
                   source: str = CONFIG_FILE) -> ModelConfig:
    """`source` (the file's path) replaces "config.json" at the head of an error message."""
    try:
        cfg = cls(**_shared_fields(hf), **_family_fields(hf))
    except ValueError as e:
        message = str(e)
        if source == CONFIG_FILE or not message.startswith(CONFIG_FILE):
            raise
        raise ValueError(source + message[len(CONFIG_FILE):]) from e
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def _shared_fields(hf: dict[str, Any]) -> dict[str, Any]:
    """The fields every family names alike, after the checks that hold for every family."""
    if "vision_config" in hf or "text_config" in hf:
        field = "vision_config" if "vision_config" in hf else "text_config"
        raise ValueError(f"config.json {field}: a multimodal checkpoint (vision tower) is not supported; "
                         f"arlo loads text-only models (e.g. Gemma3ForCausalLM, model_type gemma3_text)")
    model_type = hf.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"config.json model_type: {model_type!r} is not supported; "
                         f"supported: {list(SUPPORTED_MODEL_TYPES)}")
    heads = _int(hf, "num_attention_heads")
    dim = _int(hf, "hidden_size")
    return dict(
        vocab_size=_int(hf, "vocab_size"),
        dim=dim,
        num_layers=_int(hf, "num_hidden_layers"),
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or dim // heads,
        mlp_dim=_int(hf, "intermediate_size"),
        max_seq_len=_int(hf, "max_position_embeddings"),
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
    )


def _family_fields(hf: dict[str, Any]) -> dict[str, Any]:
    model_type = hf["model_type"]
    if model_type in GEMMA_MODEL_TYPES:
        return gemma_fields(hf, functools.partial(_rope_from, hf=hf))
    _reject_unsupported(hf)
    theta, scaling = _rope(hf)
    # Qwen2 hard-codes q/k/v biases and no o bias; Llama and Qwen3 put all four behind one flag.
    attention_bias = bool(hf.get("attention_bias", False))
    return dict(
        rope_theta=theta,
        rope_scaling=scaling,
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=True if model_type == "qwen2" else attention_bias,
        o_bias=False if model_type == "qwen2" else attention_bias,
        qk_norm=model_type in ("qwen3", "qwen3_moe"),
        moe=_moe(hf) if model_type == "qwen3_moe" else None,
    )


def _moe(hf: dict[str, Any]) -> MoeShape | None:
    """Qwen3-MoE's routed experts, with HF's rule for which layers route; None when
    num_experts is 0 (HF then builds every layer dense). transformers 5 writes num_experts
    as num_local_experts."""
    from arlo.model.config import MoeShape

    key = "num_experts" if "num_experts" in hf else "num_local_experts"
    experts = _int(hf, key) if key in hf else 0
    if experts == 0:
        return None
    top_k, step = _int(hf, "num_experts_per_tok"), hf.get("decoder_sparse_step", 1)
    checks = [(key, experts > 0, "must be >= 0"),
              ("num_experts_per_tok", 1 <= top_k <= experts, f"must be in 1..{key}={experts}"),
              ("decoder_sparse_step", isinstance(step, int) and step >= 1, "must be an integer >= 1")]
    dense = hf.get("mlp_only_layers") or []
    layers = hf.get("num_hidden_layers")
    checks.append(("mlp_only_layers", isinstance(dense, list) and all(isinstance(i, int) and 0 <= i < layers
                                                                     for i in dense),
                   f"must list layer indices in 0..{layers - 1}" if isinstance(layers, int) else "needs layers"))
    for field, ok, why in checks:
        if not ok:
            raise ValueError(f"config.json {field}={hf.get(field)!r}: {why}")
    return MoeShape(num_experts=experts, top_k=top_k, mlp_dim=_int(hf, "moe_intermediate_size"),
                    norm_topk_prob=bool(hf.get("norm_topk_prob", False)), sparse_step=step,
                    dense_layers=tuple(dense))


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
    return _rope_from(_rope_params(hf), hf)


def _rope_from(params: dict[str, Any], hf: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """One rope-parameters dict (HF names) -> (theta, scaling); `hf` for the context length."""
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
