"""bench/decode.py end to end on the tiny model: the table and every JSON key the issue names.

The figures themselves are for the full-size run (see the bench's docstring); this checks the
bench runs, under the host-memory settings it re-execs into, and that its numbers are sane.
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole bench run; the engine's decode is covered by test_inference_engine.py / test_inference_batching.py
@pytest.mark.timeout(360)
def test_decode_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "decode.json"
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.decode", "--model", "tiny", "--batches", "2", "--prompt", "8",
         "--new-tokens", "48", "--steps", "2", "--repeats", "1", "--naive-batches", "2", "--swap-batch", "2",
         "--json", str(out)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "roofline_fraction" in proc.stdout and "speedup_vs_naive at batch 2" in proc.stdout
    figures = json.loads(out.read_text())
    assert set(figures["per_batch"]) == {"2"}
    assert figures["roofline_fraction_b64"] is None  # batch 64 was not run
    for batch in figures["per_batch"].values():
        assert 0 < batch["roofline_fraction"] < 1.5 and batch["decode_tokens_per_s"] > 0
    assert figures["speedup_vs_naive"] == min(figures["speedup_vs_naive_by_batch"].values()) > 0
    assert set(figures["speedup_vs_naive_by_batch"]) == {"2"} and figures["naive_batch"] == 2
    assert figures["swap_latency_s"] > 0 and figures["swap_max_pause_steps"] >= 0
    if platform.libc_ver()[0] == "glibc" and os.environ.get("ARLO_DEFAULT_MALLOC") != "1":
        assert "glibc.malloc.arena_max=1" in figures["glibc_tunables"]  # it re-exec'd itself
