"""examples/lora_demo.yaml is the built-in demo with LoRA, and nothing else changed.

`arlo demo -c` reads a config whole (it is not merged over arlo/data/demo.yaml), so the example
repeats the demo's every field; this keeps the two from drifting apart, so the LoRA curve in
docs/quickstart.md stays comparable with full fine-tuning's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from arlo.config import load_config
from arlo.config.trainer import LoraConfig

ROOT = Path(__file__).resolve().parents[2]
LORA_DEMO = ROOT / "examples" / "lora_demo.yaml"
# What the example may change: its run (so it never resumes the built-in demo's), LoRA, the rates.
MAY_CHANGE = {"run_id", "trainer.learning_rate", "trainer.lora", "trainer.sft.learning_rate"}


def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """Leaves by dotted path; `trainer.lora` stays one leaf (the demo has no such section)."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict) and path != "trainer.lora":
            out.update(flat(value, f"{path}."))
        else:
            out[path] = value
    return out


def test_the_lora_demo_is_the_builtin_demo_with_lora_and_its_learning_rates() -> None:
    demo = flat(yaml.safe_load((ROOT / "arlo" / "data" / "demo.yaml").read_text()))
    lora = flat(yaml.safe_load(LORA_DEMO.read_text()))
    differ = {k for k in demo.keys() | lora.keys() if demo.get(k) != lora.get(k)}
    assert {"run_id", "trainer.lora"} <= differ <= MAY_CHANGE, differ - MAY_CHANGE
    cfg = load_config(LORA_DEMO)
    assert cfg.trainer.lora.rank == 8 and cfg.trainer.lora.targets == LoraConfig().targets  # every projection
