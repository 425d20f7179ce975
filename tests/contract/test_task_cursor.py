"""The durable task cursor on a real Redis: seeds in order, a restart (a new TaskCursor on the same
Redis) neither skips nor repeats a finished seed, and an unfinished one is handed out again after
its lease; the mixture draws environments by weight and labels trajectories."""

from __future__ import annotations

import asyncio
import random
import re
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
    # 2 s: the calls before the sleep must stay inside seed 3's lease on a loaded machine too.
    first = TaskCursor(redis, run_id, "dataset", lease_s=2.0)
    handed = [await first.next() for _ in range(5)]
    assert handed == [0, 1, 2, 3, 4]
    for seed in (0, 1, 2, 4):
        await first.done(seed)  # seed 3's group never finished: its worker "dies" here
    del first
    second = TaskCursor(redis, run_id, "dataset", lease_s=2.0)  # a restarted worker, same Redis
    assert await second.next() == 5  # 3 is still within its lease: maybe its worker lives
    await second.done(5)
    await asyncio.sleep(2.1)
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


async def test_worker_runs_a_dataset_mixture_through_the_cursor(redis: Redis, run_id: str, tmp_path) -> None:
    """The worker's one call site: groups take cursor seeds (a restarted worker continues the
    sequence), trajectories carry their entry's label, and the row's metadata reaches the scorer."""
    import json

    from arlo.config import EnvGatewayConfig
    from arlo.coord import TrajectoryStream
    from arlo.coord.codec import decode
    from services.rollout.agent import Turn
    from services.rollout.worker import RolloutWorker
    from tests.support.inprocess import TOK, CoreScorer, GatewayEnv

    rows = [{"prompt": f"{i}*2=", "answer": str(2 * i), "level": i} for i in range(6)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    class Oracle:
        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            n = re.findall(r"(\d+)\*2=", TOK.decode(prompt))[-1]  # the row's prompt
            ids = TOK.encode(str(2 * int(n))) + [TOK.eos_id]
            return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids),
                        finished_by_stop=True)

    class RecordingScorer(CoreScorer):
        metadata: list[str] = []

        async def score(self, reward_fn: str, response: str, reference: str, metadata_json: str = ""):
            self.metadata.append(metadata_json)
            return await super().score(reward_fn, response, reference, metadata_json)

    cfg = RolloutConfig(group_size=2, concurrent_groups=1, max_turns=1, envs=(RolloutEnvConfig(
        name="dataset", label="doubles", config_json=json.dumps({"path": str(tmp_path / "t.jsonl"),
                                                                 "metadata_fields": "level"})),))
    stream = TrajectoryStream(redis, run_id, consumer="rollout", max_backlog=1000)
    await stream.ensure_group()
    scorer = RecordingScorer()
    for _ in range(2):  # the second worker is the first one restarted: same Redis, new objects
        env = GatewayEnv(config=EnvGatewayConfig(dataset_roots=(str(tmp_path),)))
        worker = RolloutWorker(cfg, run_id=run_id, tokenizer=TOK, gen=Oracle(), env=env, scorer=scorer,
                               stream=stream, tasks=durable_picker(cfg, redis, run_id, random.Random()))
        await worker.run(max_groups=3)
    entries = await redis.xrange(Keys(run_id).traj)
    trajs = [decode(fields) for _, fields in entries]
    assert len(trajs) == 12 and {t.env_name for t in trajs} == {"doubles"}
    assert all(t.reward == 1.0 for t in trajs), [(t.task_id, t.reward) for t in trajs]
    assert sorted(Counter(t.task_id for t in trajs).values()) == [2] * 6  # each of the 6 tasks once (x group)
    assert sorted(json.loads(m)["level"] for m in scorer.metadata) == sorted([i for i in range(6)] * 2)
