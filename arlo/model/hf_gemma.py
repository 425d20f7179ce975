"""Gemma 2 / Gemma 3 (text) `config.json` -> ModelConfig fields, and back (for export).

Gemma differs from Llama in ways a loader that ignored them would get silently wrong, so
every one is a field here: (1 + w) RMSNorm weights, GeGLU (gelu_pytorch_tanh), embeddings
scaled by sqrt(hidden_size), a norm after attention and one on each side of the MLP, the
score scale query_pre_attn_scalar**-0.5, attention and final logit soft-capping (Gemma 2),
sliding-window layers interleaved with full ones, QK-norm and a separate RoPE base for the
sliding layers (Gemma 3). Both layouts HF has written are read: transformers 5's
`rope_parameters` (for Gemma 3 one entry per layer type) and 4.x's `rope_theta`,
`rope_local_base_freq`, `rope_scaling` and `sliding_window_pattern`. Absent fields take the
defaults of HF's config classes (Gemma2Config, Gemma3TextConfig), as transformers would.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from arlo.model.rope import RopeScaling

if TYPE_CHECKING:
    from arlo.model.config import ModelConfig

GEMMA_MODEL_TYPES = ("gemma2", "gemma3_text")
GEMMA_ARCHITECTURES = {"gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# HF's config-class defaults for fields a config.json may leave out.
_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": dict(attn_logit_softcapping=50.0, final_logit_softcapping=30.0, pattern=2, theta=10000.0),
    "gemma3_text": dict(attn_logit_softcapping=None, final_logit_softcapping=None, pattern=6, theta=1e6,
                        local_theta=10000.0),
}
_ACTIVATIONS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu_tanh": "gelu_tanh"}


def gemma_fields(hf: dict[str, Any], rope: Any) -> dict[str, Any]:
    """ModelConfig fields particular to a Gemma config.json (model_type in GEMMA_MODEL_TYPES).
    `rope` is hf_config's reader of one rope-parameters dict: (theta, scaling)."""
    model_type = hf["model_type"]
    defaults = _DEFAULTS[model_type]
    _reject(hf)
    num_layers = hf.get("num_hidden_layers")
    layer_types = _layer_types(hf, defaults["pattern"], num_layers if isinstance(num_layers, int) else 0)
    activation = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if activation not in _ACTIVATIONS:
        raise ValueError(f"config.json hidden_activation={activation!r}: only gelu_pytorch_tanh (GeGLU) is "
                         f"implemented for {model_type}")
    bias = bool(hf.get("attention_bias", False))
    fields = dict(
        norm_unit_offset=True, mlp_activation=_ACTIVATIONS[activation], embed_scale=True, post_norms=True,
        qk_norm=model_type == "gemma3_text", qkv_bias=bias, o_bias=bias,
        tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
        query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)),
        attn_logit_softcap=_cap(hf, "attn_logit_softcapping", defaults),
        final_logit_softcap=_cap(hf, "final_logit_softcapping", defaults),
        sliding_window=_window(hf, layer_types),
        layer_types=layer_types,
    )
    if model_type == "gemma2":
        theta, scaling = rope(_flat_rope(hf, defaults["theta"]))
        return {**fields, "rope_theta": theta, "rope_scaling": scaling}
    (theta, scaling), local_theta = _gemma3_rope(hf, rope, defaults)
    return {**fields, "rope_theta": theta, "rope_scaling": scaling, "rope_local_theta": local_theta}


def _reject(hf: dict[str, Any]) -> None:
    checks = [
        ("use_bidirectional_attention", not hf.get("use_bidirectional_attention"),
         "bidirectional attention is not implemented (arlo's decoder is causal)"),
        ("quantization_config", "quantization_config" not in hf, "quantized checkpoints are not supported"),
    ]
    for field, ok, why in checks:
        if not ok:
            raise ValueError(f"config.json {field}={hf.get(field)!r}: {why}")


def _window(hf: dict[str, Any], layer_types: tuple[str, ...]) -> int | None:
    if "sliding_attention" not in layer_types:
        return None
    window = hf.get("sliding_window", 4096)
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ValueError(f"config.json sliding_window={window!r}: sliding_attention layers need a positive integer")
    return window


def _cap(hf: dict[str, Any], key: str, defaults: dict[str, Any]) -> float | None:
    value = hf.get(key, defaults[key])
    if value is None:
        return None
    if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"config.json {key}={value!r}: expected a positive number or null")
    return float(value)


def _layer_types(hf: dict[str, Any], pattern: int, num_layers: int) -> tuple[str, ...]:
    """HF's layer_types, or the pattern its config classes derive: layer i slides unless (i + 1)
    is a multiple of the pattern (Gemma 2: 2, Gemma 3: `sliding_window_pattern`, default 6)."""
    types = hf.get("layer_types")
    if types is None:
        pattern = hf.get("sliding_window_pattern", pattern)
        types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    if not isinstance(types, list) or any(t not in ("full_attention", "sliding_attention") for t in types):
        raise ValueError(f"config.json layer_types={types!r}: expected a list of 'full_attention' / "
                         f"'sliding_attention'")
    if len(types) != num_layers:
        raise ValueError(f"config.json layer_types: {len(types)} entries for num_hidden_layers={num_layers}")
    return tuple(types)


def _flat_rope(hf: dict[str, Any], theta: float) -> dict[str, Any]:
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        return {"rope_theta": theta, **params}
    return {"rope_theta": hf.get("rope_theta", theta), **(hf.get("rope_scaling") or {})}


def _gemma3_rope(hf: dict[str, Any], rope: Any, defaults: dict[str, Any]
                 ) -> tuple[tuple[float, RopeScaling | None], float]:
    """((theta, scaling) of full layers, theta of sliding layers, whose RoPE must be plain)."""
    params = hf.get("rope_parameters")
    if isinstance(params, dict) and ("full_attention" in params or "sliding_attention" in params):
        full = {"rope_theta": defaults["theta"], **(params.get("full_attention") or {})}
        local = {"rope_theta": defaults["local_theta"], **(params.get("sliding_attention") or {})}
    else:
        full = _flat_rope(hf, defaults["theta"])
        local = {"rope_theta": hf.get("rope_local_base_freq", defaults["local_theta"])}
    local_kind = local.get("rope_type", local.get("type", "default"))
    if local_kind != "default":
        raise ValueError(f"config.json rope_parameters.sliding_attention.rope_type={local_kind!r}: sliding "
                         f"layers with scaled RoPE are not implemented (only 'default')")
    return rope(full), float(local["rope_theta"])


def gemma_model_type(cfg: ModelConfig) -> str | None:
    """The Gemma family computing `cfg` exactly, None for a config without Gemma's parts, or a
    ValueError naming what a Gemma config lacks (no HF family computes a partial mix)."""
    gemma_parts = {"norm_unit_offset": cfg.norm_unit_offset, "embed_scale": cfg.embed_scale,
                   "post_norms": cfg.post_norms, "mlp_activation": cfg.mlp_activation == "gelu_tanh"}
    if not any(gemma_parts.values()):
        extras = {"query_pre_attn_scalar": cfg.query_pre_attn_scalar, "attn_logit_softcap": cfg.attn_logit_softcap,
                  "final_logit_softcap": cfg.final_logit_softcap, "rope_local_theta": cfg.rope_local_theta,
                  "sliding layer_types": "sliding_attention" in cfg.layer_types or None}
        used = [name for name, value in extras.items() if value is not None]
        if used:
            raise ValueError(f"export: {used[0]} outside a Gemma config has no Hugging Face family")
        return None
    missing = [name for name, on in gemma_parts.items() if not on]
    if missing or cfg.qkv_bias != cfg.o_bias:
        raise ValueError(f"export: a config with only some of Gemma's parts has no Hugging Face family "
                         f"(missing {missing or 'matching q/k/v and o biases'})")
    if cfg.qk_norm:
        return "gemma3_text"
    if cfg.rope_local_theta is not None:
        raise ValueError("export: rope_local_theta without qk_norm has no Hugging Face family (Gemma 3 has both)")
    return "gemma2"


def gemma_hf_config(cfg: ModelConfig, model_type: str, rope: dict[str, Any]) -> dict[str, Any]:
    """config.json fields of a Gemma family (beside the shared ones export writes); `rope` is
    the full layers' rope_parameters."""
    out: dict[str, Any] = {
        "hidden_activation": "gelu_pytorch_tanh", "attention_bias": cfg.qkv_bias,
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        "attn_logit_softcapping": cfg.attn_logit_softcap, "final_logit_softcapping": cfg.final_logit_softcap,
        "sliding_window": cfg.sliding_window,
        "layer_types": list(cfg.layer_types) or ["full_attention"] * cfg.num_layers,
    }
    if model_type == "gemma3_text":
        local = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        if cfg.rope_local_theta is None and cfg.rope_scaling is not None:
            raise ValueError("export: Gemma 3 applies rope_scaling to full layers only; set rope_local_theta")
        out["rope_parameters"] = {"full_attention": rope,
                                  "sliding_attention": {"rope_type": "default", "rope_theta": local}}
    return out


def _int_if_whole(x: float) -> float | int:
    # HF's config classes type query_pre_attn_scalar as int and refuse 256.0.
    return int(x) if float(x).is_integer() else x
