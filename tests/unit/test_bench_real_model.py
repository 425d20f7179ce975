"""bench/real_model.py end to end on a tiny checkpoint of the same family: every figure is written."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers", reason="needs the hf extra: pip install -e '.[hf]'")
ROOT = Path(__file__).resolve().parents[2]
# Whole bench runs (a minute or more each under load): slow tier. The default tier checks the bench's
# arguments (test_bench_args.py), the tiny checkpoint family's logits and greedy decode against
# transformers (test_hf_reference.py) and the step anatomy it reports (test_step_anatomy.py).
pytestmark = pytest.mark.slow


@pytest.mark.timeout(420)
def test_real_model_bench_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, "-m", "bench.real_model", "--shape", "tiny", "--dir", str(tmp_path / "ckpt"),
                    "--batches", "1,16", "--new-tokens", "8", "--groups", "2", "--group-size", "2",
                    "--step-tokens", "8", "--step-in-process", "--json", str(out)], cwd=ROOT, check=True, timeout=360)
    figures = json.loads(out.read_text())
    assert figures["decode_over_hf_b16"] > 0 and set(figures["decode"]) == {"1", "16"}
    assert all(r["matmul_floor_tokens_per_s"] > 0 and r["ceiling_over_hf"] > 0 for r in figures["decode"].values())
    assert figures["load_inference_bf16"]["peak_over_base_bytes"] > 0
    step = figures["grpo_step"]
    assert step["loss_finite"] == 1.0 and step["bytes_per_publish"] > 0
    assert all(step[k] > 0 for k in ("generation_s", "intake_s", "train_step_s", "publish_s", "swap_s"))


@pytest.mark.timeout(180)
def test_real_model_bench_splits_a_step_through_the_services(tmp_path: Path) -> None:
    """The default step: the local services run two RL steps of the tiny checkpoint; every phase of
    the split is measured, and each publish carries the serving dtype's bytes of the model."""
    from arlo.model import state_to_bytes
    from arlo.model.source import resolve_model

    out = tmp_path / "figures.json"
    subprocess.run([sys.executable, "-m", "bench.real_model", "--shape", "tiny", "--dir", str(tmp_path / "ckpt"),
                    "--skip-load", "--skip-decode", "--groups", "2", "--group-size", "2", "--step-tokens", "8",
                    "--micro-batch", "2", "--step-home", str(tmp_path / "home"), "--json", str(out)],
                   cwd=ROOT, check=True, timeout=150)
    figures = json.loads(out.read_text())
    assert "decode" not in figures and "grpo_step" not in figures
    split = figures["service_step"]
    assert [s["version"] for s in split["steps"]] == [1, 2]
    phases = ("generation_s", "generation_engine_s", "intake_s", "train_step_s", "publish_s", "pull_s", "verify_s",
              "swap_s", "publish_to_serving_s", "pointer_to_serving_s")
    for step in split["steps"]:
        assert all(step[k] > 0 for k in phases), step
        assert 0 < step["generation_engine_share"] <= 1 and 0 < step["response_length_mean"] <= 8
    steady = split["steps"][1]
    # The steady step's critical path (bench/step_anatomy.py) accounts for its interval.
    assert 0.5 * steady["step_s"] < sum(steady["critical_path_s"].values()) <= 1.2 * steady["step_s"]
    source = resolve_model(name="", path=str(tmp_path / "ckpt"), tokenizer="", seed=0, max_seq_len=40,
                           param_dtype="bfloat16")
    assert split["bytes_per_publish"] == len(state_to_bytes(source.initial_state(dtype="bfloat16")))
    assert 0 < split["publish_overhead_bytes"] < 4096  # msgpack's keys and headers over the raw parameters
    assert set(split["peak_rss_bytes"]) == {"inference", "trainer", "rollout", "env_gateway", "reward"}
