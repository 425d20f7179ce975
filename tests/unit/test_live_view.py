"""The live view's progress bar (arlo/app/live.py) counts the steps the drive still plans."""

from __future__ import annotations

import io
from pathlib import Path

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


EVAL_WITH_ERRORS = {"evaluated": "end", "greedy_reward": 0.0, "sampled_reward": 0.0, "pass_at_k": 0.0, "k": 1,
                    "num_tasks": 4, "errors": 8, "min_version": 3, "max_version": 3, "wall_s": 1.0,
                    "first_error": "ValueError: prompt_token_ids has 417 tokens; at most 384 [inference.max_seq_len]"}


def test_an_evaluation_whose_episodes_failed_shows_how_many_and_why() -> None:
    # The live view printed "greedy 0.000, sampled 0.000" and nothing else; the cause was in a log (issue 33).
    out = io.StringIO()
    view = LiveRun(Console(file=out, width=400), rl_steps=5)
    with view:
        view.update(EVAL_WITH_ERRORS)
    text = " ".join(out.getvalue().split())
    assert "8 episodes failed" in text
    assert "prompt_token_ids has 417 tokens; at most 384 [inference.max_seq_len]" in text  # brackets kept, not markup


def test_the_report_repeats_an_evaluation_s_errors(monkeypatch) -> None:
    from arlo.app import cli
    from arlo.app.driver import TrainReport

    out = io.StringIO()
    monkeypatch.setattr(cli, "console", Console(file=out, width=400))

    class Recorder:
        metrics_path = out_dir = plot_path = Path("run")

    report = TrainReport(evals={"end": {k: v for k, v in EVAL_WITH_ERRORS.items() if k != "evaluated"}})
    cli._print_report(report, Recorder())
    text = " ".join(out.getvalue().split())
    assert "eval end: 8 episodes failed" in text and "prompt_token_ids has 417 tokens" in text
