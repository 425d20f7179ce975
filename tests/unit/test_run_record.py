"""What a run leaves behind: JSONL metrics, TensorBoard event files and the PNG plot."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from arlo.app.run_record import RunRecorder

ROOT = Path(__file__).resolve().parents[2]


def row(step: int, phase: str) -> dict:
    return {"step": step, "version": step, "phase": phase, "loss": 1.0 / step, "reward": 0.1 * step if phase == "rl"
            else None, "staleness": 0.5 if phase == "rl" else None, "trajectories_per_s": 3.0, "tokens_per_s": 90.0,
            "elapsed_s": float(step), "time": 1.7e9 + step}


def test_recorder_writes_metrics_events_and_plot(tmp_path: Path) -> None:
    rec = RunRecorder(tmp_path / "run")
    for step in range(1, 4):
        rec.step(row(step, "sft"))
    rec.evaluation("after_sft", {"greedy_reward": 0.2, "sampled_reward": 0.1, "pass_at_k": 0.3}, step=3,
                   elapsed_s=3.5, time=1.7e9)
    for step in range(4, 8):
        rec.step(row(step, "rl"))
    rec.close()
    lines = [json.loads(line) for line in rec.metrics_path.read_text().splitlines()]
    assert [x["kind"] for x in lines].count("step") == 7 and lines[3] == {
        "kind": "eval", "tag": "after_sft", "step": 3, "elapsed_s": 3.5, "time": 1.7e9, "greedy_reward": 0.2,
        "sampled_reward": 0.1, "pass_at_k": 0.3}
    events = list((tmp_path / "run" / "tensorboard").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 200
    png = rec.plot_path.read_bytes()
    assert png.startswith(b"\x89PNG\r\n\x1a\n") and len(png) > 10_000


def test_demo_demonstrations_are_fresh() -> None:
    """arlo/data/arith_tool_sft.jsonl is what scripts/gen_demos.py makes of the demo config."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_demos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
