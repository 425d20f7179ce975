"""Per-environment figures of a mixture: the trainer's step record breaks the batch's reward down
by environment (the mixture entry's label each trajectory carries), next to the overall figures it
always had; the live view and `arlo status` show each environment's evaluation and training reward."""

from __future__ import annotations

import pytest

from arlo.app.live import eval_text
from arlo.app.run_record import eval_scalars
from arlo.app.status_view import diagnostics_line as _diagnostics_line
from arlo.config import ConfigError, load_config
from arlo.proto.v1 import common_pb2
from services.trainer.diagnostics import UNNAMED_ENV, step_record
from services.trainer.learner import StepMetrics


def traj(env_name: str, reward: float) -> common_pb2.Trajectory:
    return common_pb2.Trajectory(token_ids=[1, 2, 3], loss_mask=[0, 1, 1], policy_versions=[-1, 4, 4],
                                 reward=reward, env_name=env_name, num_turns=1, finish_reason="done")


def test_a_mixed_batch_reports_reward_per_environment() -> None:
    batch = [traj("squares", 1.0), traj("squares", 0.0), traj("squares", 1.0), traj("squares", 1.0),
             traj("arith", 0.0), traj("arith", 0.0), traj("", 1.0)]
    metrics = StepMetrics(loss=0.1, reward_mean=4 / 7, clip_fraction=0.0, approx_kl=0.0, grad_norm=1.0, num_tokens=14)
    record = step_record(phase="rl", step=3, version=5, metrics=metrics, counters={}, trajectories=batch,
                         trained_from=4, now=1.0)
    assert record["reward_by_env"] == {"arith": 0.0, "squares": 0.75, UNNAMED_ENV: 1.0}
    assert record["trajectories_by_env"] == {"arith": 2, "squares": 4, UNNAMED_ENV: 1}
    assert record["reward_mean"] == 4 / 7 and record["num_trajectories"] == 7  # the overall figures stay


def test_an_sft_step_has_no_per_environment_figures() -> None:
    metrics = StepMetrics(loss=0.1, reward_mean=0.0, clip_fraction=0.0, approx_kl=0.0, grad_norm=1.0, num_tokens=4)
    record = step_record(phase="sft", step=1, version=0, metrics=metrics, counters={}, now=1.0)
    assert "reward_by_env" not in record


def test_the_displays_show_each_environment() -> None:
    envs = {"squares": {"greedy_reward": 1.0, "sampled_reward": 0.5, "pass_at_k": 1.0, "errors": 0},
            "arith": {"greedy_reward": 0.0, "sampled_reward": 0.25, "pass_at_k": 0.5, "errors": 2}}
    result = {"greedy_reward": 0.5, "sampled_reward": 0.375, "pass_at_k": 0.75, "k": 4, "num_tasks": 8,
              "min_version": 3, "max_version": 3, "wall_s": 1.5, "envs": envs}
    assert eval_text("end", result).splitlines() == [
        "eval end (ran on v3): greedy 0.500, sampled 0.375, pass@4 0.750 over 8 held-out tasks (1.5s)",
        "  squares: greedy 1.000, sampled 0.500, pass@4 1.000",
        "  arith: greedy 0.000, sampled 0.250, pass@4 0.500, 2 errors"]
    assert len(eval_text("end", {**result, "envs": {"arith": envs["arith"]}}).splitlines()) == 1
    line = _diagnostics_line({"step": 3, "phase": "rl", "version": 5, "loss": 0.1, "reward_mean": 0.5,
                              "reward_by_env": {"arith": 0.0, "squares": 0.75},
                              "trajectories_by_env": {"arith": 2, "squares": 4}})
    assert line.endswith("reward by environment (trajectories): arith 0.000 (2), squares 0.750 (4)")


@pytest.mark.parametrize("label", ["a b", "gsm8k/train", "[red]x", "x:y", "tab\t"])
def test_a_label_tensorboard_would_rewrite_is_refused(label: str) -> None:
    """A label names TensorBoard tags, which keep only [-/\\w.]: "a b" would be logged as "a_b",
    one series with an entry labelled a_b; "/" nests the tag; "[" is rich markup in the displays."""
    for rollout, where in (({"envs": [{"name": "arith", "label": label}]}, r"rollout.envs\[0\].label"),
                           ({"tasks": {"path": "t.jsonl", "label": label}}, r"rollout.tasks.label")):
        with pytest.raises(ConfigError, match=where + r": must be letters, digits, '_', '-' or '.'"):
            load_config(overrides={"rollout": rollout})


def test_labels_with_dots_and_dashes_are_tags_as_they_are() -> None:
    cfg = load_config(overrides={"rollout": {"envs": [{"name": "arith", "label": "arith-v1.2"},
                                                      {"name": "arith", "label": "arith_hard"}]}})
    assert [e.key for e in cfg.rollout.mixture] == ["arith-v1.2", "arith_hard"]
    figures = {"greedy_reward": 1.0, "sampled_reward": 1.0, "pass_at_k": 1.0}
    tags = eval_scalars({**figures, "envs": {"arith-v1.2": figures, "arith_hard": figures}})
    assert {"eval/arith-v1.2/greedy_reward", "eval/arith_hard/pass_at_k"} <= set(tags)
