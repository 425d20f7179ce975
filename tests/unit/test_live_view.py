"""The live view's progress bar (arlo/app/live.py) counts the steps the drive still plans."""

from __future__ import annotations

import io

from rich.console import Console

from arlo.app.live import LiveRun


def row(step: int, *, phase: str, sft_steps: int) -> dict:
    return {"step": step, "phase": phase, "version": step, "loss": 0.5, "reward": 0.1, "staleness": 0.0,
            "trajectories_per_s": 1.0, "tokens_per_s": 10.0, "sft_steps": sft_steps}


def test_a_fresh_run_counts_its_warm_start_and_its_rl_steps() -> None:
    view = LiveRun(Console(file=io.StringIO()), rl_steps=5)
    view.update(row(1, phase="sft", sft_steps=100))
    (task,) = view.progress.tasks
    assert task.total == 100 + 5 and task.completed == 1


def test_a_run_resumed_past_its_warm_start_counts_only_its_rl_steps() -> None:
    # The trainer of a reused ARLO_HOME is at step 600 of a 100-step warm start: "RL 1/0" before.
    view = LiveRun(Console(file=io.StringIO()), rl_steps=5)
    view.update(row(601, phase="rl", sft_steps=100))
    (task,) = view.progress.tasks
    assert task.total == 5 and task.completed == 1
