"""Flood: one client sends thousands of concurrent Generate calls; another, authenticated, makes a
light call (GetModelInfo) meanwhile. The bar (issue 16): the flood is answered RESOURCE_EXHAUSTED
past `server.max_rpcs_per_client`, and the light call's latency stays bounded.

    python -m bench.load --flood-only [--flood-calls 2200] [--flood-seconds 30] [--json PATH]

Inference runs as a local subprocess (as `arlo up` starts it); both clients are in this process,
on separate connections (another process's would be).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import grpc

from arlo.config import RunConfig
from arlo.proto.v1 import common_pb2, inference_pb2, inference_pb2_grpc
from arlo.rpc import make_channel
from bench.common import percentile

LIGHT_EVERY_S = 0.2


async def flood(cfg: RunConfig, token: str | None, *, calls: int, seconds: float) -> dict[str, Any]:
    address = cfg.inference.server.address
    outcomes: Counter[str] = Counter()
    details: dict[str, str] = {}  # one example per status code
    light_s: list[float] = []
    light_errors: Counter[str] = Counter()
    request = inference_pb2.GenerateRequest(prompt_token_ids=[1, 2, 3], n=1,
                                            sampling=common_pb2.SamplingParams(max_tokens=8, temperature=1.0))

    async def one(stub: inference_pb2_grpc.InferenceStub) -> None:
        try:
            await stub.Generate(request, timeout=seconds + 60)
            outcomes["OK"] += 1
        except grpc.aio.AioRpcError as e:
            outcomes[e.code().name] += 1
            details.setdefault(e.code().name, e.details() or "")

    async def light(stop: asyncio.Event) -> None:
        # Its own connection, as another process's would be (channels of one process to one target
        # share a connection, i.e. one peer, unless told not to).
        metadata = (("authorization", f"Bearer {token}"),) if token else ()
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = inference_pb2_grpc.InferenceStub(channel)
            while not stop.is_set():
                start = time.perf_counter()
                try:
                    await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=60, metadata=metadata)
                    light_s.append(time.perf_counter() - start)
                except grpc.aio.AioRpcError as e:
                    light_errors[e.code().name] += 1
                await asyncio.sleep(LIGHT_EVERY_S)

    stop = asyncio.Event()
    watcher = asyncio.create_task(light(stop))
    started = time.monotonic()
    async with make_channel(address, token=token) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        flooders = [asyncio.create_task(one(stub)) for _ in range(calls)]
        done, pending = await asyncio.wait(flooders, timeout=seconds)
        stop.set()
        await watcher
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    outcomes["unfinished"] += len(pending)
    return {"flood_calls": calls, "flood_outcomes": dict(outcomes), "flood_details": details, "flood_wall_s": time.monotonic() - started,
            "light_calls": len(light_s), "light_errors": dict(light_errors),
            "light_p50_ms": 1000 * percentile(light_s, 50) if light_s else None,
            "light_p99_ms": 1000 * percentile(light_s, 99) if light_s else None,
            "light_max_ms": 1000 * max(light_s) if light_s else None}
