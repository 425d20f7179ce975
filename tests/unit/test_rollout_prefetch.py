"""A group's Resets start before the admission gate opens (services/rollout/prefetch.py): each
episode takes its prefetched session exactly once, a retry resets afresh, a session older than
MAX_AGE_S is replaced, and nothing is left open when a group never runs. On the real env gateway
and reward cores and a real Redis stream."""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
import redis.asyncio as aioredis

from arlo.config import RolloutConfig, RolloutEnvConfig, SamplingConfig
from arlo.coord import TrajectoryStream, delete_run
from services.rollout import prefetch
from services.rollout.mixture import durable_picker
from services.rollout.types import ResetResult, RetryableError, StepResult
from services.rollout.worker import RolloutWorker
from tests.support.inprocess import TOK, CoreScorer, GatewayEnv
from tests.unit.test_rollout_core import Solver

GROUP = 3


class CountingEnv(GatewayEnv):
    """The real gateway core, its Resets and the moment of each noted."""

    def __init__(self, fail_steps: int = 0) -> None:
        super().__init__()
        self.resets: list[float] = []
        self.fail_steps = fail_steps

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        self.resets.append(asyncio.get_running_loop().time())
        return await super().reset(env_name, config_json, seed)

    async def step(self, session_id: str, action: str) -> StepResult:
        if self.fail_steps > 0:
            self.fail_steps -= 1
            raise RetryableError("env_gateway", "UNAVAILABLE", "replica went away")
        return await super().step(session_id, action)

    @property
    def open_sessions(self) -> int:
        return len(self.gw.sessions)


class HeldGate:
    """The worker's gate interface, opened by the test (the real AdmissionGate needs a served
    version; what is under test here is what the worker does before and after it opens)."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.opened_at = 0.0
        self.finished: list[int] = []

    async def acquire(self, group_size: int) -> int:
        await self.opened.wait()
        return 0

    async def mark(self, group_id: str, version: int) -> None:
        pass

    def open(self) -> None:
        self.opened_at = asyncio.get_running_loop().time()
        self.opened.set()

    async def finish(self, group_size: int, written: int, unwritten_group: str = "") -> None:
        self.finished.append(written)


async def make_worker(redis_url: str, run_id: str, env: GatewayEnv, gate: HeldGate | None, *,
                      cursor: bool = False, max_age_s: float = prefetch.MAX_AGE_S) -> RolloutWorker:
    cfg = RolloutConfig(env_name="arith", reward_fn="exact_match", group_size=GROUP, max_turns=2,
                        sampling=SamplingConfig(max_tokens=8))
    redis = aioredis.from_url(redis_url)
    tasks = durable_picker(dataclasses.replace(cfg, envs=(RolloutEnvConfig(name="arith", seeds="cursor"),)),
                           redis, run_id, random.Random(0)) if cursor else None
    return RolloutWorker(cfg, run_id=run_id, tokenizer=TOK, gen=Solver(), env=env, scorer=CoreScorer(),
                         stream=TrajectoryStream(redis, run_id, consumer="rollout"), seed=0,
                         gate=gate, tasks=tasks, prefetch_max_age_s=max_age_s)  # type: ignore[arg-type]


async def resets_done(env: CountingEnv, timeout_s: float = 10.0) -> None:
    """Returns once the group's Resets happened; fails (the task cancelled) if they do not come."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while len(env.resets) < GROUP:
        assert asyncio.get_running_loop().time() < deadline, f"{len(env.resets)} of {GROUP} Resets before the gate"
        await asyncio.sleep(0.01)


async def start_group(redis_url: str, run_id: str, env: CountingEnv, gate: HeldGate,
                      **worker: object) -> tuple[RolloutWorker, asyncio.Task[None]]:
    """A worker running one group, returned once the group's Resets were prefetched (gate shut)."""
    w = await make_worker(redis_url, run_id, env, gate, **worker)  # type: ignore[arg-type]
    run = asyncio.create_task(w.run(max_groups=1))
    await resets_done(env)
    return w, run


@pytest.fixture
async def cleanup(redis_url: str, run_id: str):
    yield
    redis = aioredis.from_url(redis_url)
    await delete_run(redis, run_id)
    await redis.aclose()


async def test_resets_run_before_the_gate_opens_and_each_is_used_once(redis_url: str, run_id: str, cleanup) -> None:
    env, gate = CountingEnv(), HeldGate()
    worker, run = await start_group(redis_url, run_id, env, gate)
    assert env.open_sessions == GROUP  # reset while the gate is shut
    gate.open()
    await asyncio.wait_for(run, 30)
    assert len(env.resets) == GROUP and all(t < gate.opened_at for t in env.resets)  # none reset again
    assert env.open_sessions == 0 and gate.finished == [GROUP]
    assert worker.stats.failed_groups == 0 and worker.stats.episodes == GROUP


async def test_a_group_that_never_passes_the_gate_leaves_no_session_open(redis_url: str, run_id: str,
                                                                         cleanup) -> None:
    env, gate = CountingEnv(), HeldGate()
    worker, run = await start_group(redis_url, run_id, env, gate)
    run.cancel()
    with pytest.raises(asyncio.CancelledError):
        await run
    assert env.open_sessions == 0 and gate.finished == []  # never admitted: nothing to finish


async def test_a_retried_episode_resets_afresh(redis_url: str, run_id: str, cleanup) -> None:
    env = CountingEnv(fail_steps=1)
    worker = await make_worker(redis_url, run_id, env, None)
    await asyncio.wait_for(worker.run(max_groups=1), 30)
    assert worker.stats.retries == 1 and len(env.resets) == GROUP + 1
    assert env.open_sessions == 0 and worker.stats.failed_groups == 0


async def test_a_leased_seed_is_drawn_and_reset_only_once_the_gate_opens(redis_url: str, run_id: str,
                                                                          cleanup) -> None:
    """A dataset's cursor leases its seed from `next`: drawn before a long wait at the gate, the
    lease would run out and the seed be handed to another group as well."""
    env, gate = CountingEnv(), HeldGate()
    worker = await make_worker(redis_url, run_id, env, gate, cursor=True)
    run = asyncio.create_task(worker.run(max_groups=1))
    await asyncio.sleep(0.3)
    cursor = worker.tasks._cursors["arith"]  # noqa: SLF001 (its lease set in Redis)
    assert env.resets == [] and await cursor._redis.zcard(cursor._pending) == 0  # noqa: SLF001
    gate.open()
    await asyncio.wait_for(run, 30)
    assert len(env.resets) == GROUP and all(t >= gate.opened_at for t in env.resets)
    assert worker.stats.failed_groups == 0 and env.open_sessions == 0


async def test_a_prefetched_session_the_gateway_lost_is_retried_not_masked(redis_url: str, run_id: str,
                                                                           cleanup) -> None:
    env, gate = CountingEnv(), HeldGate()
    worker, run = await start_group(redis_url, run_id, env, gate)
    for session_id in list(env.gw.sessions._sessions):  # noqa: SLF001 (what a gateway restart forgets)
        env.gw.close(session_id)
    gate.open()
    await asyncio.wait_for(run, 30)
    assert worker.stats.failed_groups == 0 and worker.stats.retries == GROUP
    assert len(env.resets) == 2 * GROUP and env.open_sessions == 0


async def test_a_prefetched_session_past_its_age_is_replaced(redis_url: str, run_id: str, cleanup) -> None:
    env, gate = CountingEnv(), HeldGate()
    worker, run = await start_group(redis_url, run_id, env, gate, max_age_s=0.0)
    await asyncio.sleep(0.01)
    gate.open()
    await asyncio.wait_for(run, 30)
    assert len(env.resets) == 2 * GROUP and sum(t >= gate.opened_at for t in env.resets) == GROUP
    assert env.open_sessions == 0 and worker.stats.failed_groups == 0
