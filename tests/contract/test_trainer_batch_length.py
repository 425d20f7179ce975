"""The trainer service pads an RL batch no further than the rollout's longest episode
(rollout.max_episode_tokens, services/trainer/batching.py bucket_length), and its start-up
warm-up compiled exactly that length: issue 17's 596k workload padded 48-token episodes to 64."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from arlo.coord import TrajectoryStream
from arlo.proto.v1 import common_pb2
from services.trainer.warmup import length_buckets
from tests.support.trainer import trainer_config, trainer_service


def trajectory(group: str, reward: float, length: int) -> common_pb2.Trajectory:
    prompt = 16
    return common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=2, token_ids=[65] * length,
        logprobs=[0.0] * prompt + [-5.5] * (length - prompt), loss_mask=[0] * prompt + [1] * (length - prompt),
        policy_versions=[-1] * prompt + [0] * (length - prompt), reward=reward, status=common_pb2.TRAJECTORY_STATUS_OK)


@pytest.mark.timeout(180)
async def test_a_batch_of_episodes_within_the_budget_is_padded_to_the_budget_not_the_power_of_two(
        redis_url: str, run_id: str) -> None:
    cfg = trainer_config(redis_url, run_id, rollout={"max_episode_tokens": 48, "group_size": 2})
    assert length_buckets(48, 128) == [16, 32, 48]  # what the warm-up compiles
    shapes: list[tuple[int, ...]] = []
    async with trainer_service(cfg) as (_, loop, redis):
        step = loop.replica.step

        def recording_step(batch):  # the real step, its batch's shape noted
            shapes.append(batch.tokens_bt.shape)
            return step(batch)

        loop.replica.step = recording_step  # type: ignore[method-assign]
        stream = TrajectoryStream(redis, run_id, consumer="test-producer")
        for length in (40, 47):  # two steps' groups; the longer within the 48-token budget
            group = uuid.uuid4().hex
            for reward in (1.0, 0.0):
                await stream.add(trajectory(group, reward, length))
        deadline = asyncio.get_running_loop().time() + 120
        while loop.state.version < 2:
            assert asyncio.get_running_loop().time() < deadline, "no two steps within 120 s"
            await asyncio.sleep(0.05)
    assert shapes == [(2, 48), (2, 48)]
