"""What holds a run that makes no step, read from a real Redis (arlo/app/holds.py): the message
`arlo train` stops with names the counter or the limit (issue 33: it said "the service logs say
why", and they did not)."""

from __future__ import annotations

import time

from arlo.app.holds import RunHolds
from arlo.config import RedisConfig, load_config
from arlo.coord import Heartbeat, RolloutStatus, TrajectoryStream, connect, delete_run
from arlo.proto.v1 import common_pb2, trainer_pb2


def run_config(redis_url: str, run_id: str):
    return load_config(overrides={"run_id": run_id, "redis": {"url": redis_url},
                                  "trainer": {"groups_per_step": 2, "max_staleness": 1}, "rollout": {"group_size": 4}})


async def test_the_message_names_the_spent_admission_budget_and_the_dead_letters(redis_url: str, run_id: str) -> None:
    cfg = run_config(redis_url, run_id)
    redis = await connect(RedisConfig(url=redis_url))
    try:
        holds = RunHolds(redis, cfg)
        status = trainer_pb2.GetStatusResponse()
        assert "no rollout worker is beating" in await holds.explain(status)
        await Heartbeat(redis, run_id, service="rollout", instance="w1").beat(**RolloutStatus(running=9).fields())
        stream = TrajectoryStream(redis, run_id, consumer="trainer")
        await stream.ensure_group()
        await stream.add_group([common_pb2.Trajectory(id=f"t{i}", group_id="g", group_size=4) for i in range(4)])
        await redis.set(f"arlo:{run_id}:rollout:accepted", 12)
        said = await holds.explain(status)
        # 9 running + 4 queued (the backlog caps the counters' 12) of (1 + 1) x batch 8 leave 3: no group of 4.
        assert ("the admission budget is spent: 9 episodes running + 4 queued for the trainer (the stream's backlog 4, "
                "at most rollout:accepted 12 - traj:dropped_stale 0 - version 0 x batch 8) leave room for 3") in said
        assert "trainer.max_staleness 1" in said
        entries = await stream.read(count=4, block_ms=0)
        await stream.dead_letter([(e.entry_id, e.trajectory, "no model tokens (loss_mask all 0)") for e in entries[:1]])
        said = await holds.explain(status)
        assert "1 trajectories in arlo:" in said and "'no model tokens (loss_mask all 0)'" in said
        assert "admission budget" not in said  # the dead letter holds no budget: 9 + 3 leave room for 4
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_a_refusal_counts_only_from_a_worker_beating_after_the_drive_began(redis_url: str, run_id: str) -> None:
    cfg = run_config(redis_url, run_id)
    redis = await connect(RedisConfig(url=redis_url))
    try:
        holds = RunHolds(redis, cfg)
        beat = Heartbeat(redis, run_id, service="rollout", instance="w1")
        await beat.beat(**RolloutStatus(refused="the first prompt is 300 tokens").fields())
        began = time.time()
        # A worker of an earlier drive (killed since) left its refusal: not this drive's.
        assert await holds.refused(began) is None
        await beat.beat(**RolloutStatus(refused="the first prompt is 300 tokens").fields())
        assert await holds.refused(began) == "the first prompt is 300 tokens"
        assert "the rollout refuses episodes: the first prompt is 300" in await holds.explain(
            trainer_pb2.GetStatusResponse())
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_the_message_names_why_the_rollout_s_groups_fail(redis_url: str, run_id: str) -> None:
    # Every group failing (an MCP server that dies at start) stalled the run with "0 trajectories
    # queued, 8 needed": the cause was only in the rollout's and the gateway's logs (issue 33).
    cfg = run_config(redis_url, run_id)
    redis = await connect(RedisConfig(url=redis_url))
    try:
        why = "env: UNAVAILABLE: MCP server 'tools' is unavailable: ...; the server's stderr ends: No module named 'mcp'"
        await Heartbeat(redis, run_id, service="rollout", instance="w1").beat(
            **RolloutStatus(failed_groups=3, last_failure=why).fields())
        said = await RunHolds(redis, cfg).explain(trainer_pb2.GetStatusResponse())
        assert f"the rollout's episodes fail (3 groups so far), the last: {why}" in said
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_the_message_starts_with_what_the_trainer_says_it_waits_for(redis_url: str, run_id: str) -> None:
    """The core names the bound that holds it (`waiting_on` in the trainer's heartbeat): `arlo
    train`'s no-step message and `arlo status` say it (issue 33, item 2: "the logs say why")."""
    cfg = run_config(redis_url, run_id)
    redis = await connect(RedisConfig(url=redis_url))
    try:
        why = "2 of 2 ready groups wait for a checkpoint (held 8 of 8)"
        await Heartbeat(redis, run_id, service="trainer", instance="t1").beat(waiting_on=why, version=3)
        said = await RunHolds(redis, cfg).explain(trainer_pb2.GetStatusResponse())
        assert said.startswith(f"the trainer waits: {why}")
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()
