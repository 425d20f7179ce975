"""The trainer's SFT warm start and phase control over gRPC, on a real Redis: it starts paused
when told, runs exactly `sft.steps` SFT steps on Resume, publishes one version when the warm
start is done, pauses itself at `until_step`, and reports its phase."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import grpc
import pytest

from arlo.background import TaskGroup
from arlo.config import RunConfig, load_config
from arlo.coord import WeightPointer, connect, delete_run
from arlo.proto.v1 import trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel
from services.trainer.__main__ import start_trainer

TOKEN = "warmstart-token"


def run_config(redis_url: str, run_id: str, **sft) -> RunConfig:
    return load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url},
        "trainer": {"server": {"port": 0, "metrics_port": -1, "grace_s": 0.2}, "read_block_ms": 50,
                    "start_paused": True, "sft": {"data": "builtin:arith_tool", "steps": 3, "batch_size": 8,
                                                  "learning_rate": 0.01, **sft}},
    })


@asynccontextmanager
async def trainer(cfg: RunConfig) -> AsyncIterator[trainer_pb2_grpc.TrainerStub]:
    tasks = TaskGroup()
    running, loop = await start_trainer(cfg, tasks)
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=TOKEN) as channel:
            yield trainer_pb2_grpc.TrainerStub(channel)
    finally:
        await tasks.cancel_all()
        await loop.close()
        await running.stop(0.1)


async def wait_paused(stub: trainer_pb2_grpc.TrainerStub) -> trainer_pb2.GetStatusResponse:
    for _ in range(600):
        status = await stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
        if status.paused:
            return status
        await asyncio.sleep(0.05)
    raise AssertionError("the trainer never paused")


async def test_warm_start_runs_on_resume_and_publishes_once(redis_url: str, run_id: str,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    cfg = run_config(redis_url, run_id)
    redis = await connect(cfg.redis)
    try:
        async with trainer(cfg) as stub:
            await asyncio.sleep(0.3)
            status = await stub.GetStatus(trainer_pb2.GetStatusRequest(), timeout=5)
            assert status.paused and status.step == 0 and status.phase == "sft" and status.sft_steps == 3
            # Resume up to one step into the warm start: it stops there, nothing published yet.
            assert not (await stub.Resume(trainer_pb2.ResumeRequest(until_step=1), timeout=5)).paused
            status = await wait_paused(stub)
            assert (status.step, status.version, status.phase, status.until_step) == (1, 0, "sft", 1)
            assert status.tokens_trained > 0 and status.last_loss > 0
            assert await WeightPointer(redis, run_id).get() is None
            # The rest of the warm start: one version, published when it is done.
            await stub.Resume(trainer_pb2.ResumeRequest(until_step=3), timeout=5)
            status = await wait_paused(stub)
            assert (status.step, status.version, status.phase) == (3, 1, "rl")
            assert (await WeightPointer(redis, run_id).get()).version == 1
            # A target already reached leaves it paused; a negative one is refused.
            assert (await stub.Resume(trainer_pb2.ResumeRequest(until_step=2), timeout=5)).paused
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await stub.Resume(trainer_pb2.ResumeRequest(until_step=-1), timeout=5)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    finally:
        await delete_run(redis, run_id)
        await redis.aclose()


async def test_missing_demonstrations_fail_at_start_naming_the_file(redis_url: str, run_id: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    with pytest.raises(ValueError, match="SFT data not found: '/nonexistent.jsonl'"):
        async with trainer(run_config(redis_url, run_id, data="/nonexistent.jsonl")):
            pass


@pytest.mark.parametrize("reference", ["initial", "after_sft"])
async def test_the_kl_reference_is_the_initial_or_the_warm_started_policy(redis_url: str, run_id: str, reference: str,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """kl_ref at the first RL step: ~0 against the policy after SFT (reference after_sft); clearly
    above 0 against the initial policy, which SFT moved away from."""
    from services.trainer.batching import build_batch
    from tests.unit.test_trainer_learner import random_groups

    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    cfg = load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url},
        "trainer": {"server": {"port": 0, "metrics_port": -1, "grace_s": 0.2}, "read_block_ms": 50,
                    "sft": {"data": "builtin:arith_tool", "steps": 4, "batch_size": 8, "learning_rate": 0.02},
                    "algorithm": {"kl_coef": 0.1, "reference": reference}}})
    tasks = TaskGroup()
    running, loop = await start_trainer(cfg, tasks)
    try:
        for _ in range(600):
            if loop.phase == "rl" and loop.state.version == 1:
                break
            await asyncio.sleep(0.05)
        assert loop.phase == "rl"
        await loop.pause()
        batch = build_batch(random_groups(2, 3, seed=1), loop.learner.model_cfg.max_seq_len, loop.pad_id)
        kl = (await asyncio.to_thread(loop.learner.step, batch)).extra["kl_ref"]
        assert kl < 1e-6 if reference == "after_sft" else kl > 1e-3
    finally:
        await tasks.cancel_all()
        await loop.close()
        await running.stop(0.1)
        redis = await connect(cfg.redis)
        await delete_run(redis, run_id)
        await redis.aclose()
