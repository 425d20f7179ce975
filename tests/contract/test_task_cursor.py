"""The durable task cursor on a real Redis: seeds in order, a restart (a new TaskCursor on the same
Redis) neither skips nor repeats a finished seed, and an unfinished one is handed out again after
its lease; the mixture draws environments by weight and labels trajectories."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest
from redis.asyncio import Redis

from arlo.config import RolloutConfig, RolloutEnvConfig
from arlo.coord import Keys
from arlo.coord.keys import delete_run
from arlo.coord.tasks import TaskCursor
from services.rollout.mixture import TaskPicker, durable_picker, uses_cursor


@pytest.fixture
async def redis(redis_url: str, run_id: str) -> Redis:  # type: ignore[misc]
    client = Redis.from_url(redis_url)
    yield client
    await delete_run(client, run_id)
    await client.aclose()


@pytest.fixture
def run_id(request: pytest.FixtureRequest) -> str:
    return f"cursor-{request.node.name}-{random.randrange(1 << 30)}".replace("[", "-").replace("]", "")


async def test_restart_resumes_without_skipping_or_repeating(redis: Redis, run_id: str) -> None:
    first = TaskCursor(redis, run_id, "dataset", lease_s=0.5)
    handed = [await first.next() for _ in range(5)]
    assert handed == [0, 1, 2, 3, 4]
    for seed in (0, 1, 2, 4):
        await first.done(seed)  # seed 3's group never finished: its worker "dies" here
    del first
    second = TaskCursor(redis, run_id, "dataset", lease_s=0.5)  # a restarted worker, same Redis
    assert await second.next() == 5  # 3 is still within its lease: maybe its worker lives
    await second.done(5)
    await asyncio.sleep(0.6)
    assert await second.next() == 3  # lease over: handed out again (at least once), before new seeds
    await second.done(3)
    assert [await second.next() for _ in range(2)] == [6, 7]
    assert await second.position() == 8
    assert await redis.zcard(Keys(run_id).tasks_pending("dataset")) == 2


async def test_concurrent_workers_share_one_sequence(redis: Redis, run_id: str) -> None:
    cursors = [TaskCursor(redis, run_id, "mix", lease_s=60) for _ in range(4)]
    seeds = await asyncio.gather(*(c.next() for c in cursors for _ in range(25)))
    assert sorted(seeds) == list(range(100))


async def test_mixture_draws_by_weight_and_cursors_only_datasets(redis: Redis, run_id: str) -> None:
    cfg = RolloutConfig(envs=(RolloutEnvConfig(name="dataset", config_json='{"path": "x.jsonl"}', weight=3.0),
                              RolloutEnvConfig(name="arith", weight=1.0)))
    assert [uses_cursor(e) for e in cfg.mixture] == [True, False]
    picker = durable_picker(cfg, redis, run_id, random.Random(0))
    picks = [await picker.next() for _ in range(400)]
    counts = Counter(p.env.key for p in picks)
    assert 250 < counts["dataset"] < 350 and counts["dataset"] + counts["arith"] == 400
    assert [p.seed for p in picks if p.env.key == "dataset"] == list(range(counts["dataset"]))
    for p in picks:
        await picker.done(p)
    assert await redis.zcard(Keys(run_id).tasks_pending("dataset")) == 0


async def test_single_env_form_is_a_one_entry_mixture() -> None:
    cfg = RolloutConfig(env_name="guess_number", env_config_json='{"high": 50}', reward_fn="exact_match")
    picker = TaskPicker(cfg.mixture, random.Random(1))
    pick = await picker.next()
    assert (pick.env.name, pick.env.config_json, pick.cursor) == ("guess_number", '{"high": 50}', None)
