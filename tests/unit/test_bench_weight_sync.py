"""bench/weight_sync.py end to end on a small payload: a real trainer servicer in a subprocess,
pulled by inference's own client; the table and the JSON figures, for both ways of hashing."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow  # a whole bench run; PullWeights is covered by tests/contract/test_weight_pull.py
@pytest.mark.timeout(150)
def test_weight_sync_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, "-m", "bench.weight_sync", "--sizes-mb", "2.1", "--pulls", "2",
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "publish + pull ms" in proc.stdout
    figures = json.loads(out.read_text())
    assert set(figures["sizes"]) == {"2.1"} and figures["pulls"] == 2
    for size in figures["sizes"].values():
        assert size["sha256_pass_ms"] > 0
        for way in ("at publish", "on first pull"):
            f = size[way]
            assert 0 < f["publish_ms"] < f["publish_and_pull_ms"] and f["pull_mb_per_s"] > 0
