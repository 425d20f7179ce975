"""LoRA adapters out of arlo: a PEFT adapter directory (`adapter_config.json` +
`adapter_model.safetensors`) that `peft.PeftModel.from_pretrained(base, DIR)` loads onto the
base checkpoint with the function arlo trained (the merged export is `lora.merged_weights`).

PEFT keeps, per targeted Linear, lora_A [rank, in_features] and lora_B [out_features, rank]
and scales by lora_alpha / r (or / sqrt(r) with use_rslora), which is arlo's scale; arlo's A
and B are those transposed, with the projection's head axes flattened the way the Hugging Face
weight flattens them (arlo.model.hf's _in_proj / _out_proj).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from arlo.model.config import ModelConfig
from arlo.model.lora import TrainedNorm

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
NORMS_REFUSED = ("trainer.lora.train_norms: the run trained the RMSNorm scales too, which a PEFT LoRA adapter "
                 "cannot carry cleanly (modules_to_save matches module names by suffix); export the merged "
                 "model instead (without --adapter)")
_MODULES = {"q_lora": "self_attn.q_proj", "k_lora": "self_attn.k_proj", "v_lora": "self_attn.v_proj",
            "o_lora": "self_attn.o_proj", "gate_lora": "mlp.gate_proj", "up_lora": "mlp.up_proj",
            "down_lora": "mlp.down_proj"}


def peft_tensors(adapters: nnx.State) -> dict[str, np.ndarray]:
    """arlo's adapters under PEFT's names and layouts (float32)."""
    pairs: dict[tuple[Any, ...], dict[str, np.ndarray]] = {}
    for path, var in nnx.to_flat_state(adapters):
        if isinstance(var, TrainedNorm):
            raise ValueError(NORMS_REFUSED)
        if not isinstance(var, nnx.LoRAParam):
            continue
        *owner, attr, which = (str(p) for p in path)
        pairs.setdefault((*owner, attr), {})[which] = np.asarray(jax.device_get(var.get_value()), np.float32)
    out = {}
    for (*owner, attr), ab in pairs.items():
        if owner[0] != "layers" or attr not in _MODULES:
            raise ValueError(f"adapter {'/'.join(owner)}/{attr}: no PEFT module name for it")
        prefix = f"base_model.model.model.layers.{owner[1]}.{_MODULES[attr]}"
        r = ab["a"].shape[-1]
        out[f"{prefix}.lora_A.weight"] = np.ascontiguousarray(ab["a"].reshape(-1, r).T)
        out[f"{prefix}.lora_B.weight"] = np.ascontiguousarray(ab["b"].reshape(r, -1).T)
    return out


def export_peft_adapter(adapters: nnx.State, cfg: ModelConfig, out: str | Path, *, base_model: str = "") -> Path:
    """Writes the PEFT adapter directory `out` (created; must be empty if it exists)."""
    if cfg.lora is None:
        raise ValueError("this run trains no adapters (trainer.lora.rank is 0): export the whole model instead")
    if cfg.lora.train_norms:
        raise ValueError(NORMS_REFUSED)
    root = Path(out)
    if root.exists() and any(root.iterdir()):
        raise FileExistsError(f"{root}: exists and is not empty")
    root.mkdir(parents=True, exist_ok=True)
    save_file(peft_tensors(adapters), str(root / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": cfg.lora.rank, "lora_alpha": cfg.lora.alpha,
        "target_modules": sorted(cfg.lora.targets), "lora_dropout": 0.0, "bias": "none",
        "use_rslora": cfg.lora.rslora, "fan_in_fan_out": False, "inference_mode": True,
        "base_model_name_or_path": base_model, "init_lora_weights": True,
    }
    (root / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return root
