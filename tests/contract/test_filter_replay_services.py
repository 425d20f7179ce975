"""Filter replay through the services (issue 32's bar): bf16 serving with top_k 5, the rollout's
own InferenceClient asking a real inference server for each token's kept set, the trajectories
through the real Redis stream into a real trainer service. On-policy the trainer scores every
sampled token over exactly the set that sampled it: `logprob_outside` 0, the numeric
`logprob_mismatch` <= 0.05. The engine-level comparison with the trainer's own filter (which
does leave tokens outside on the same settings) is tests/unit/test_trainer_bf16_logprobs.py."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator

import grpc
import numpy as np
import pytest

from arlo.background import TaskGroup
from arlo.config import RunConfig, load_config
from arlo.coord import TrajectoryStream, connect, delete_run
from arlo.coord.metrics import MetricsStream
from arlo.filter_replay import NOT_KEPT, run_kept_width, unpack_kept
from arlo.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from arlo.rpc import make_channel
from services.inference.__main__ import start_inference
from services.rollout.clients import InferenceClient
from services.trainer.__main__ import start_trainer

TOKEN = "filter-replay-token"
PROMPT = [257, 260, 51, 43, 52, 61, 258, 261]
TOP_K, GROUPS, GROUP_SIZE, MAX_TOKENS = 5, 4, 8, 40


def run_config(redis_url: str, run_id: str) -> RunConfig:
    server = {"port": 0, "metrics_port": -1, "grace_s": 0.2}
    return load_config(overrides={
        "run_id": run_id, "redis": {"url": redis_url},
        "model": {"dtype": "bfloat16", "param_dtype": "bfloat16"},
        "rollout": {"group_size": GROUP_SIZE, "sampling": {"temperature": 1.3, "top_k": TOP_K}},
        "inference": {"server": server, "max_n": 8, "max_tokens": MAX_TOKENS, "max_prompt_tokens": 64,
                      "weight_poll_s": 0.2},
        "trainer": {"server": server, "groups_per_step": GROUPS, "read_block_ms": 50, "max_staleness": 0,
                    "start_paused": True},
    })


@pytest.fixture
async def services(redis_url: str, run_id: str, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[dict]:
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    cfg = run_config(redis_url, run_id)
    tasks = TaskGroup()
    trainer, loop = await start_trainer(cfg, tasks)
    inference, _ = await start_inference(cfg, tasks)
    redis = await connect(cfg.redis)
    try:
        yield {"cfg": cfg, "loop": loop, "redis": redis, "inference": f"127.0.0.1:{inference.port}"}
    finally:
        await tasks.cancel_all()
        await inference.stop(0.1)
        await trainer.stop(0.1)
        await delete_run(redis, run_id)
        await redis.aclose()


def trajectory(group: str, turn, reward: float) -> common_pb2.Trajectory:
    n = len(turn.token_ids)
    return common_pb2.Trajectory(
        id=uuid.uuid4().hex, group_id=group, group_size=GROUP_SIZE, token_ids=PROMPT + turn.token_ids,
        logprobs=[0.0] * len(PROMPT) + turn.logprobs, loss_mask=[0] * len(PROMPT) + [1] * n,
        policy_versions=[-1] * len(PROMPT) + turn.policy_versions, reward=reward,
        status=common_pb2.TRAJECTORY_STATUS_OK, kept_token_ids=turn.kept_token_ids)


async def test_bf16_top_k_tokens_are_scored_over_the_kept_sets_the_server_returned(services: dict) -> None:
    cfg = services["cfg"]
    async with make_channel(services["inference"], token=TOKEN) as channel:
        # As the rollout's __main__ builds it: run_kept_width, and its default batch window (GenerateBatch).
        client = InferenceClient(channel, cfg.rollout.sampling, stop_token_ids=[], timeout_s=120, run_id=cfg.run_id,
                                 batch_window_s=cfg.rollout.batch_window_s, return_kept=run_kept_width(cfg) > 0)
        assert client.return_kept and client.batch_window_s > 0
        turns = await asyncio.gather(*(client.generate(PROMPT, max_tokens=MAX_TOKENS, seed=seed)
                                       for seed in range(GROUPS * GROUP_SIZE)))
    for turn in turns:  # each token is in its own kept set, at most top_k wide
        kept = unpack_kept(turn.kept_token_ids, tokens=len(turn.token_ids), width=TOP_K)
        assert all(t in row for t, row in zip(turn.token_ids, kept, strict=True))
        assert ((kept == NOT_KEPT) | (kept >= 0)).all()
    stream = TrajectoryStream(services["redis"], cfg.run_id, consumer="test-producer")
    for g in range(GROUPS):
        members = turns[g * GROUP_SIZE:(g + 1) * GROUP_SIZE]
        await stream.add_group([trajectory(f"g{g}", t, float(i % 2)) for i, t in enumerate(members)])
    loop = services["loop"]
    loop.resume()
    metrics = MetricsStream(services["redis"], cfg.run_id)
    for _ in range(3600):  # the step's record is written after its version is published (compiles first)
        if (record := await metrics.latest()) is not None:
            break
        await asyncio.sleep(0.05)
    assert record is not None and record["step"] == 1, (loop.state, loop.dropped())
    assert record["logprob_outside"] == 0.0, record
    assert 0 < record["logprob_mismatch"] <= 0.05, record  # bf16 numerics, not floors
    assert np.isfinite(record["loss"]) and record["dropped"]["malformed"] == 0


async def test_kept_sets_are_refused_where_the_sampler_keeps_no_top_k_or_the_stream_cannot_carry_them(
        services: dict) -> None:
    no_top_k = common_pb2.SamplingParams(max_tokens=4, temperature=1.0, top_k=0, top_p=0.9)
    top_k = common_pb2.SamplingParams(max_tokens=4, temperature=1.0, top_k=TOP_K)
    async with make_channel(services["inference"], token=TOKEN) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.Generate(inference_pb2.GenerateRequest(prompt_token_ids=PROMPT, n=1, sampling=no_top_k,
                                                              return_kept=True))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "top_k" in err.value.details()
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in stub.GenerateStream(inference_pb2.GenerateStreamRequest(request=inference_pb2.GenerateRequest(
                    prompt_token_ids=PROMPT, n=1, sampling=top_k, return_kept=True))):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "return_kept" in err.value.details()
