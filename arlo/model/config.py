"""Model hyper-parameters: one frozen dataclass, named presets, and Hugging Face configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from arlo.choices import Dtype
from arlo.model.rope import RopeScaling

_DTYPES = get_args(Dtype)


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A decoder-only Llama/Qwen-style transformer (RMSNorm, GQA + RoPE, SwiGLU).

    Covers Llama 3 (rope_scaling "llama3"), Qwen2/2.5 (qkv_bias) and Qwen3 (qk_norm, a
    head_dim independent of dim / num_heads); `from_hf_config` maps HF configs onto it.
    """

    vocab_size: int
    """Rows of the embedding table; may exceed the tokenizer's vocabulary (padding for alignment)."""
    dim: int
    """Width of the residual stream."""
    num_layers: int
    num_heads: int
    """Query heads."""
    num_kv_heads: int
    """Key/value heads; must divide num_heads (grouped-query attention)."""
    head_dim: int
    """Width of one head; even, because RoPE rotates pairs."""
    mlp_dim: int
    """Hidden width of the SwiGLU MLP."""
    max_seq_len: int
    """Longest sequence (prompt + generated) the model is used with."""
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    """Context-extension variant of RoPE (linear, llama3, yarn); None is plain RoPE."""
    norm_eps: float = 1e-6
    qkv_bias: bool = False
    """Biases on the q/k/v projections (Qwen2/2.5; Llama/Qwen3 `attention_bias`)."""
    o_bias: bool = False
    """Bias on the output projection (Llama/Qwen3 `attention_bias`; not Qwen2)."""
    qk_norm: bool = False
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3)."""
    tie_embeddings: bool = True
    """Share the embedding table with the output projection."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"); parameters are stored in model.param_dtype (ModelSource)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_dim",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelConfig.{name}: must be a positive int, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"ModelConfig.num_kv_heads: {self.num_kv_heads} must divide "
                             f"num_heads={self.num_heads}")
        if self.head_dim % 2:
            raise ValueError(f"ModelConfig.head_dim: must be even for RoPE, got {self.head_dim}")
        if self.rope_theta <= 0 or self.norm_eps <= 0:
            raise ValueError("ModelConfig.rope_theta and norm_eps must be > 0")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, RopeScaling):
            raise ValueError(f"ModelConfig.rope_scaling: expected a RopeScaling or None, got {self.rope_scaling!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype: expected one of {_DTYPES}, got {self.dtype!r}")

    @classmethod
    def named(cls, name: str) -> ModelConfig:
        try:
            return _PRESETS[name]
        except KeyError:
            raise ValueError(f"unknown model config {name!r}; known: {sorted(_PRESETS)}") from None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], **overrides: Any) -> ModelConfig:
        """From a Hugging Face `config.json` dict (Llama, Qwen2, Qwen3). `overrides` replace
        fields afterwards (e.g. dtype="bfloat16", max_seq_len=4096). Raises ValueError
        naming the field for anything this decoder does not implement."""
        from arlo.model.hf_config import config_from_hf

        return config_from_hf(cls, hf, overrides)

    @classmethod
    def from_hf_dir(cls, path: str | Path, **overrides: Any) -> ModelConfig:
        """`from_hf_config` on `path/config.json`."""
        from arlo.model.hf_config import read_hf_config

        return cls.from_hf_config(read_hf_config(path), **overrides)

    @property
    def compute_dtype(self) -> Any:
        """The jnp dtype (JAX is imported here, not with the module: tokenizer-only processes skip it)."""
        import jax.numpy as jnp

        return jnp.dtype(self.dtype)

    def num_params(self) -> int:
        d, h = self.dim, self.head_dim
        attn = d * self.num_heads * h * 2 + d * self.num_kv_heads * h * 2  # q, o + k, v
        attn += (self.num_heads + 2 * self.num_kv_heads) * h * self.qkv_bias + d * self.o_bias
        attn += 2 * h * self.qk_norm
        mlp = 3 * d * self.mlp_dim
        per_layer = attn + mlp + 2 * d  # two RMSNorm scales
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        return embed + self.num_layers * per_layer + d  # + final norm


# vocab 264 = the byte tokenizer's 263 ids rounded up to a multiple of 8.
_PRESETS: dict[str, ModelConfig] = {
    "tiny": ModelConfig(vocab_size=264, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        mlp_dim=256, max_seq_len=256),
    # ~0.1M parameters: the built-in demo's policy. Sized so that SFT + RL through all the
    # services learns the demo task within minutes on 2 CPU cores (docs/quickstart.md).
    "demo": ModelConfig(vocab_size=264, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                        mlp_dim=256, max_seq_len=128),
    # Qwen3-shaped (qk_norm, grouped KV) benchmark policies of bench/grpo_tiny.py (issue 17's workloads).
    "qwen3-76k": ModelConfig(vocab_size=264, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                             mlp_dim=88, max_seq_len=128, qk_norm=True),
    "qwen3-596k": ModelConfig(vocab_size=264, dim=128, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=32,
                              mlp_dim=236, max_seq_len=128, qk_norm=True),
    # Qwen2-shaped (q/k/v biases, no qk_norm, grouped KV), ~4.0M parameters: issue 17's `4m` workload.
    "qwen2-4m": ModelConfig(vocab_size=264, dim=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                            mlp_dim=1024, max_seq_len=128, qkv_bias=True),
    # ~25M parameters: big enough to learn toy tasks, small enough for one CPU host.
    "small": ModelConfig(vocab_size=264, dim=512, num_layers=8, num_heads=8, num_kv_heads=4, head_dim=64,
                         mlp_dim=1536, max_seq_len=1024),
}
