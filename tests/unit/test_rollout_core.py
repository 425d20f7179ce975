"""The rollout core on its own records: no transport imported, retryable errors retried, others
masking the group, on the real env gateway and reward cores (tests/support/inprocess.py)
and a real Redis stream."""

from __future__ import annotations

import ast
import asyncio
import re
from pathlib import Path

import redis.asyncio as aioredis

from arlo.config import RolloutConfig, SamplingConfig
from arlo.coord import TrajectoryStream, delete_run
from arlo.proto.v1 import common_pb2
from services.rollout.agent import Turn
from services.rollout.types import BackendError, RetryableError, StepResult
from services.rollout.worker import RolloutWorker
from tests.support.inprocess import TOK, CoreScorer, GatewayEnv

CORE = ["agent.py", "worker.py", "evaluation.py", "admission.py", "types.py", "prefetch.py"]


def test_the_core_imports_no_transport() -> None:
    """Only the Trajectory proto (the stream's contract) may cross into the core."""
    root = Path(__file__).parents[2] / "services" / "rollout"
    for name in CORE:
        tree = ast.parse((root / name).read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        bad = {m for m in imported if m.split(".")[0] == "grpc" or re.search(r"(?<!common)_pb2(_grpc)?$", m)
               or m.startswith("services.rollout.clients")}
        assert not bad, f"{name} imports transport: {sorted(bad)}"


class Solver:
    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        a, b = map(int, re.findall(r"(\d+)\+(\d+)=", TOK.decode(prompt))[-1])
        ids = TOK.encode(str(a + b)) + [TOK.eos_id]
        return Turn(token_ids=ids, logprobs=[-0.1] * len(ids), policy_versions=[0] * len(ids), finished_by_stop=True)


class FailingSteps(GatewayEnv):
    """The real gateway core, with the first `n` steps failing with `error`."""

    def __init__(self, error: BackendError, n: int) -> None:
        super().__init__()
        self.error, self.left = error, n

    async def step(self, session_id: str, action: str) -> StepResult:
        if self.left > 0:
            self.left -= 1
            raise self.error
        return await super().step(session_id, action)


class Stuck:
    """A generator that never answers: every episode is mid-flight when the worker stops."""

    def __init__(self) -> None:
        self.calls = 0

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        self.calls += 1
        await asyncio.Event().wait()
        raise AssertionError("unreachable")


async def test_a_stopped_worker_returns_after_its_episodes_handed_back_their_sessions(redis_url: str,
                                                                                    run_id: str) -> None:
    """Stopping the worker (the rollout service's SIGTERM path) returns only once its cancelled
    groups have cleaned up: each episode's session close was handed to the env client, which the
    service closes next (sending what is owed)."""
    redis = aioredis.from_url(redis_url)
    env, gen = GatewayEnv(), Stuck()
    cfg = RolloutConfig(env_name="arith", reward_fn="exact_match", group_size=4, concurrent_groups=2, max_turns=2,
                        sampling=SamplingConfig(max_tokens=8))
    worker = RolloutWorker(cfg, run_id=run_id, tokenizer=TOK, gen=gen, env=env, scorer=CoreScorer(),
                           stream=TrajectoryStream(redis, run_id, consumer="rollout"), seed=0)
    running = asyncio.create_task(worker.run())
    try:
        for _ in range(500):
            if gen.calls == 8:
                break
            await asyncio.sleep(0.01)
        assert gen.calls == 8 and env.closed == []
        running.cancel()
        try:
            await running
        except asyncio.CancelledError:
            pass
        assert len(set(env.closed)) == 8  # every episode's close, before run returned
    finally:
        running.cancel()
        env.shutdown()
        await delete_run(redis, run_id)
        await redis.aclose()


async def run_one_group(redis_url: str, run_id: str, env: GatewayEnv) -> tuple[RolloutWorker, list]:
    redis = aioredis.from_url(redis_url)
    cfg = RolloutConfig(env_name="arith", reward_fn="exact_match", group_size=2, max_turns=2,
                        sampling=SamplingConfig(max_tokens=8))
    worker = RolloutWorker(cfg, run_id=run_id, tokenizer=TOK, gen=Solver(), env=env, scorer=CoreScorer(),
                           stream=TrajectoryStream(redis, run_id, consumer="rollout"), seed=0)
    try:
        trajs = await worker.run_group(3)
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()
    return worker, trajs


async def test_a_retryable_error_restarts_the_episode(redis_url: str, run_id: str) -> None:
    worker, trajs = await run_one_group(redis_url, run_id, FailingSteps(RetryableError("env_gateway", "UNAVAILABLE",
                                                                                        "replica went away"), 1))
    assert worker.stats.retries == 1 and worker.stats.failed_groups == 0
    assert [t.status for t in trajs] == [common_pb2.TRAJECTORY_STATUS_OK] * 2 and all(t.reward == 1.0 for t in trajs)
    assert worker.usable(trajs) == 2


async def test_a_terminal_error_masks_the_whole_group(redis_url: str, run_id: str) -> None:
    worker, trajs = await run_one_group(redis_url, run_id, FailingSteps(BackendError("env_gateway", "NOT_FOUND",
                                                                                     "no such session"), 1))
    assert worker.stats.retries == 0 and worker.stats.failed_groups == 1
    assert [t.status for t in trajs] == [common_pb2.TRAJECTORY_STATUS_ERROR] * 2
    assert "NOT_FOUND" in trajs[0].error and worker.usable(trajs) == 0
    assert "no such session" in worker.stats.last_failure  # the heartbeat's: `arlo train` names it (holds.py)


def test_the_rollout_counts_what_the_trainer_trains_on() -> None:
    """One rule (arlo/groups.py): the worker's accepted count and the trainer's zero-variance drop agree."""
    from arlo.groups import trainable_count
    from services.trainer.core.groups import ReadyGroup, has_reward_spread

    def group(*rewards: float, failed: bool = False) -> list[common_pb2.Trajectory]:
        status = common_pb2.TRAJECTORY_STATUS_ERROR if failed else common_pb2.TRAJECTORY_STATUS_OK
        return [common_pb2.Trajectory(reward=r, status=status) for r in rewards]

    for trajs in (group(1.0, 0.0), group(1.0, 1.0), group(0.5, 0.5 + 1e-7), group(0.0, 1.0, failed=True)):
        kept_by_trainer = has_reward_spread(ReadyGroup(trajectories=trajs, entry_ids=[]))
        failed = trajs[0].status == common_pb2.TRAJECTORY_STATUS_ERROR
        assert trainable_count(trajs, filter_zero_variance=True) == (len(trajs) if kept_by_trainer and not failed else 0)
        assert trainable_count(trajs, filter_zero_variance=False) == (0 if failed else len(trajs))


class Budgets(Solver):
    """The solver, recording each turn's token budget."""

    def __init__(self) -> None:
        self.budgets: list[int] = []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        self.budgets.append(max_tokens)
        return await super().generate(prompt, max_tokens=max_tokens, session_id=session_id, seed=seed)


async def test_a_mixture_entry_sets_its_own_turn_budget(redis_url: str, run_id: str) -> None:
    """rollout.envs[i].max_tokens replaces sampling.max_tokens for that entry's episodes (0: the run's)."""
    from arlo.config import RolloutEnvConfig

    redis = aioredis.from_url(redis_url)
    short, long = RolloutEnvConfig(name="arith", label="short"), RolloutEnvConfig(name="arith", label="long",
                                                                                 max_tokens=64)
    cfg = RolloutConfig(envs=(short, long), group_size=2, max_turns=2, max_episode_tokens=256,
                        sampling=SamplingConfig(max_tokens=8))
    gen, env = Budgets(), GatewayEnv()
    worker = RolloutWorker(cfg, run_id=run_id, tokenizer=TOK, gen=gen, env=env, scorer=CoreScorer(),
                           stream=TrajectoryStream(redis, run_id, consumer="rollout"), seed=0)
    try:
        await worker.run_group(3, short)
        assert gen.budgets == [8, 8]
        await worker.run_group(3, long)
        assert gen.budgets[2:] == [64, 64]
    finally:
        env.shutdown()
        await delete_run(redis, run_id)
        await redis.aclose()
