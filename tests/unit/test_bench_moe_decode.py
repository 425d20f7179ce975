"""bench/moe_decode.py end to end on its tiny shape: every figure is written, and the experts a
step uses grow with the batch (up to all of them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole bench run; MoE decode is covered by test_model_qwen3_moe.py
@pytest.mark.timeout(300)
def test_moe_decode_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, "-m", "bench.moe_decode", "--shape", "tiny", "--batches", "2,16",
                    "--prompt", "8", "--new-tokens", "4", "--json", str(out)], cwd=ROOT, check=True, timeout=280)
    figures = json.loads(out.read_text())
    assert set(figures["decode"]) == {"2", "16"} and figures["params"] > 0
    for row in figures["decode"].values():
        assert row["arlo_tokens_per_s"] > 0 and row["matmul_floor_tokens_per_s"] > 0 and row["arlo_of_floor"] > 0
    used = [figures["decode"][b]["experts_used_per_step"] for b in ("2", "16")]
    assert 2 <= used[0] <= 4 and used[0] < used[1] <= 8  # top-2 of 8 experts
