"""bench/accelerator.py: its --smoke run end to end on a CPU (every part in its own process, as
on a GPU), and the bandwidth arithmetic its HBM fraction rests on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from arlo.model import ModelConfig
from bench.accelerator import parse_args, peak_bandwidth, step_bytes

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole bench run; its arithmetic and arguments are checked below, in the default tier
def test_smoke_run_reports_decode_and_transformers_figures(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "bench.accelerator", "--smoke", "--json", str(tmp_path / "a.json")],
                         cwd=ROOT, capture_output=True, text=True, timeout=280, env={**os.environ, "COLUMNS": "200"})
    assert out.returncode == 0, out.stderr[-3000:]
    fig = json.loads((tmp_path / "a.json").read_text())
    for part in ("decode", "decode_pallas", "hf"):
        assert "skipped" not in fig[part], fig[part]
    assert fig["decode_pallas"]["attention_kernel"] == "pallas"
    for decode in (fig["decode"]["per_batch"], fig["decode_pallas"]["per_batch"]):
        assert set(decode) == {"1", "4"}
        for row in decode.values():
            assert row["decode_tokens_per_s"] > 0 and 0 < row["hbm_fraction"] and row["bytes_per_step"] > 0
    assert fig["decode"]["peak_from"].startswith("measured")  # a CPU is in no datasheet table
    assert set(fig["hf"]["eager_tokens_per_s"]) == {"1", "4"} and fig["hf"]["static_compiled"] is False
    assert all(v > 0 for v in [*fig["hf"]["eager_tokens_per_s"].values(), *fig["hf"]["static_tokens_per_s"].values()])
    assert fig["step"] == {"skipped": "--smoke"}
    assert "HBM fraction" in out.stdout


@pytest.mark.parametrize(("kind", "peak"), [("NVIDIA H100 80GB HBM3", 3.35e12), ("NVIDIA H100 PCIe", 2.0e12),
                                            ("NVIDIA H200", 4.8e12)])
def test_peak_bandwidth_by_device_kind_and_override(kind: str, peak: float) -> None:
    assert peak_bandwidth(kind, 0.0)[0] == peak
    assert peak_bandwidth(kind, 1e12) == (1e12, "--peak-bw")


def test_step_bytes_are_the_weights_once_per_step_and_each_rows_cache() -> None:
    cfg = ModelConfig.from_hf_config({"model_type": "qwen2", "vocab_size": 100, "hidden_size": 32,
                                      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                      "num_key_value_heads": 2, "max_position_embeddings": 64,
                                      "tie_word_embeddings": False}, dtype="bfloat16")
    chunk = SimpleNamespace(steps=2, rows=3, positions=30)  # 3 rows holding 30 tokens, then 33
    weights = (cfg.num_params() - 100 * 32) * 2  # untied: the embedding table is read a row per token
    kv_token = 2 * 2 * 2 * 8 * 2  # k and v, 2 layers, 2 kv heads, head_dim 8, bf16
    assert step_bytes(cfg, chunk, 2) == 2 * weights + (30 + 33) * kv_token


def test_smoke_defaults_and_the_step_arguments_real_model_services_reads() -> None:
    args = parse_args(["--smoke"])
    assert (args.batches, args.prompt, args.new_tokens, args.hf_static_batches) == ([1, 4], 16, 16, [1])
    full = parse_args([])
    assert full.batches == [1, 16, 64, 256] and full.hf_static_batches == [1, 64]
    assert (full.groups, full.group_size, full.step_tokens, full.param_dtype) == (8, 8, 512, "bfloat16")
