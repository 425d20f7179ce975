"""The allowed choices of each string setting, declared once.

`arlo.config` types its fields with these; its loader checks them (the error names the field
and lists the choices), and other modules read them with `typing.get_args`. No imports but
`typing`: the sandbox trampoline, which runs under a bare `python3 -S`, reads `Isolation`.
"""

from __future__ import annotations

from typing import Literal

Dtype = Literal["float32", "bfloat16"]
Advantage = Literal["grpo", "dr_grpo", "rloo", "reinforce_pp", "gae"]
RatioLevel = Literal["token", "sequence"]
Aggregation = Literal["token_mean", "seq_mean_token_mean", "seq_sum_norm"]
KlKind = Literal["k1", "k2", "k3"]
Reference = Literal["initial", "after_sft"]
"""The KL reference: the loaded (initial) policy, or the policy after the SFT warm start."""
Remat = Literal["none", "full", "dots"]
LoraTarget = Literal["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
"""Projections a LoRA adapter can attach to, by their Hugging Face (and PEFT) module names."""
LoraQuantize = Literal["none", "int8", "nf4"]
"""QLoRA: how the frozen base's projection weights are stored (arlo/model/quantize.py)."""
LoraInit = Literal["default", "gaussian", "pissa", "olora"]
"""Initialisation of LoRA's A (B is zero): PEFT's "default" (kaiming-uniform) or "gaussian"; "pissa"
and "olora" are named so that choosing them gets an error that says why (they shift the base)."""
SftTooLong = Literal["drop", "truncate_left", "error"]
"""What the SFT warm start does with a demonstration longer than the model's context."""
Isolation = Literal["auto", "bwrap", "unshare", "none"]
"""Sandbox isolation; "auto" picks the best of the others that works here."""
ToolFormat = Literal["auto", "hermes", "llama3", "qwen3_coder", "mistral", "gemma"]
"""How a model writes tool calls (arlo/tool_calls.py); "auto" reads any of them by their markers."""
AttentionKernel = Literal["xla", "pallas"]
"""How decode reads the paged KV: "xla" gathers each row's window and attends it; "pallas" attends
the pages in place with the paged-attention kernels JAX ships (arlo/model/paged_attention.py)."""
