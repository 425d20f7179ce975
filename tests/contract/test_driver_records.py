"""The driver's side of the run record, on a real Redis: one row per trainer step read off the
metrics stream (none skipped however fast steps come), an evaluation asked at every multiple of
`every_versions`, each result placed on the trainer's step axis, and none lost silently."""

from __future__ import annotations

import json
from pathlib import Path

import redis.asyncio as aioredis

from arlo.app.driver import RunDriver
from arlo.app.run_record import RunRecorder
from arlo.config import load_config
from arlo.coord import delete_run
from arlo.coord.evals import EvalQueue
from arlo.coord.metrics import MetricsStream


def record(step: int, version: int, phase: str) -> dict:
    return {"step": step, "version": version, "phase": phase, "time": 1000.0 + step, "loss": 1.0 / step,
            "grad_norm": 1.0, "consumed": 8 * step, "tokens_trained": 100 * step,
            **({"reward_mean": 0.1 * step, "staleness_mean": 0.5, "staleness_max": 1, "num_trajectories": 8,
                "response_length_mean": 2.5 * step} if phase == "rl" else {})}


async def test_every_step_is_a_row_and_every_eval_is_placed_or_reported(redis_url: str, run_id: str,
                                                                        tmp_path: Path) -> None:
    cfg = load_config(overrides={"run_id": run_id, "redis": {"url": redis_url},
                                 "rollout": {"eval": {"every_versions": 2}}})
    redis = aioredis.Redis.from_url(redis_url)
    recorder = RunRecorder(tmp_path / "run", run_id=run_id)
    seen: list[dict] = []
    driver = RunDriver(cfg, None, on_progress=seen.append, recorder=recorder)
    driver.metrics, driver.evals = MetricsStream(redis, run_id), EvalQueue(redis, run_id)
    worker = EvalQueue(redis, run_id, consumer="w")
    try:
        await worker.ensure_group()
        # Two SFT steps (version 0 until the warm start publishes 1), then RL steps 3..7 -> v2..v6,
        # all written before the driver reads: a 0.2 s status poll would have seen one of them.
        for step, version, phase in [(1, 0, "sft"), (2, 0, "sft"), *((s, s - 1, "rl") for s in range(3, 8))]:
            await driver.metrics.add(record(step, version, phase))
        await driver._read_steps()
        assert [r["step"] for r in seen] == [1, 2, 3, 4, 5, 6, 7]
        assert [r["reward"] for r in seen][:2] == [None, None] and seen[2]["reward"] == 0.1 * 3
        # The report counts as it reads (what an interrupted drive writes): 7 steps, 5 of them RL.
        report = driver.report
        assert (report.steps, report.rl_steps, report.trajectories) == (7, 5, 40)
        assert report.generated_tokens == sum(round(2.5 * s * 8) for s in range(3, 8))
        report.rl_wall_s = 2.0
        assert report.to_json()["rl_steps_per_s"] == 2.5 and report.to_json()["trajectories_per_s"] == 20.0
        # Asked at v2, v4, v6; a worker answers v4 with episodes sampled from v4 and v5.
        asked = [await worker.take(100, 60_000) for _ in range(3)]
        assert [(a.tag, a.min_version) for a in asked] == [("v2", 2), ("v4", 4), ("v6", 6)]
        await worker.finish(asked[1], {"tag": "v4", "requested_version": 4, "min_version": 4, "max_version": 5,
                                       "sampled_reward": 0.5, "greedy_reward": 0.5, "pass_at_k": 0.5})
        driver.eval_wait_s = 0.5  # the other two never get an answer
        await driver._collect_pending(wait=True)
    finally:
        recorder.close()
        await delete_run(redis, run_id)
        await redis.aclose()
    rows = [json.loads(line) for line in recorder.metrics_path.read_text().splitlines()]
    evals = {r["tag"]: r for r in rows if r["kind"] == "eval"}
    assert evals["v4"]["step"] == 6  # the step that published v5, the newest version it used
    assert (evals["v4"]["min_version"], evals["v4"]["max_version"]) == (4, 5)
    for tag, version in (("v2", 2), ("v6", 6)):
        assert evals[tag]["skipped"] and "no answer" in evals[tag]["error"]
        assert evals[tag]["requested_version"] == version
    assert [r["step"] for r in rows if r["kind"] == "step"] == [1, 2, 3, 4, 5, 6, 7]
