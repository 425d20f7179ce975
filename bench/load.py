"""Load: hundreds of concurrent episodes against one set of services, for a bounded time.

    python -m bench.load [--episodes 256] [--seconds 90] [--warmup-s 30] [--max-backlog 256] [--json PATH]

inference, trainer, env_gateway and reward run as local subprocesses (as `arlo up` starts
them, on free ports, against the Redis at redis.url or one started for the run). This process
is the rollout side: a RolloutWorker with `episodes / group_size` groups in flight, whose
gRPC clients time every call, writes to the stream while the trainer consumes it. The first
`--warmup-s` (JAX compiles each batch shape once) are not measured. Staleness
admission is off (it would cap concurrency at a few batches: here the point is load), and the
trainer's max_staleness is high so nothing is dropped for age.

`--openai` adds the OpenAI endpoint phase (bench/openai_load.py), on the same inference service
after the rollout phase: `--episodes` black-box episodes in flight through the real `openai`
client. `--mcp` (stdio) or `--mcp-http` adds an MCP-backed environment phase (bench/mcp_load.py):
`--episodes` concurrent episodes of tool calls through a real env_gateway to a real MCP server.
`--no-rollout` skips the rollout phase (then only inference starts, and only for --openai).

`--flood-only` runs the flood phase instead (bench/flood.py): one client with `--flood-calls`
concurrent Generate calls, another making a light authenticated call meanwhile (its p50/p99).

Reported: p50/p99 latency and errors per RPC, episodes/s, trainer steps, the stream backlog
(max and final) and Redis memory (peak). The bar: zero errors, groups finished inside the
window, and a backlog that stays under max_backlog + groups in flight (producers back off
instead of piling data up).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from collections import Counter, defaultdict
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from arlo.app.local import INFRA_SERVICES, prepare_cluster
from arlo.config import RunConfig, load_config
from arlo.coord import TrajectoryStream, connect
from arlo.proto.v1 import trainer_pb2, trainer_pb2_grpc
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
from services.rollout.agent import Turn
from services.rollout.clients import EnvironmentClient, InferenceClient, RewardClient
from services.rollout.types import BackendError, ResetResult, ScoreResult, StepResult
from services.rollout.worker import RolloutWorker

T = TypeVar("T")
GROUP_SIZE = 4


class Timings:
    """Latency of every successful call and a count of failures, by RPC and status code."""

    def __init__(self) -> None:
        self.latency_s: dict[str, list[float]] = defaultdict(list)
        self.errors: Counter[tuple[str, str]] = Counter()

    async def time(self, rpc: str, call: Awaitable[T]) -> T:
        start = time.perf_counter()
        try:
            result = await call
        except BackendError as e:
            self.errors[(rpc, e.code)] += 1
            raise
        self.latency_s[rpc].append(time.perf_counter() - start)
        return result


class TimedGenerator:
    def __init__(self, inner: InferenceClient, timings: Timings) -> None:
        self.inner, self.timings = inner, timings

    async def generate(self, prompt: Sequence[int], *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        return await self.timings.time("Inference.Generate",
                                       self.inner.generate(prompt, max_tokens=max_tokens, session_id=session_id,
                                                                          seed=seed))


class TimedEnv:
    def __init__(self, inner: EnvironmentClient, timings: Timings) -> None:
        self.inner, self.timings = inner, timings

    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        return await self.timings.time("Environment.Reset", self.inner.reset(env_name, config_json, seed))

    async def step(self, session_id: str, action: str) -> StepResult:
        return await self.timings.time("Environment.Step", self.inner.step(session_id, action))

    async def close(self, session_id: str) -> None:
        await self.timings.time("Environment.Close", self.inner.close(session_id))


class TimedScorer:
    def __init__(self, inner: RewardClient, timings: Timings) -> None:
        self.inner, self.timings = inner, timings

    async def score(self, reward_fn: str, response: str, reference: str, metadata_json: str = "") -> ScoreResult:
        return await self.timings.time("Reward.Score", self.inner.score(reward_fn, response, reference, metadata_json))


def bench_config(args: argparse.Namespace) -> RunConfig:
    return load_config(overrides={
        "run_id": f"load-{int(time.time())}", "redis": {"max_backlog": args.max_backlog},
        # Every episode in flight decodes in one batch: the load is on the services, not a queue.
        "inference": {"max_batch": max(64, args.episodes), "max_n": 4, "max_tokens": 16},
        "trainer": {"groups_per_step": 4, "max_staleness": 100_000, "read_block_ms": 200},
        "rollout": {"group_size": GROUP_SIZE, "concurrent_groups": max(1, args.episodes // GROUP_SIZE),
                    "max_turns": 2, "rpc_timeout_s": args.rpc_timeout_s, "episode_timeout_s": 4 * args.rpc_timeout_s}})


async def sample_redis(cfg: RunConfig, samples: list[dict[str, float]], stop: asyncio.Event) -> None:
    redis = await connect(cfg.redis)
    stream = TrajectoryStream(redis, cfg.run_id, consumer="load-bench")
    try:
        while not stop.is_set():
            memory = await redis.info("memory")
            samples.append({"t": time.monotonic(), "backlog": await stream.backlog(),
                            "used_memory": float(memory["used_memory"])})
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except TimeoutError:
                pass
    finally:
        await redis.aclose()


async def drive(cfg: RunConfig, token: str | None, seconds: float, warmup_s: float) -> dict[str, Any]:
    rc = cfg.rollout
    timings = Timings()
    channels = [make_channel(s.server.address, token=token) for s in (cfg.inference, cfg.env_gateway, cfg.reward)]
    tok = cfg.model.source().tokenizer()
    redis = await connect(cfg.redis)
    stream = TrajectoryStream(redis, cfg.run_id, consumer="load-rollout", max_backlog=cfg.redis.max_backlog)
    await stream.ensure_group()
    worker = RolloutWorker(
        rc, run_id=cfg.run_id, tokenizer=tok, stream=stream, seed=0,
        gen=TimedGenerator(InferenceClient(channels[0], rc.sampling, stop_token_ids=tok.stop_token_ids,
                                           timeout_s=rc.rpc_timeout_s), timings),
        env=TimedEnv(EnvironmentClient(channels[1], timeout_s=rc.rpc_timeout_s), timings),
        scorer=TimedScorer(RewardClient(channels[2], timeout_s=rc.rpc_timeout_s), timings))
    samples: list[dict[str, float]] = []
    stop = asyncio.Event()
    async with make_channel(cfg.trainer.server.address, token=token) as ch:
        trainer = trainer_pb2_grpc.TrainerStub(ch)
        await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)  # up and answering
        await trainer.Resume(trainer_pb2.ResumeRequest(), timeout=10)
        work = asyncio.create_task(worker.run())
        await asyncio.sleep(warmup_s)
        # Measure from here: calls that began in the warm-up and end now count with their full time.
        timings.latency_s.clear()
        timings.errors.clear()
        groups_before = worker.stats.groups
        mid = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        sampler = asyncio.create_task(sample_redis(cfg, samples, stop))
        started = time.monotonic()
        await asyncio.sleep(seconds)
        work.cancel()
        await asyncio.gather(work, return_exceptions=True)
        elapsed = time.monotonic() - started
        stop.set()
        await sampler
        await trainer.Pause(trainer_pb2.PauseRequest(), timeout=120)
        final = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
    for ch in channels:
        await ch.close()
    await redis.aclose()
    return {"timings": timings, "stats": worker.stats, "elapsed_s": elapsed, "samples": samples,
            "groups": worker.stats.groups - groups_before, "trainer_steps": final.step - mid.step,
            "trained": final.trajectories_consumed - mid.trajectories_consumed,
            "dropped": final.trajectories_dropped - mid.trajectories_dropped}


def figures(result: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    timings: Timings = result["timings"]
    rpcs = {}
    for rpc in sorted(set(timings.latency_s) | {r for r, _ in timings.errors}):
        lat = timings.latency_s.get(rpc, [])
        rpcs[rpc] = {"calls": len(lat), "errors": sum(n for (r, _), n in timings.errors.items() if r == rpc),
                     "p50_ms": 1000 * percentile(lat, 50) if lat else None,
                     "p99_ms": 1000 * percentile(lat, 99) if lat else None}
    stats, samples = result["stats"], result["samples"]
    backlogs = [s["backlog"] for s in samples] or [0]
    groups_in_flight = max(1, args.episodes // GROUP_SIZE)
    bound = args.max_backlog + groups_in_flight * GROUP_SIZE
    errors = sum(timings.errors.values()) + stats.failed_groups
    return {
        "episodes_in_flight": groups_in_flight * GROUP_SIZE, "seconds": round(result["elapsed_s"], 1),
        # Counted by groups written (each holds GROUP_SIZE whole episodes); Score runs only for
        # episodes the environment did not score itself, so it is no episode count.
        "episodes_done": result["groups"] * GROUP_SIZE, "groups_written": result["groups"],
        "episodes_per_s": result["groups"] * GROUP_SIZE / result["elapsed_s"],
        "rpcs": rpcs, "errors": errors, "error_codes": {f"{r} {c}": n for (r, c), n in timings.errors.items()},
        "failed_groups": stats.failed_groups, "episode_retries": stats.retries,
        "backpressure_waits": stats.backpressure_waits, "trainer_steps": result["trainer_steps"],
        "trained": result["trained"], "dropped": result["dropped"],
        "backlog_max": max(backlogs), "backlog_final": backlogs[-1], "backlog_bound": bound,
        "redis_used_memory_peak_mib": max((s["used_memory"] for s in samples), default=0) / 2**20,
        # A window in which no group finished (still compiling, or stuck) proves nothing.
        "passed": errors == 0 and max(backlogs) <= bound and result["groups"] > 0,
    }


def report(out: dict[str, Any]) -> None:
    rows = [[rpc, f["calls"], f["errors"], f["p50_ms"] or 0.0, f["p99_ms"] or 0.0] for rpc, f in out["rpcs"].items()]
    print_table(f"load: {out['episodes_in_flight']} episodes in flight for {out['seconds']}s",
                ["rpc", "calls", "errors", "p50 ms", "p99 ms"], rows)
    summary = ["episodes_done", "groups_written", "episodes_per_s", "errors", "failed_groups", "episode_retries", "backpressure_waits",
               "trainer_steps", "trained", "dropped", "backlog_max", "backlog_final", "backlog_bound",
               "redis_used_memory_peak_mib", "rollout_passed"]
    print_table("load: totals", ["figure", "value"], [[k, out[k]] for k in summary])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int_at_least(1), default=256, help="episodes in flight (groups of 4)")
    parser.add_argument("--seconds", type=float_above(0), default=90.0, help="how long to hold (and measure) the load")
    parser.add_argument("--warmup-s", type=float_above(0, inclusive=True), default=30.0,
                        help="load before measuring (JAX compiles)")
    parser.add_argument("--max-backlog", type=int_at_least(1), default=256, help="redis.max_backlog for the run")
    parser.add_argument("--rpc-timeout-s", type=float_above(0), default=60.0)
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--openai", action="store_true", help="add the OpenAI endpoint phase (bench/openai_load.py)")
    parser.add_argument("--mcp", action="store_true", help="add the MCP environment phase, stdio (bench/mcp_load.py)")
    parser.add_argument("--mcp-http", action="store_true", help="the MCP phase over streamable HTTP instead")
    parser.add_argument("--mcp-rounds", type=int_at_least(1), default=3, help="MCP phase: rounds of --episodes episodes")
    parser.add_argument("--mcp-calls", type=int_at_least(1), default=3, help="MCP phase: tool calls per episode")
    parser.add_argument("--no-rollout", action="store_true", help="skip the rollout phase (only --openai/--mcp)")
    parser.add_argument("--flood-only", action="store_true", help="the flood phase alone (bench/flood.py)")
    parser.add_argument("--flood-calls", type=int_at_least(1), default=2200)
    parser.add_argument("--flood-seconds", type=float_above(0), default=30.0)
    args = parser.parse_args(argv)
    if not args.flood_only and args.no_rollout and not (args.openai or args.mcp or args.mcp_http):
        parser.error("--no-rollout leaves nothing to run: add --openai, --mcp or --mcp-http")
    check_config(parser, lambda: bench_config(args))
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.flood_only:
        return flood_main(args)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s %(message)s")
    out = run_phases(args)
    report_phases(out)
    # The command that repeats the run: flags as given (a boolean only when set).
    flags = [f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
             if k != "json" and v is not None and v is not False]
    write_json(args.json, {"bench": "load", "command": " ".join(["python -m bench.load", *flags]), **out})
    if not out["passed"]:
        raise SystemExit(1)


def run_phases(args: argparse.Namespace) -> dict[str, Any]:
    """The rollout phase's figures (unless --no-rollout) with "openai" and "mcp" phases beside
    them; "passed" only if every phase run passed."""
    out: dict[str, Any] = {}
    if not args.no_rollout or args.openai:
        cfg = bench_config(args)
        with tempfile.TemporaryDirectory(prefix="arlo-load-") as home:
            cluster = prepare_cluster(cfg, home=Path(home), free_ports=True, fresh_run=True)
            try:
                cluster.start(("inference",) if args.no_rollout else INFRA_SERVICES)
                if not args.no_rollout:
                    out = figures(asyncio.run(drive(cluster.cfg, cluster.token, args.seconds, args.warmup_s)), args)
                if args.openai:  # the same inference service, now that the rollout load is off it
                    from bench import openai_load

                    out["openai"] = asyncio.run(openai_load.drive(
                        cluster.cfg, cluster.token, episodes=args.episodes, seconds=args.seconds,
                        warmup_s=args.warmup_s, max_tokens=cluster.cfg.inference.max_tokens))
            finally:
                stop_cluster(cluster)
    if args.mcp or args.mcp_http:
        from contextlib import nullcontext

        from bench import mcp_load

        with mcp_load.http_server() if args.mcp_http else nullcontext("") as url:
            out["mcp"] = asyncio.run(mcp_load.run(episodes=args.episodes, rounds=args.mcp_rounds,
                                                  calls=args.mcp_calls, url=url))
    if "rpcs" in out:
        out["rollout_passed"] = out["passed"]
    out["passed"] = all(out[k] for k in ("rollout_passed",) if k in out) and all(
        out[phase]["passed"] for phase in ("openai", "mcp") if phase in out)
    return out


def report_phases(out: dict[str, Any]) -> None:
    """Each phase's tables, then one row per phase: episodes in flight, episodes/s, errors, passed."""
    rows = []
    if "rpcs" in out:
        report(out)
        rows.append(["rollout (gRPC)", out["episodes_in_flight"], f"{out['episodes_per_s']:.1f}", out["errors"],
                     out["rollout_passed"]])
    if "openai" in out:
        from bench import openai_load

        o = out["openai"]
        openai_load.report(o)
        rows.append(["openai endpoint", o["episodes_in_flight"], f"{o['episodes_per_s']:.1f}", o["errors"], o["passed"]])
    if "mcp" in out:
        from bench import mcp_load

        m = out["mcp"]
        mcp_load.report(m)
        rows.append([f"MCP env ({m['transport']})", m["episodes_in_flight"], f"{m['episodes_per_s']:.1f}",
                     sum(m["errors"].values()), m["passed"]])
    print_table("load: phases", ["phase", "episodes in flight", "episodes/s", "errors", "passed"], rows)


def flood_main(args: argparse.Namespace) -> None:
    from bench.flood import flood

    cfg = bench_config(args)
    with tempfile.TemporaryDirectory(prefix="arlo-flood-") as home:
        cluster = prepare_cluster(cfg, home=Path(home), free_ports=True, fresh_run=True)
        try:
            cluster.start(("inference",))
            out = asyncio.run(flood(cluster.cfg, cluster.token, calls=args.flood_calls, seconds=args.flood_seconds))
        finally:
            stop_cluster(cluster)
    print_table("flood", ["figure", "value"], [[k, v] for k, v in out.items()])
    write_json(args.json, {"bench": "flood", "command": f"python -m bench.load --flood-only --flood-calls "
                                                        f"{args.flood_calls} --flood-seconds {args.flood_seconds}", **out})


if __name__ == "__main__":
    run_main(main)
