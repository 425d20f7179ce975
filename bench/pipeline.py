"""Synchronous vs asynchronous RL through every service: throughput, idle time, reward, overhead.

For each `max_staleness` in --modes (0 = synchronous on-policy: the trainer waits for fresh
trajectories and the rollout workers wait for each new version), start the demo's services
as local processes (same task, model, warm start and seeds), warm-start, then run RL for the
same wall-time budget and measure, over the RL window only:

- trajectories/s and trained tokens/s (from the trainer's counters);
- the fraction of time the trainer and the inference engine sat idle (1 - busy/wall, from
  their own busy-time counters in the Redis heartbeats);
- the held-out reward reached at the end (sampled, greedy);
- platform overhead: the trainer's time in Redis reads that found data, intake (decode,
  de-duplication), acks and publishing (serialise, store, pointer), as a fraction of its step
  time plus that time; with the loopback gRPC round trip and the rollout's calls per trajectory
  for context (hundreds of episodes' calls overlap, so their sum is not wall time).

Each process gets an explicit CPU share (--cpus, one XLA/Eigen thread per CPU), the same in
every mode. Bars: async >= 1.5x the synchronous trajectories/s with reward no worse at equal
wall time (`async_over_sync`, `reward_sync`, `reward_async`); `overhead_fraction` <= 0.05.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from arlo.app.driver import run_training
from arlo.app.local import INFRA_SERVICES, local_cpu_shares, prepare_cluster
from arlo.config import RunConfig, load_config
from arlo.coord import connect, read_statuses
from arlo.data import resource_path
from bench.common import (
    check_config,
    check_json_arg,
    float_above,
    int_at_least,
    int_list,
    machine,
    print_table,
    run_main,
    stop_cluster,
    write_json,
)

DEMO_CONFIG = resource_path("demo.yaml")
# Two cores: inference and the trainer each get one; the light services share both.
DEFAULT_CPUS = "inference=0,trainer=1,rollout=0,env_gateway=1,reward=1"


async def heartbeat_counters(cfg) -> dict[str, dict[str, Any]]:
    redis = await connect(cfg.redis)
    try:
        return {s["service"]: s for s in await read_statuses(redis, cfg.run_id)}
    finally:
        await redis.aclose()


def loopback_rpc_s(address: str, calls: int = 200) -> float:
    """Mean round trip of a health check on loopback: the fixed cost of one gRPC call here."""
    with grpc.insecure_channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        started = time.perf_counter()
        for _ in range(calls):
            stub.Check(health_pb2.HealthCheckRequest(), timeout=5)
        return (time.perf_counter() - started) / calls


def rpc_count(cfg) -> float:
    """Client RPCs the rollout made so far (sum of the servers' request counters)."""
    import urllib.request

    total = 0.0
    for name in ("inference", "env_gateway", "reward"):
        port = getattr(cfg, name).server.metrics_port
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
        total += sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                     if line.startswith("arlo_rpc_requests_total{") and "Health" not in line)
    return total


def mode_config(staleness: int, args: argparse.Namespace) -> RunConfig:
    return load_config(DEMO_CONFIG, {"run_id": f"bench-pipeline-s{staleness}",
                                     "trainer": {"max_staleness": staleness, "sft": {"steps": args.sft_steps}},
                                     "rollout": {"eval": {"every_versions": 0}}, "local": {"cpus": args.cpus}})


def run_mode(staleness: int, args: argparse.Namespace, home: Path) -> dict[str, Any]:
    cfg = mode_config(staleness, args)
    cluster = prepare_cluster(cfg, home=home / f"s{staleness}", free_ports=True, fresh_run=True)
    marks: dict[str, dict[str, Any]] = {}

    async def on_phase(phase: str) -> None:
        await asyncio.sleep(2.5)  # one heartbeat period: the counters are fresh
        marks[phase] = {**await heartbeat_counters(cluster.cfg),
                        "rpcs": await asyncio.to_thread(rpc_count, cluster.cfg), "time": time.monotonic()}

    try:
        cluster.start(INFRA_SERVICES)
        cluster.start(("rollout",))
        report = asyncio.run(run_training(cluster.cfg, cluster.token, steps=None, on_progress=lambda row: None,
                                          check_children=cluster.supervisor.check, rl_seconds=args.rl_seconds,
                                          on_phase=on_phase,
                                          # Not "start": a random policy scores 0; the evaluation after
                                          # SFT compiles the engine's programs before the RL window opens.
                                          eval_tags=("after_sft", "end")))
        rtt = loopback_rpc_s(cluster.cfg.inference.server.address)
    finally:
        stop_cluster(cluster)
    return summarise(staleness, report.evals, marks["rl_start"], marks["rl_end"], rtt)


def summarise(staleness: int, evals: dict[str, Any], before: dict[str, Any], after: dict[str, Any],
              rtt: float) -> dict[str, Any]:
    wall = after["time"] - before["time"]

    def delta(service: str, key: str) -> float:
        return float(after[service][key]) - float(before[service][key])

    steps, busy, io = delta("trainer", "step"), delta("trainer", "busy_s"), delta("trainer", "io_s")
    rpcs = after["rpcs"] - before["rpcs"]
    end = evals.get("end", {})
    return {
        "max_staleness": staleness, "rl_wall_s": wall, "rl_steps": steps,
        "trajectories_per_s": delta("trainer", "consumed") / wall,
        "tokens_per_s": delta("trainer", "tokens_trained") / wall,
        "trainer_idle_fraction": 1 - busy / wall,
        "inference_idle_fraction": 1 - delta("inference", "busy_s") / wall,
        "reward_end": end.get("sampled_reward"), "greedy_reward_end": end.get("greedy_reward"),
        "reward_after_sft": evals.get("after_sft", {}).get("sampled_reward"),
        # The trainer's step: time in Redis reads that found data, intake (decode, de-duplication),
        # acks and publishing (serialise, store, pointer), as a share of step time + that time.
        "overhead_fraction": io / (busy + io) if busy + io else 0.0, "trainer_io_s": io, "trainer_busy_s": busy,
        # The rollout's gRPC calls: fixed cost per call here, and calls per trajectory (context: the
        # calls of hundreds of concurrent episodes overlap, so their sum is not wall time).
        "loopback_rpc_ms": rtt * 1e3, "rpcs_per_trajectory": rpcs / max(delta("trainer", "consumed"), 1),
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="0,1,2,4", type=int_list(0), help="max_staleness values; 0 is synchronous")
    parser.add_argument("--rl-seconds", type=float_above(0), default=120.0, help="RL wall time per mode")
    parser.add_argument("--sft-steps", type=int_at_least(0), default=600,
                        help="warm start before RL, the same in every mode")
    parser.add_argument("--cpus", default=DEFAULT_CPUS, help="local.cpus: service=cpu[+cpu],... (or auto, off)")
    parser.add_argument("--home", default=".arlo/bench-pipeline", help="logs and state of the runs")
    parser.add_argument("--json", help="write the figures here")
    parser.add_argument("--plot", default="bench-pipeline.png", help="PNG of the table's main figures")
    args = parser.parse_args(argv)
    check_config(parser, lambda: [local_cpu_shares(mode_config(m, args)) for m in args.modes])
    check_json_arg(parser, args)
    check_json_arg(parser, args, "plot", "--plot")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results = [run_mode(m, args, Path(args.home).resolve()) for m in args.modes]
    keys = ["max_staleness", "trajectories_per_s", "tokens_per_s", "trainer_idle_fraction",
            "inference_idle_fraction", "reward_after_sft", "reward_end", "greedy_reward_end", "overhead_fraction"]
    print_table(f"pipeline: {args.rl_seconds:.0f}s of RL per mode after {args.sft_steps} SFT steps; cpus {args.cpus}",
                ["staleness", "traj/s", "tokens/s", "trainer idle", "inference idle", "reward after SFT",
                 "reward end", "greedy end", "overhead"], [[r[k] for k in keys] for r in results])
    sync = next((r for r in results if r["max_staleness"] == 0), None)
    asyncs = [r for r in results if r["max_staleness"] > 0]
    best = max(asyncs, key=lambda r: r["trajectories_per_s"]) if asyncs else None
    figures: dict[str, Any] = {"modes": results, "cpus": args.cpus, "rl_seconds": args.rl_seconds,
                               "sft_steps": args.sft_steps, "machine": machine(),
                               "overhead_fraction": max(r["overhead_fraction"] for r in results)}
    if sync and best:
        figures.update(async_over_sync=best["trajectories_per_s"] / sync["trajectories_per_s"],
                       async_staleness=best["max_staleness"], reward_sync=sync["reward_end"],
                       reward_async=best["reward_end"])
        print(f"async_over_sync {figures['async_over_sync']:.2f} (staleness {best['max_staleness']}, bar >= 1.5); "
              f"reward sync {sync['reward_end']:.3f} vs async {best['reward_end']:.3f}; overhead_fraction "
              f"{figures['overhead_fraction']:.3f} (bar <= 0.05); load average {os.getloadavg()[0]:.1f}")
    plot(results, Path(args.plot))
    write_json(args.json, figures)


def plot(results: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"staleness {r['max_staleness']}" for r in results]
    fig, axes = plt.subplots(1, 3, figsize=(11, 3.5))
    for ax, key, title in zip(axes, ("trajectories_per_s", "reward_end", "trainer_idle_fraction"),
                              ("trajectories/s", "held-out reward at the end", "trainer idle fraction"), strict=True):
        ax.bar(labels, [r[key] or 0 for r in results], color=["tab:gray"] + ["tab:blue"] * (len(results) - 1))
        ax.set_title(title)
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    print(f"plot: {path}")


if __name__ == "__main__":
    run_main(main)
