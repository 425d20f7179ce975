"""bench/real_model.py end to end on a tiny checkpoint of the same family: every figure is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(420)
def test_real_model_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, "-m", "bench.real_model", "--shape", "tiny", "--dir", str(tmp_path / "ckpt"),
                    "--batches", "1,16", "--new-tokens", "8", "--groups", "2", "--group-size", "2",
                    "--step-tokens", "8", "--json", str(out)], cwd=ROOT, check=True, timeout=360)
    figures = json.loads(out.read_text())
    assert figures["decode_over_hf_b16"] > 0 and set(figures["decode"]) == {"1", "16"}
    assert all(r["matmul_floor_tokens_per_s"] > 0 and r["ceiling_over_hf"] > 0 for r in figures["decode"].values())
    assert figures["load_inference_bf16"]["peak_over_base_bytes"] > 0
    step = figures["grpo_step"]
    assert step["loss_finite"] == 1.0 and step["bytes_per_publish"] > 0
    assert all(step[k] > 0 for k in ("generation_s", "intake_s", "train_step_s", "publish_s", "swap_s"))
