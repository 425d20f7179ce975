"""Reading a run's status from outside (`arlo status`): health, versions, queue, rates, errors.

Like the driver, it talks to services only through their gRPC contracts and to Redis only
through arlo.coord, so it reads local processes and a cluster the same way.
"""

from __future__ import annotations

import asyncio
from typing import Any

import grpc

from arlo.app.supervisor import is_serving
from arlo.config import RunConfig, TlsConfig
from arlo.coord import TrajectoryStream, WeightPointer, connect, read_statuses
from arlo.coord.evals import EvalQueue
from arlo.coord.lease import lease_holder
from arlo.coord.metrics import MetricsStream
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel

RATES = {"inference": {"generated_tokens": "tokens/s", "requests": "requests/s"},
         "trainer": {"consumed": "trajectories/s", "tokens_trained": "tokens/s", "step": "steps/s"},
         "rollout": {"episodes": "episodes/s"}}
ERRORS = {"trainer": ("dropped_stale", "dropped_failed", "dropped_malformed", "dropped_duplicate",
                      "dropped_zero_variance", "dropped_poisoned", "dropped_step_error", "failed_steps",
                      "publish_failures", "pointer_conflicts", "checkpoint_failures", "acked_undurable",
                      "loop_restarts"),
          "rollout": ("retries", "failed_groups"), "inference": ("aborted",)}
COMPILES = ("compiles", "late_compiles", "ahead_compiles")
"""XLA compile counters of the services that run a model (arlo/compile_watch.py): late ones stall a run."""
KV = ("kv_pages", "kv_pages_used", "prefix_hit_tokens", "prefix_lookup_tokens", "preemptions")
"""The inference engines' paged KV cache (summed over replicas): pages in use, and the prefix cache's
hit rate since start from its token counters."""


async def collect_status(cfg: RunConfig, token: str | None, *, interval_s: float = 2.5) -> dict[str, Any]:
    """What `arlo status` shows: per-service health and version; queue depth and lag; staleness;
    throughput per service (two heartbeat snapshots `interval_s` apart); errors by kind."""
    from arlo.app.local import SERVICE_SECTIONS

    # Redis first, once: `arlo status` with Redis down said so only after 37 s of retries.
    redis = await connect(cfg.redis, retries=0)
    try:
        pointer = await WeightPointer(redis, cfg.run_id).get()
        stream = TrajectoryStream(redis, cfg.run_id, consumer="status")
        queue_depth = await stream.backlog()
        diagnostics = await MetricsStream(redis, cfg.run_id).latest()
        evaluation = await EvalQueue(redis, cfg.run_id).latest_result()
        holder = await lease_holder(redis, cfg.run_id)
        first = await read_statuses(redis, cfg.run_id)
        await asyncio.sleep(interval_s if first else 0)
        second = await read_statuses(redis, cfg.run_id)
    finally:
        await redis.aclose()
    services = []
    trainer_version = None
    for name in SERVICE_SECTIONS:
        address = getattr(cfg, name).server.address
        healthy = await asyncio.to_thread(is_serving, address, 1.0)
        version = None
        if healthy and name in ("inference", "trainer"):
            version = await _served_version(name, address, token, cfg.auth.tls)
            if name == "trainer":
                trainer_version = version
        services.append({"name": name, "address": address, "healthy": healthy, "weight_version": version})
    activity = service_activity(first, second)
    for s in services:
        s.update(activity.get(s["name"], {}))
    inference = next(s for s in services if s["name"] == "inference")
    # Each replica's OpenAI endpoint (one URL per instance; the first is the one to show).
    urls = sorted(x["openai_url"] for x in second if x.get("service") == "inference" and x.get("openai_url"))
    inference["openai_url"] = urls[0] if urls else None
    if len(urls) > 1:
        inference["openai_urls"] = urls
    trainer = next((x for x in second if x.get("service") == "trainer"), {})
    return {"run_id": cfg.run_id, "services": services,
            "trainer_version": trainer_version if trainer_version is not None else (pointer.version if pointer else 0),
            "pointer_version": pointer.version if pointer else 0, "queue_depth": queue_depth,
            "staleness": float(trainer["staleness"]) if "staleness" in trainer else None,
            "trainer_waiting_on": trainer.get("waiting_on") or "", "trainer_lease": holder,
            "trainer_diagnostics": diagnostics, "latest_eval": evaluation}


def service_activity(first: list[dict[str, str]], second: list[dict[str, str]]) -> dict[str, dict[str, Any]]:
    """Per service (summed over instances): rates between two heartbeat snapshots, error counters."""
    before = {(s.get("service"), s.get("instance")): s for s in first}
    out: dict[str, dict[str, Any]] = {}
    for s in second:
        name = s.get("service", "")
        entry = out.setdefault(name, {"instances": 0, "throughput": {}, "errors": {}})
        entry["instances"] += 1
        prev = before.get((name, s.get("instance")))
        dt = float(s.get("ts", 0)) - float(prev.get("ts", 0)) if prev else 0.0
        for counter, unit in RATES.get(name, {}).items():
            if prev and dt > 0 and counter in s and counter in prev:
                rate = (float(s[counter]) - float(prev[counter])) / dt
                entry["throughput"][unit] = entry["throughput"].get(unit, 0.0) + rate
        for counter in ERRORS.get(name, ()):
            if counter in s:
                entry["errors"][counter] = entry["errors"].get(counter, 0) + int(float(s[counter]))
        for counter in COMPILES:
            if counter in s:
                compiles = entry.setdefault("compiles", {})
                compiles[counter] = compiles.get(counter, 0) + int(float(s[counter]))
        for counter in KV:
            if counter in s:
                kv = entry.setdefault("kv", {})
                kv[counter] = kv.get(counter, 0) + int(float(s[counter]))
    for entry in out.values():
        kv = entry.get("kv")
        if kv and kv.get("prefix_lookup_tokens"):
            kv["prefix_hit_rate"] = kv.get("prefix_hit_tokens", 0) / kv["prefix_lookup_tokens"]
    return out


async def _served_version(name: str, address: str, token: str | None, tls: TlsConfig) -> int | None:
    try:
        async with make_channel(address, token=token, tls=tls) as channel:
            if name == "inference":
                info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
                    inference_pb2.GetModelInfoRequest(), timeout=3)
                return info.policy_version
            status = await trainer_pb2_grpc.TrainerStub(channel).GetStatus(trainer_pb2.GetStatusRequest(), timeout=3)
            return status.version
    except grpc.aio.AioRpcError:
        return None
