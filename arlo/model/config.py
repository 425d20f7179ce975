"""Model hyper-parameters: one frozen dataclass, named presets, and Hugging Face configs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from arlo.choices import Dtype, LoraTarget
from arlo.model.rope import RopeScaling

_DTYPES = get_args(Dtype)
MLP_ACTIVATIONS = ("silu", "gelu_tanh")
LAYER_TYPES = ("full_attention", "sliding_attention")

LORA_TARGETS = get_args(LoraTarget)


@dataclass(frozen=True, kw_only=True, slots=True)
class LoraShape:
    """What the decoder's LoRA adapters are (arlo/model/lora.py); the run sets it from `trainer.lora`."""

    rank: int
    alpha: float
    targets: tuple[str, ...]
    rslora: bool = False
    """Scale alpha / sqrt(rank) (rank-stabilised LoRA) instead of alpha / rank."""
    init: str = "default"
    """A's initialisation: "default" (PEFT's kaiming-uniform) or "gaussian" (std 1/rank)."""
    quantize: str = "none"
    """QLoRA: the frozen base's projections stored "int8" or "nf4" (arlo/model/quantize.py); "none"."""
    quant_block: int = 64
    train_norms: bool = False
    """Every RMSNorm scale trained in full beside the adapters (held as `lora.TrainedNorm`, so it
    travels with them: optimised, published, checkpointed); False: the norms stay frozen."""
    slots: int = 0
    """Adapters held at once, stacked, each batch row using its own (an engine serving several
    runs); 0: one adapter, unstacked (the trainer, and an engine serving one run)."""

    def __post_init__(self) -> None:
        if not isinstance(self.rank, int) or self.rank < 1:
            raise ValueError(f"LoraShape.rank: must be a positive int, got {self.rank!r}")
        unknown = [t for t in self.targets if t not in LORA_TARGETS]
        if unknown or not self.targets:
            raise ValueError(f"LoraShape.targets: {unknown or 'none'} not among {list(LORA_TARGETS)}")

    @property
    def scale(self) -> float:
        return self.alpha / (self.rank**0.5 if self.rslora else self.rank)


@dataclass(frozen=True, kw_only=True, slots=True)
class MoeShape:
    """Routed experts in place of the dense MLP (Qwen3-MoE; arlo/model/moe.py), from HF's
    num_experts, num_experts_per_tok, moe_intermediate_size, norm_topk_prob,
    decoder_sparse_step and mlp_only_layers."""

    num_experts: int
    top_k: int
    """Experts each token goes to (HF num_experts_per_tok)."""
    mlp_dim: int
    """Hidden width of one expert (HF moe_intermediate_size); dense layers keep ModelConfig.mlp_dim."""
    norm_topk_prob: bool = False
    """Renormalise the k chosen probabilities to sum to 1."""
    sparse_step: int = 1
    """Layer i routes when (i + 1) % sparse_step == 0 (HF decoder_sparse_step)."""
    dense_layers: tuple[int, ...] = ()
    """Layers that keep the dense MLP whatever sparse_step says (HF mlp_only_layers)."""

    def __post_init__(self) -> None:
        for name in ("num_experts", "top_k", "mlp_dim", "sparse_step"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"MoeShape.{name}: must be a positive int, got {value!r}")
        if self.top_k > self.num_experts:
            raise ValueError(f"MoeShape.top_k: {self.top_k} exceeds num_experts={self.num_experts}")
        if not isinstance(self.dense_layers, tuple) or not all(isinstance(i, int) for i in self.dense_layers):
            raise ValueError(f"MoeShape.dense_layers: expected a tuple of layer indices, got {self.dense_layers!r}")

    def routed(self, layer: int) -> bool:
        """Whether layer `layer` has routed experts (else the dense MLP), as HF's Qwen3MoeDecoderLayer."""
        return layer not in self.dense_layers and (layer + 1) % self.sparse_step == 0


@dataclass(frozen=True, kw_only=True, slots=True)
class ModelConfig:
    """A decoder-only Llama/Qwen-style transformer (RMSNorm, GQA + RoPE, SwiGLU).

    Covers Llama 3 (rope_scaling "llama3"), Qwen2/2.5 (qkv_bias), Qwen3 (qk_norm, a head_dim
    independent of dim / num_heads) and Gemma 2/3 (the fields below qk_norm: (1 + w) norms,
    GeGLU, scaled embeddings, post norms, soft-capping, sliding-window layers); `from_hf_config`
    maps HF configs onto it.
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
    """RMSNorm over head_dim on queries and keys before RoPE (Qwen3, Gemma 3)."""
    # Gemma 2 / Gemma 3 (arlo/model/hf_gemma.py maps their config.json): each off by default, so
    # the Llama/Qwen presets keep their parameter trees and numbers.
    norm_unit_offset: bool = False
    """RMSNorm scales are stored as an offset from 1 and applied as (1 + w) (Gemma); they start at 0."""
    mlp_activation: str = "silu"
    """Gate activation of the gated MLP: "silu" (SwiGLU) or "gelu_tanh" (GeGLU, Gemma's gelu_pytorch_tanh)."""
    embed_scale: bool = False
    """Multiply token embeddings by sqrt(dim), rounded to the compute dtype as HF Gemma does."""
    post_norms: bool = False
    """RMSNorm on the attention and MLP outputs before each residual add (Gemma's post_attention and
    post_feedforward norms); the pre-MLP norm is then HF's pre_feedforward_layernorm."""
    query_pre_attn_scalar: float | None = None
    """Attention scores are q.k / sqrt(this); None: head_dim (Gemma's query_pre_attn_scalar)."""
    attn_logit_softcap: float | None = None
    """Attention scores become cap * tanh(score / cap) before masking (Gemma 2); None: no cap."""
    final_logit_softcap: float | None = None
    """Output logits become cap * tanh(logit / cap) (Gemma 2); None: no cap."""
    sliding_window: int | None = None
    """Keys fewer than this many positions behind the query are attended in sliding layers (HF
    `kv > q - sliding_window`); needed when layer_types has a sliding layer."""
    layer_types: tuple[str, ...] = ()
    """Per layer "full_attention" or "sliding_attention" (HF layer_types); empty: all full."""
    rope_local_theta: float | None = None
    """RoPE base of sliding layers, which then use plain RoPE while rope_scaling applies to full layers
    only (Gemma 3's rope_local_base_freq); None: every layer uses rope_theta and rope_scaling."""
    tie_embeddings: bool = True
    """Share the embedding table with the output projection."""
    dtype: str = "float32"
    """Compute dtype ("float32" or "bfloat16"); parameters are stored in model.param_dtype (ModelSource)."""
    lora: LoraShape | None = None
    """LoRA adapters on the projections it targets (unmerged: arlo/model/lora.py); None: none."""
    moe: MoeShape | None = None
    """Routed experts in the layers MoeShape.routed picks (Qwen3-MoE); None: every MLP dense."""

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
        if self.lora is not None and not isinstance(self.lora, LoraShape):
            raise ValueError(f"ModelConfig.lora: expected a LoraShape or None, got {self.lora!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"ModelConfig.dtype: expected one of {_DTYPES}, got {self.dtype!r}")
        if self.moe is not None and not isinstance(self.moe, MoeShape):
            raise ValueError(f"ModelConfig.moe: expected a MoeShape or None, got {self.moe!r}")
        if self.moe is not None and any(not 0 <= i < self.num_layers for i in self.moe.dense_layers):
            raise ValueError(f"ModelConfig.moe.dense_layers: {list(self.moe.dense_layers)} has an index outside "
                             f"0..{self.num_layers - 1}")
        self._check_gemma_fields()

    def _check_gemma_fields(self) -> None:
        if self.mlp_activation not in MLP_ACTIVATIONS:
            raise ValueError(f"ModelConfig.mlp_activation: expected one of {MLP_ACTIVATIONS}, "
                             f"got {self.mlp_activation!r}")
        for name in ("query_pre_attn_scalar", "attn_logit_softcap", "final_logit_softcap", "rope_local_theta"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"ModelConfig.{name}: must be > 0 or None, got {value!r}")
        if not isinstance(self.layer_types, tuple):
            raise ValueError(f"ModelConfig.layer_types: expected a tuple, got {self.layer_types!r}")
        unknown = sorted(set(self.layer_types) - set(LAYER_TYPES))
        if unknown:
            raise ValueError(f"ModelConfig.layer_types: {unknown} not among {list(LAYER_TYPES)}")
        if self.layer_types and len(self.layer_types) != self.num_layers:
            raise ValueError(f"ModelConfig.layer_types: {len(self.layer_types)} entries for "
                             f"num_layers={self.num_layers}")
        window = self.sliding_window
        if window is not None and (not isinstance(window, int) or window < 1):
            raise ValueError(f"ModelConfig.sliding_window: must be a positive int or None, got {window!r}")
        if window is None and "sliding_attention" in self.layer_types:
            raise ValueError("ModelConfig.sliding_window: layer_types has sliding_attention layers but no window")

    def is_sliding(self, layer: int) -> bool:
        """Whether layer `layer` attends over the last sliding_window positions only."""
        return bool(self.layer_types) and self.layer_types[layer] == "sliding_attention"

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
        """`from_hf_config` on `path/config.json`; errors name that file's path."""
        from arlo.model.hf_config import CONFIG_FILE, config_from_hf, read_hf_config

        return config_from_hf(cls, read_hf_config(path), overrides, source=str(Path(path) / CONFIG_FILE))

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
        per_layer = attn + mlp + 2 * d * (1 + self.post_norms)  # two RMSNorm scales, four with post_norms
        embed = self.vocab_size * d * (1 if self.tie_embeddings else 2)
        total = embed + self.num_layers * per_layer + d  # + final norm
        if self.moe is not None:  # routed layers: E experts and a router in place of the dense MLP
            routed = sum(self.moe.routed(i) for i in range(self.num_layers))
            total += routed * (self.moe.num_experts * (3 * d * self.moe.mlp_dim + d) - mlp)
        return total


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


def sequence_length(own: int, max_seq_len: int, *, checkpoint: bool) -> int:
    """The run's sequence length from the model's own (`own`: a preset's table, a checkpoint's
    max_position_embeddings) and `model.max_seq_len` (0: unset): a preset takes the setting, a
    checkpoint is only capped by it."""
    if not max_seq_len:
        return own
    return min(own, max_seq_len) if checkpoint else max_seq_len
