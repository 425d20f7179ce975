"""Load on the OpenAI-compatible endpoint: hundreds of concurrent black-box episodes.

    python -m bench.openai_load [--episodes 256] [--seconds 60] [--warmup-s 30] [--json PATH]

The inference service runs as a local subprocess (as `arlo up` starts it, on free ports,
against the Redis at redis.url or one started for the run). This process holds `--episodes`
episodes in flight through the real `openai` client, each the black-box agent pattern: a chat
call, its reply sent back verbatim with a new user turn (the endpoint continues from the
recorded tokens), a second call, then `Inference.GetEpisode` fetching and deleting the record.
The first `--warmup-s` are not measured (JAX compiles each batch shape once).

Reported: p50/p99 latency and errors per call kind, episodes/s, and whether every fetched
record held both calls with the second continued from the first. The bar: zero errors, every
record right, and episodes finishing inside the window.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
import uuid
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import httpx2
import openai

from arlo.app.local import prepare_cluster
from arlo.config import RunConfig, load_config
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from arlo.rpc import make_channel
from bench.common import (
    check_config,
    check_json_arg,
    float_above,
    int_at_least,
    percentile,
    print_table,
    run_main,
    stop_cluster,
    write_json,
)


class Load:
    def __init__(self, client: openai.AsyncOpenAI, stub: inference_pb2_grpc.InferenceStub, max_tokens: int) -> None:
        self.client, self.stub, self.max_tokens = client, stub, max_tokens
        self.latency_s: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter[str] = Counter()
        self.episodes = 0
        self.bad_records = 0

    async def timed(self, kind: str, call: Any) -> Any:
        t0 = time.monotonic()
        try:
            result = await call
        except Exception as e:
            self.errors[f"{kind} {type(e).__name__}"] += 1
            raise
        self.latency_s[kind].append(time.monotonic() - t0)
        return result

    async def episode(self, i: int) -> None:
        episode_id = uuid.uuid4().hex
        headers = {"X-Arlo-Episode": episode_id}
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"{i % 97}+{i % 89}="}]
        first = await self.timed("chat", self.client.chat.completions.create(
            model="policy", messages=messages, max_tokens=self.max_tokens, extra_headers=headers))
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "again"}]
        await self.timed("chat (continued)", self.client.chat.completions.create(
            model="policy", messages=messages, max_tokens=self.max_tokens, extra_headers=headers))
        record = await self.timed("GetEpisode", self.stub.GetEpisode(
            inference_pb2.GetEpisodeRequest(episode_id=episode_id), timeout=60))
        if len(record.calls) != 2 or not record.calls[1].continued:
            self.bad_records += 1
        self.episodes += 1

    async def loop(self, slot: int, stop: asyncio.Event) -> None:
        n = slot
        while not stop.is_set():
            try:
                await self.episode(n)
            except Exception:  # counted in errors; the slot keeps the load on
                await asyncio.sleep(0.1)
            n += 1_000


async def drive(cfg: RunConfig, token: str | None, *, episodes: int, seconds: float, warmup_s: float,
                max_tokens: int) -> dict[str, Any]:
    """`episodes` black-box episodes in flight on the running inference service's endpoint; the
    figures of the `seconds` after `warmup_s`. bench/load.py --openai runs this too."""
    async with make_channel(cfg.inference.server.address, token=token) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        url = (await stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=30)).openai_url
        http = openai.DefaultAsyncHttpxClient(limits=httpx2.Limits(max_connections=2 * episodes,
                                                                   max_keepalive_connections=2 * episodes))
        client = openai.AsyncOpenAI(base_url=url, api_key=token or "none", max_retries=0, timeout=120,
                                    http_client=http)
        load = Load(client, stub, max_tokens)
        stop = asyncio.Event()
        slots = [asyncio.create_task(load.loop(i, stop)) for i in range(episodes)]
        await asyncio.sleep(warmup_s)
        load.latency_s.clear()
        load.errors.clear()
        before, started = load.episodes, time.monotonic()
        await asyncio.sleep(seconds)
        elapsed, done = time.monotonic() - started, load.episodes - before
        stop.set()
        await asyncio.gather(*slots, return_exceptions=True)
        await client.close()
    calls = {kind: {"calls": len(lat), "p50_ms": 1000 * percentile(lat, 50), "p99_ms": 1000 * percentile(lat, 99)}
             for kind, lat in load.latency_s.items() if lat}
    errors = sum(load.errors.values())
    return {"episodes_in_flight": episodes, "seconds": round(elapsed, 1), "episodes_done": done,
            "episodes_per_s": done / elapsed, "calls": calls, "errors": errors, "error_kinds": dict(load.errors),
            "bad_records": load.bad_records, "passed": errors == 0 and load.bad_records == 0 and done > 0}


def report(out: dict[str, Any]) -> None:
    print_table(f"openai load: {out['episodes_in_flight']} episodes in flight for {out['seconds']}s",
                ["call", "calls", "p50 ms", "p99 ms"],
                [[k, v["calls"], v["p50_ms"], v["p99_ms"]] for k, v in out["calls"].items()])
    print_table("openai load: totals", ["figure", "value"],
                [[k, out[k]] for k in ("episodes_done", "episodes_per_s", "errors", "bad_records", "passed")])


def bench_config(args: argparse.Namespace) -> RunConfig:
    return load_config(overrides={"run_id": f"openai-load-{int(time.time())}", "inference": {
        "max_batch": max(64, args.episodes), "max_tokens": args.max_tokens,
        "openai_max_episodes": 4 * args.episodes}})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int_at_least(1), default=256, help="episodes in flight")
    parser.add_argument("--seconds", type=float_above(0), default=60.0)
    parser.add_argument("--warmup-s", type=float_above(0, inclusive=True), default=30.0)
    parser.add_argument("--max-tokens", type=int_at_least(1), default=16)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    check_config(parser, lambda: bench_config(args))
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    cfg = bench_config(args)
    with tempfile.TemporaryDirectory(prefix="arlo-openai-load-") as home:
        cluster = prepare_cluster(cfg, home=Path(home), free_ports=True, fresh_run=True)
        try:
            cluster.start(("inference",))
            out = asyncio.run(drive(cluster.cfg, cluster.token, episodes=args.episodes, seconds=args.seconds,
                                    warmup_s=args.warmup_s, max_tokens=args.max_tokens))
        finally:
            stop_cluster(cluster)
    report(out)
    write_json(args.json, {"bench": "openai_load", "command": "python -m bench.openai_load " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "json" and v is not None), **out})
    if not out["passed"]:
        raise SystemExit(1)


if __name__ == "__main__":
    run_main(main)
