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


def run_bench(tmp_path: Path, *parts: str, timeout: int) -> dict:
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--smoke", "--parts", ",".join(parts),
                           "--dir", str(tmp_path / "ckpt"), "--json", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "issue 35's bars" in proc.stdout
    return json.loads(out.read_text())


# A whole bench run (~70 s under load): slow tier. What it runs is covered in the default tier by
# test_lora.py, test_plan.py's LoRA case and tests/contract/test_inference_runs.py.
@pytest.mark.slow
@pytest.mark.timeout(600)
def test_lora_bench_plans_serves_and_syncs(tmp_path: Path) -> None:
    """The parts that run in the bench's own process: XLA's step peaks, the engine-vs-trainer
    logprobs after an adapter publish, and publish-to-served."""
    f = run_bench(tmp_path, "plan", "mismatch", "sync", timeout=560)
    # XLA's step peaks, compiled not run: the base's stored bytes order them even at the tiny shape.
    peak = {mode: p["peak_bytes"] for mode, p in f["xla_step_peak"].items()}
    assert peak["qlora_nf4"] < peak["qlora_int8"] < peak["lora"] < peak["full"]
    assert f["planned_rss_ratio"] == peak["lora"] / peak["full"]
    # The one bar a tiny shape can already hold: the engine serves the trained adapters unmerged.
    assert f["mismatch"]["trained_loss_finite"] and f["lora_logprob_mismatch"] < 1e-5
    sync = f["sync"]
    assert all(sync[m][k] > 0 for m in ("lora", "full") for k in ("serialise_s", "restore_and_swap_s"))
    assert 0 < sync["lora"]["payload_bytes"] < sync["full"]["payload_bytes"] and f["lora_sync_ratio"] > 0
    assert f["publish_bytes_ratio"] == sync["lora"]["payload_bytes"] / sync["full"]["payload_bytes"]


@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_lora_bench_measures_each_trainer_step_in_its_own_process(tmp_path: Path) -> None:
    """Part `rss`: LoRA, QLoRA and full fine-tuning steps, a subprocess each (three JAX starts
    and compiles: minutes on a loaded 2-core machine); the publish bytes are a real Learner's
    serving_state(), the very bytes the sync part sends."""
    f = run_bench(tmp_path, "rss", "sync", timeout=1400)
    step = f["trainer_step"]
    assert set(step) == {"lora", "qlora_nf4", "full"}
    assert all(s["loss_finite"] and s["peak_rss_bytes"] > s["import_rss_bytes"] > 0 for s in step.values())
    assert f["trainer_rss_ratio"] > 0 and f["qlora_rss_ratio"] > 0
    assert f["sync"]["lora"]["payload_bytes"] == step["lora"]["publish_bytes"] == step["qlora_nf4"]["publish_bytes"]
    assert f["sync"]["full"]["payload_bytes"] == step["full"]["publish_bytes"]
    assert f["publish_bytes_ratio"] == step["lora"]["publish_bytes"] / step["full"]["publish_bytes"]


def test_lora_bench_refuses_a_bad_flag_before_running(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "bench.lora", "--parts", "rss,nope", "--json", str(tmp_path / "x.json")],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "unknown 'nope'" in proc.stderr
