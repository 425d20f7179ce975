"""bench/lora.py end to end at its smoke shape: every figure of issue 35's bars is written, and the
publish bytes it reports are a real Learner's `serving_state()` with and without LoRA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.timeout(600)
def test_lora_bench_writes_every_bar(tmp_path: Path) -> None:
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--smoke", "--dir", str(tmp_path / "ckpt"),
                           "--json", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "issue 35's bars" in proc.stdout
    f = json.loads(out.read_text())
    step = f["trainer_step"]
    assert step["lora"]["loss_finite"] and step["full"]["loss_finite"]
    assert 0 < step["lora"]["publish_bytes"] < step["full"]["publish_bytes"]
    assert f["publish_bytes_ratio"] == step["lora"]["publish_bytes"] / step["full"]["publish_bytes"]
    # The sync part publishes the very bytes a Learner's serving_state() serialises to.
    assert f["sync"]["lora"]["payload_bytes"] == step["lora"]["publish_bytes"]
    assert f["sync"]["full"]["payload_bytes"] == step["full"]["publish_bytes"]
    assert all(s["peak_rss_bytes"] > s["import_rss_bytes"] > 0 for s in step.values())
    assert f["trainer_rss_ratio"] > 0 and f["lora_sync_ratio"] > 0
    assert all(f["sync"][m][k] > 0 for m in ("lora", "full")
               for k in ("serialise_s", "hash_and_pull_s", "restore_and_swap_s"))
    # The one bar a tiny shape can already hold: the engine serves the trained adapters unmerged.
    assert f["mismatch"]["trained_loss_finite"] and f["lora_logprob_mismatch"] < 1e-5
    assert f["qlora_rss_ratio"].startswith("n/a")


def test_lora_bench_refuses_a_bad_flag_before_running(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--parts", "rss,nope", "--json", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown 'nope'" in proc.stderr
