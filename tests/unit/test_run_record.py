"""What a run leaves behind: JSONL metrics, TensorBoard event files and the PNG plot."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from arlo.app.run_record import RunRecorder, eval_scalars, plot_run, tensorboard_scalars

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


def test_sft_and_rl_losses_are_separate_tags_and_breakdowns_get_their_own() -> None:
    sft = tensorboard_scalars({**row(1, "sft"), "grad_norm": 2.0})
    assert sft["sft/loss"] == 1.0 and sft["sft/grad_norm"] == 2.0 and "train/loss" not in sft
    assert "sft/step" not in sft and "sft/reward" not in sft  # None is no value, not 0
    rl = tensorboard_scalars({**row(4, "rl"), "kl_ref": 0.01, "reward_components": {"format": 0.5},
                              "dropped": {"stale": 3}, "phase": "rl"})
    assert rl["train/loss"] == 0.25 and rl["train/kl_ref"] == 0.01 and "sft/loss" not in rl
    assert rl["reward_components/format"] == 0.5 and rl["dropped/stale"] == 3
    assert rl["throughput/tokens_per_s"] == 90.0
    mixed = tensorboard_scalars({**row(4, "rl"), "reward_by_env": {"squares": 0.75, "arith": 0.0},
                                 "trajectories_by_env": {"squares": 4, "arith": 2}})
    assert mixed["reward_by_env/squares"] == 0.75 and mixed["reward_by_env/arith"] == 0.0
    assert mixed["trajectories_by_env/squares"] == 4


def test_evaluation_tags_overall_and_per_environment() -> None:
    envs = {"squares": {"greedy_reward": 1.0, "sampled_reward": 0.5, "pass_at_k": 1.0},
            "arith": {"greedy_reward": 0.0, "sampled_reward": 0.25, "pass_at_k": 0.5}}
    tags = eval_scalars({"greedy_reward": 0.5, "sampled_reward": 0.375, "pass_at_k": 0.75, "k": 4, "envs": envs})
    assert tags == {"eval/greedy_reward": 0.5, "eval/sampled_reward": 0.375, "eval/pass_at_k": 0.75,
                    "eval/squares/greedy_reward": 1.0, "eval/squares/sampled_reward": 0.5,
                    "eval/squares/pass_at_k": 1.0, "eval/arith/greedy_reward": 0.0,
                    "eval/arith/sampled_reward": 0.25, "eval/arith/pass_at_k": 0.5}
    # One environment: its figures are the overall ones, logged once.
    assert eval_scalars({"greedy_reward": 1.0, "envs": {"arith": {"greedy_reward": 1.0}}}) == {"eval/greedy_reward": 1.0}


def test_reward_plot_has_a_legend_per_line_gaps_phases_and_the_run_id(tmp_path: Path) -> None:
    steps = [row(s, "sft") for s in (1, 2, 3)] + [row(s, "rl") for s in (4, 5, 7, 8)]
    steps[4]["reward"] = None  # step 5: an RL step without a reward value
    evals = [{"tag": "after_sft", "step": 3, "sampled_reward": 0.1, "greedy_reward": 0.2},
             {"tag": "v2", "step": 5, "error": "inference still serves v1 < v2"},
             {"tag": "end", "step": 8, "sampled_reward": 0.6, "greedy_reward": 0.7}]
    fig = plot_run(steps, evals, tmp_path / "p.png", run_id="demo-42")
    assert (tmp_path / "p.png").read_bytes().startswith(b"\x89PNG")
    assert fig._suptitle.get_text() == "run demo-42"
    top, bottom, twin = fig.axes
    assert [t.get_text() for t in top.get_legend().get_texts()] == [
        "SFT warm start", "RL starts", "training batch reward", "held-out sampled reward", "held-out greedy reward"]
    assert [t.get_text() for t in bottom.get_legend().get_texts()] == [
        "SFT warm start", "RL starts", "trained tokens/s", "trajectories/s"]
    # Every data line is in a legend: none without a label.
    assert all(not line.get_label().startswith("_") for ax in fig.axes for line in ax.get_lines())
    reward = next(line for line in top.get_lines() if line.get_label() == "training batch reward")
    xs, ys = reward.get_xdata(), reward.get_ydata()
    assert list(xs) == [1, 2, 3, 4, 5, 7, 8]
    assert [math.isnan(y) for y in ys] == [True, True, True, False, True, False, False]  # gaps, not lines
    span = next(p for p in top.patches if p.get_label() == "SFT warm start")
    x0, x1 = span.get_x(), span.get_x() + span.get_width()
    assert (x0, x1) == (0, 3)
    start = next(line for line in top.get_lines() if line.get_label() == "RL starts")
    assert list(start.get_xdata()) == [3, 3]
    sampled = next(line for line in top.get_lines() if line.get_label() == "held-out sampled reward")
    assert list(sampled.get_xdata()) == [3, 8]  # the failed evaluation is no point


def test_a_long_warm_start_takes_at_most_a_quarter_of_the_x_axis(tmp_path: Path) -> None:
    """600 SFT steps before 80 RL steps squeezed RL into 12% of the plot (issue 33, item 7)."""
    steps = [row(s, "sft") for s in range(1, 601)] + [row(s, "rl") for s in range(601, 681)]
    fig = plot_run(steps, [{"tag": "after_sft", "step": 600, "sampled_reward": 0.1}], tmp_path / "p.png")
    top, bottom, _ = fig.axes
    lo, hi = top.transData.transform([(0, 0), (680, 0)])[:, 0]
    rl_start = top.transData.transform([(600, 0)])[0, 0]
    assert (hi - rl_start) / (hi - lo) == pytest.approx(0.75, abs=0.01)
    assert "narrower" in bottom.get_xlabel()
    short = plot_run([row(s, "sft") for s in (1, 2)] + [row(s, "rl") for s in range(3, 20)], [], tmp_path / "q.png")
    assert "narrower" not in short.axes[1].get_xlabel()  # a short warm start keeps the linear axis


def test_a_mixture_plots_each_environment_held_out(tmp_path: Path) -> None:
    envs = {"arith": {"sampled_reward": 0.2}, "squares": {"sampled_reward": 0.8}}
    evals = [{"tag": "start", "step": 0, "sampled_reward": 0.5, "greedy_reward": 0.5, "envs": envs},
             {"tag": "end", "step": 4, "sampled_reward": 0.6, "greedy_reward": 0.6,
              "envs": {**envs, "squares": {"sampled_reward": 1.0}}}]
    fig = plot_run([row(s, "rl") for s in (1, 2, 3, 4)], evals, tmp_path / "p.png")
    top = fig.axes[0]
    lines = {line.get_label(): line for line in top.get_lines()}
    assert list(lines["held-out sampled: squares"].get_ydata()) == [0.8, 1.0]
    assert list(lines["held-out sampled: arith"].get_ydata()) == [0.2, 0.2]


def test_demo_demonstrations_are_fresh() -> None:
    """arlo/data/arith_tool_sft.jsonl is what scripts/gen_demos.py makes of the demo config."""
    result = subprocess.run([sys.executable, str(ROOT / "scripts" / "gen_demos.py"), "--check"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
