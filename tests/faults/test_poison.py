"""Poison never reaches the weights: a real trainer and inference (real gRPC, real Redis) fed
trajectories with non-finite values or out-of-range ids, a batch whose step is non-finite,
and NaN weights on both sides of the publish path."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from arlo.background import TaskGroup
from arlo.config import load_config
from arlo.coord import TrajectoryStream, WeightPointer, WeightPointerState, connect, delete_run
from arlo.model.weights import NonFiniteWeights, nonfinite_param, state_to_bytes
from arlo.proto.v1 import common_pb2
from services.inference.__main__ import start_inference
from services.inference.weights import WeightPullError, WeightSync
from services.trainer.__main__ import start_trainer
from services.trainer.core.trainer import REFUSED_IN_A_ROW

TOKEN = "poison-token"
PROMPT = [257, 260, 51, 43, 52, 61, 258, 261]


@pytest.fixture
async def stack(redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict]:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    server = {"port": 0, "metrics_port": -1, "grace_s": 0.5}
    cfg = load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url},
        "inference": {"server": server, "max_n": 2, "max_tokens": 8, "max_prompt_tokens": 64, "weight_poll_s": 0.2},
        "trainer": {"server": server, "groups_per_step": 1, "read_block_ms": 100},
    })
    tasks = TaskGroup()
    trainer, loop = await start_trainer(cfg, tasks)
    inference, engine = await start_inference(cfg, tasks)
    redis = await connect(cfg.redis)
    try:
        yield {"cfg": cfg, "loop": loop, "engine": engine, "redis": redis, "tasks": tasks,
               "stream": TrajectoryStream(redis, cfg.run_id, consumer="test-producer")}
    finally:
        await tasks.cancel_all()
        await inference.stop(0.1)
        await trainer.stop(0.1)
        await delete_run(redis, run_id)
        await redis.aclose()


def traj(group: str, reward: float = 0.0, **change) -> common_pb2.Trajectory:
    t = common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=PROMPT + [55, 258],
        logprobs=[0.0] * 8 + [-5.5, -5.5], loss_mask=[0] * 8 + [1, 1], policy_versions=[-1] * 8 + [0, 0],
        reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)
    for name, value in change.items():
        if name == "components":
            t.reward_components.update(value)
        elif isinstance(value, dict):  # {index: value} into a repeated field
            for i, v in value.items():
                getattr(t, name)[i] = v
        else:
            setattr(t, name, value)
    return t


POISONS = {
    "nan reward": {"reward": float("nan")},
    "inf reward": {"reward": float("inf")},
    "nan component": {"components": {"format": float("nan")}},
    "nan logprob, mask 0": {"logprobs": {2: float("nan")}},
    "-inf logprob, model token": {"logprobs": {8: float("-inf")}},
    "id >= vocab, mask 0": {"token_ids": {3: 10_000}},
    "id >= vocab, model token": {"token_ids": {8: 300}},
    "negative id": {"token_ids": {1: -1}},
}


async def wait_for(predicate, timeout_s: float = 90.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not predicate():
        assert asyncio.get_running_loop().time() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def dead_reasons(stack: dict) -> list[str]:
    entries = await stack["redis"].xrange(stack["stream"].keys.traj_dead)
    return [fields[b"dead:reason"].decode() for _, fields in entries]


async def test_poisoned_trajectories_are_dead_lettered_and_the_weights_stay_finite(stack: dict) -> None:
    loop, engine, stream = stack["loop"], stack["engine"], stack["stream"]
    for i, change in enumerate(POISONS.values()):
        await stream.add_group([traj(f"p{i}", **{"reward": 1.0, **change}), traj(f"p{i}", 0.0)])
    await stream.add_group([traj("good", 1.0), traj("good", 0.0)])
    await wait_for(lambda: loop.state.version >= 1 and engine.version >= 1)
    reasons = await dead_reasons(stack)
    assert len(reasons) == len(POISONS), reasons  # the poisoned members; their mates are acked
    assert loop.dropped()["poisoned"] == 2 * len(POISONS)  # counted per trajectory, mates included
    assert any("reward" in r for r in reasons) and any("token id" in r for r in reasons)
    assert any("logprob" in r for r in reasons)
    assert loop.state.consumed == 2 and nonfinite_param(loop.learner.state) is None
    assert nonfinite_param(engine.state) is None
    assert await stream.backlog() == 0  # the poisoned groups' mates were acknowledged too


async def test_a_non_finite_step_is_skipped_dead_lettered_and_not_published(stack: dict) -> None:
    """Finite inputs the intake passes (logprobs above its -1e4 floor), whose importance ratio
    overflows: the step is refused."""
    loop, stream = stack["loop"], stack["stream"]
    before = state_to_bytes(loop.learner.state)
    await stream.add_group([traj("boom", 1.0), traj("boom", 0.0, logprobs={8: -9e3, 9: -9e3})])
    await wait_for(lambda: loop.state.skipped_steps >= 1)
    assert loop.state.version == 0 and loop.learner.step_count == 0
    assert state_to_bytes(loop.learner.state) == before
    assert await WeightPointer(stack["redis"], stack["cfg"].run_id).get() is None  # nothing published
    assert loop.dropped()["nonfinite_step"] == 2
    assert [r.startswith("step skipped") for r in await dead_reasons(stack)] == [True, True]
    await stream.add_group([traj("after", 1.0), traj("after", 0.0)])  # training goes on
    await wait_for(lambda: loop.state.version >= 1)
    assert loop.learner.step_count == 1


def _nan_state(state):
    leaves, tree = jax.tree.flatten(state)
    leaves[0] = leaves[0].at[(0,) * leaves[0].ndim].set(jnp.nan)
    return jax.tree.unflatten(tree, leaves)


async def test_nan_weights_are_never_published_nor_installed(stack: dict) -> None:
    cfg, loop, engine = stack["cfg"], stack["loop"], stack["engine"]
    good = loop.learner.state
    loop.learner.state = _nan_state(good)
    loop.state.version = 1
    with pytest.raises(NonFiniteWeights, match="NaN or inf"):
        await loop.publisher.stored(loop.state.version)
    assert loop.store.get(0) is None
    assert await WeightPointer(stack["redis"], cfg.run_id).get() is None
    # A trainer that did publish NaN weights (not ours, or an older build): inference refuses them.
    published = loop.store.put(1, state_to_bytes(loop.learner.state))
    loop.learner.state = good
    pointer = WeightPointerState(version=1, source=loop.source, sha256=published.sha256, checkpoint_version=0,
                                 checkpoint_uri="", time=published.time)
    sync = WeightSync(engine, WeightPointer(stack["redis"], cfg.run_id), token=TOKEN, poll_s=1.0,
                      max_message_bytes=64 << 20)
    before = state_to_bytes(engine.state)
    try:
        for _ in range(2):  # the second try is refused without pulling again, and counted once
            with pytest.raises(WeightPullError, match="NaN or inf"):
                await sync.sync_to(pointer)
    finally:
        await sync.aclose()
    assert engine.version == 0 and sync.stats.refused_nonfinite == 1
    assert state_to_bytes(engine.state) == before
    assert np.isfinite(np.asarray(jax.tree.leaves(engine.state)[0])).all()


async def test_a_damaged_learner_state_stops_the_trainer_for_a_restart_not_a_stall(stack: dict) -> None:
    """NaN weights (a restore the checks did not catch, an update that overflowed): every step is
    refused. Before, each batch was dead-lettered while the trainer stayed up and green; now the
    training loop stops with MustRestart after REFUSED_IN_A_ROW refusals (the process exits and its
    restart restores the newest good checkpoint), and the in-place loop is not restarted."""
    loop, stream, tasks = stack["loop"], stack["stream"], stack["tasks"]
    loop.learner.state = _nan_state(loop.learner.state)
    for i in range(REFUSED_IN_A_ROW + 1):
        await stream.add_group([traj(f"d{i}", 1.0), traj(f"d{i}", 0.0)])
    await wait_for(lambda: tasks.fatal is not None)
    assert "steps refused in a row" in str(tasks.fatal) and "newest good checkpoint" in str(tasks.fatal)
    assert loop.state.skipped_steps == REFUSED_IN_A_ROW and "training-loop" not in tasks.restarts
    assert await WeightPointer(stack["redis"], stack["cfg"].run_id).get() is None  # nothing published


async def test_a_replica_restarts_to_follow_a_pointer_an_operator_moved_back(stack: dict) -> None:
    """Issue 33, item 10: after a hostile pointer was repaired downwards, inference stayed pinned
    to the hostile version (~25 min: it never swaps backwards). It now stops its weight sync with
    MustRestart (the process exits and restarts following the pointer), never swapping back in place."""
    loop, engine, stream, tasks, redis = stack["loop"], stack["engine"], stack["stream"], stack["tasks"], stack["redis"]
    for i in range(2):
        await stream.add_group([traj(f"v{i}", 1.0), traj(f"v{i}", 0.0)])
    await wait_for(lambda: loop.state.version >= 2 and engine.version >= 2)
    served = engine.version
    await redis.hset(stream.keys.weights, "version", 1)  # the operator's repair, out of band
    await wait_for(lambda: tasks.fatal is not None)
    assert f"went back from version {served} (served) to 1" in str(tasks.fatal)
    assert engine.version == served and "weight-sync" not in tasks.restarts


async def test_a_dead_letter_count_is_never_seen_before_its_dead_letters(stack: dict) -> None:
    """Counters a reader polls (dropped(), the heartbeat) move only once `traj:dead` holds what they count."""
    loop, stream = stack["loop"], stack["stream"]
    seen_during_moves: list[int] = []
    real_dead_letter = loop.stream.dead_letter

    async def observed(items):
        seen_during_moves.append(loop.dropped()["poisoned"])  # before the move is durable
        await real_dead_letter(items)

    loop.stream.dead_letter = observed
    await stream.add_group([traj("bad", **{"reward": 1.0, **next(iter(POISONS.values()))}), traj("bad", 0.0)])
    await wait_for(lambda: loop.dropped()["poisoned"] == 2)
    assert len(await dead_reasons(stack)) == 1
    assert seen_during_moves and all(n == 0 for n in seen_during_moves)
