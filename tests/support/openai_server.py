"""A real inference service (start_inference: gRPC + the OpenAI endpoint on ephemeral ports,
weight sync on the test's Redis namespace) for the OpenAI endpoint and black-box agent tests."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass

import pytest

from arlo.background import TaskGroup
from arlo.config import load_config
from arlo.coord import connect, delete_run
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from arlo.rpc import make_channel
from services.inference.__main__ import start_inference
from services.inference.engine import Engine

TOKEN = "openai-test-token"


@dataclass
class Served:
    address: str
    openai_url: str
    engine: Engine
    stub: inference_pb2_grpc.InferenceStub
    channel: object


@asynccontextmanager
async def inference_service(monkeypatch: pytest.MonkeyPatch, redis_url: str, run_id: str,
                            model: Mapping[str, object] | None = None, **inference: object) -> AsyncIterator[Served]:
    """`model`: the run's `model` settings (default: the tiny byte-tokenizer preset)."""
    monkeypatch.setenv("ARLO_TOKEN", TOKEN)
    cfg = load_config(overrides={"run_id": run_id, "redis": {"url": redis_url}, "model": dict(model or {}), "inference": {
        "server": {"port": 0, "metrics_port": -1, "grace_s": 0.5}, "max_tokens": 64, "max_prompt_tokens": 1024,
        "max_batch": 8, "max_n": 4, "decode_steps": 4, **inference}})
    tasks = TaskGroup()
    running, engine = await start_inference(cfg, tasks)
    address = f"127.0.0.1:{running.port}"
    try:
        async with make_channel(address, token=TOKEN) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            info = await stub.GetModelInfo(inference_pb2.GetModelInfoRequest())
            yield Served(address=address, openai_url=info.openai_url, engine=engine, stub=stub, channel=channel)
    finally:
        await running.stop(0.1)
        await tasks.cancel_all()
        redis = await connect(cfg.redis)
        await delete_run(redis, run_id)
        await redis.aclose()
        await asyncio.sleep(0)
