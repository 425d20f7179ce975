"""A run's limits, end to end (issue 33): a first prompt the episode budget cannot hold stops
`arlo demo` at once, naming the setting and the length it needs (it used to train nothing and
wait, silently); the same run id then trains once the config is fixed, even with the admission
counter a failed run left behind."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import redis
import yaml

from tests.e2e.test_cli import arlo

# Slow tier (two `arlo demo` runs). The default tier covers each part: the refusal's message
# (tests/unit/test_rollout_agent.py, EpisodeDoesNotFit), the driver stopping on a worker's refusal
# (tests/contract/test_run_holds.py) and the failed run's count no longer holding the budget
# (tests/contract/test_rollout_admission.py::test_budget_counts_only_what_the_stream_still_holds_for_the_trainer).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def config(path: Path, run_id: str, redis_url: str, *, episode_tokens: int) -> Path:
    path.write_text(yaml.safe_dump({
        "run_id": run_id, "redis": {"url": redis_url}, "trainer": {"groups_per_step": 2},
        "rollout": {"group_size": 4, "concurrent_groups": 2, "max_episode_tokens": episode_tokens,
                    "env_config_json": '{"tool": true, "max_turns": 2}'}}))
    return path


@pytest.mark.timeout(900)  # two demos: 300 s for the refusal, 480 s for the fixed run
def test_a_prompt_over_the_episode_budget_stops_the_run_and_the_fixed_config_trains_on_the_same_run_id(
        tmp_path: Path, redis_url: str, run_id: str) -> None:
    home = tmp_path / "home"
    started = time.monotonic()
    bad = arlo("demo", "-c", str(config(tmp_path / "bad.yaml", run_id, redis_url, episode_tokens=8)),
               "--steps", "2", "--no-eval", "--json", str(tmp_path / "bad.json"), home=home, timeout=300)
    assert bad.returncode == 1, bad.stdout[-3000:] + bad.stderr[-3000:]
    said = " ".join((bad.stdout + bad.stderr).split())  # the console wraps long lines
    assert "rollout.max_episode_tokens is 8" in said and "at least" in said, said[-3000:]
    assert time.monotonic() - started < 300
    assert "max_episode_tokens" in json.loads((tmp_path / "bad.json").read_text())["failed"]

    client = redis.Redis.from_url(redis_url)
    try:
        # What a failed run left under the rollout of 33301d4: trajectories counted as accepted,
        # then dead-lettered by the trainer (no model tokens). They no longer hold the budget.
        client.set(f"arlo:{run_id}:rollout:accepted", 24)
        good = arlo("demo", "-c", str(config(tmp_path / "good.yaml", run_id, redis_url, episode_tokens=64)),
                    "--steps", "2", "--no-eval", "--json", str(tmp_path / "good.json"), home=home, timeout=480)
        assert good.returncode == 0, good.stdout[-3000:] + good.stderr[-3000:]
        assert json.loads((tmp_path / "good.json").read_text())["rl_steps"] >= 2
    finally:
        for key in client.scan_iter(f"arlo:{run_id}:*"):
            client.delete(key)
        client.close()
