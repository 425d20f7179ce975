"""Qwen2.5's published shapes as Hugging Face config.json files, for runs that need a shape and no weights.

    python -m bench.qwen_shapes qwen2.5-7b DIR   # writes DIR/config.json

`arlo plan --hf-config DIR/config.json` plans a run at that shape (docs/deploy.md, "What fits
where"); bench/accelerator.py builds random weights at the 1.5B one. The figures are the
published config.json files' (Qwen/Qwen2.5-*), the fields arlo.model.hf_config reads.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

_COMMON = dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], max_position_embeddings=32768,
               rope_theta=1000000.0, rms_norm_eps=1e-6, hidden_act="silu", torch_dtype="bfloat16")
QWEN25: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                         num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                         num_attention_heads=12, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": dict(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                       num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
    "qwen2.5-32b": dict(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                        num_attention_heads=40, num_key_value_heads=8, tie_word_embeddings=False),
}


def hf_config(shape: str) -> dict[str, Any]:
    try:
        return {**_COMMON, **QWEN25[shape]}
    except KeyError:
        raise ValueError(f"unknown shape {shape!r}; known: {sorted(QWEN25)}") from None


def write_config(shape: str, out: Path) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    path = out / "config.json"
    path.write_text(json.dumps(hf_config(shape), indent=2) + "\n")
    return path


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(QWEN25))
    parser.add_argument("out", type=Path, help="directory to write config.json into")
    args = parser.parse_args(argv)
    print(write_config(args.shape, args.out))


if __name__ == "__main__":
    main()
