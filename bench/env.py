"""Built-in environments through a real env_gateway: steps/s for Step and StepBatch(64), the
gateway's added latency over calling the environment in process, and concurrent episodes through
the rollout's env client, each Step its own call vs coalesced into StepBatches.

    python -m bench.env [--envs arith,calculator,...] [--steps 2000] [--batches 200]
                        [--python-steps 40] [--python-batches 3]
                        [--episodes 1,64] [--episode-steps 200] [--json PATH]

The gateway runs in this process on an ephemeral port (auth off) and the client shares its
event loop, so a latency here is client + server on one core: an upper bound on the
gateway's own cost. Sessions that finish are replaced between timed calls, never inside one.
`stepbatch64_over_step` is the median time of one StepBatch of 64 over that of one Step, both
measured in alternating rounds (the bar: <= 2 for `arith`, the inline path; environments whose
own step costs tens of microseconds, and `python`, bound by its sandbox processes, are
reported too).

The episodes table runs N episode loops at once (step, step, ..., done, Reset a new one)
through `AffinityEnvironmentClient` on `--episode-env`, once with `max_in_flight=0` (one Step
call per step, as before) and once with the default coalescing (concurrent Steps to a busy
replica leave together as one StepBatch), in alternating rounds. `coalesced_over_per_step` is
the coalesced steps/s over the per-step steps/s; at 1 episode it shows the cost of coalescing
when nothing overlaps (there should be none).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

from arlo.config import AuthConfig, EnvGatewayConfig, RunConfig, ServerConfig
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from bench.common import (
    check_json_arg,
    int_at_least,
    int_list,
    name_list,
    percentile,
    print_table,
    run_main,
    write_json,
)
from services.env_gateway.__main__ import build_gateway, start_env_gateway
from services.env_gateway.envs.base import Environment
from services.rollout.env_affinity import AffinityEnvironmentClient

BATCH = 64


@dataclass(frozen=True, kw_only=True, slots=True)
class Workload:
    config: dict[str, object]
    """Long episodes, so few sessions end mid-measurement."""
    action: str
    """A turn that never ends the episode early."""


def _call(name: str, **arguments: object) -> str:
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


WORKLOADS = {
    "arith": Workload(config={"max_turns": 16}, action="x"),
    "calculator": Workload(config={"max_turns": 32}, action=_call("calculator", expression="4821 * 337 + 9152 * 46")),
    "guess_number": Workload(config={"max_turns": 64}, action="0"),  # out of range: a hint, never a win
    "retrieval": Workload(config={"max_turns": 32}, action=_call("search", query="Ostry harbour lighthouse")),
    "python": Workload(config={"max_turns": 32}, action="```python\nprint(sum(range(1000)))\n```"),
}


class Sessions:
    """Live sessions of one environment; `take(n)` hands out n distinct ones, `replace` renews ended ones."""

    def __init__(self, stub: env_pb2_grpc.EnvironmentStub, env: str, workload: Workload) -> None:
        self._stub, self._env, self._config = stub, env, json.dumps(workload.config)
        self._live: list[str] = []
        self._seed = 0

    async def _new(self) -> str:
        self._seed += 1
        reply = await self._stub.Reset(env_pb2.ResetRequest(env_name=self._env, config_json=self._config,
                                                            seed=self._seed), timeout=30)
        return reply.session_id

    async def take(self, n: int) -> list[str]:
        while len(self._live) < n:
            self._live.append(await self._new())
        return self._live[:n]

    async def replace(self, ended: list[str]) -> None:
        for session in ended:
            self._live[self._live.index(session)] = await self._new()


async def time_step(stub: env_pb2_grpc.EnvironmentStub, sessions: Sessions, action: str) -> float:
    (session,) = await sessions.take(1)
    started = time.perf_counter()
    reply = await stub.Step(env_pb2.StepRequest(session_id=session, action=action), timeout=30)
    elapsed = time.perf_counter() - started
    if reply.done:
        await sessions.replace([session])
    return elapsed


async def time_batch(stub: env_pb2_grpc.EnvironmentStub, sessions: Sessions, action: str) -> float:
    batch = await sessions.take(BATCH)
    request = env_pb2.StepBatchRequest(steps=[env_pb2.StepRequest(session_id=s, action=action) for s in batch])
    started = time.perf_counter()
    reply = await stub.StepBatch(request, timeout=120)
    elapsed = time.perf_counter() - started
    failed = [r.message for r in reply.results if r.code != 0]
    assert not failed, failed[:3]
    await sessions.replace([s for s, r in zip(batch, reply.results, strict=True) if r.response.done])
    return elapsed


async def time_interleaved(stub: env_pb2_grpc.EnvironmentStub, sessions: Sessions, action: str, steps: int,
                           batches: int) -> tuple[list[float], list[float]]:
    """Single Steps and StepBatches in alternating rounds, so a burst of load from elsewhere on the
    machine lands on both and their ratio stays honest."""
    step_s: list[float] = []
    batch_s: list[float] = []
    per_round = max(steps // batches, 1)
    for _ in range(batches):
        for _ in range(per_round):
            step_s.append(await time_step(stub, sessions, action))
        batch_s.append(await time_batch(stub, sessions, action))
    return step_s, batch_s


def time_in_process(make: Callable[[], Environment], workload: Workload, n: int) -> list[float]:
    out, env = [], None
    for i in range(n):
        if env is None:
            env = make()
            env.reset(i, workload.config)
        started = time.perf_counter()
        result = env.step(workload.action)
        out.append(time.perf_counter() - started)
        if result.done:
            env = None
    return out


async def bench_env(stub: env_pb2_grpc.EnvironmentStub, name: str, make: Callable[[], Environment],
                    steps: int, batches: int) -> dict[str, float]:
    workload = WORKLOADS[name]
    sessions = Sessions(stub, name, workload)
    await time_interleaved(stub, sessions, workload.action, max(steps // 10, 2), 1)  # warm-up
    step_s, batch_s = await time_interleaved(stub, sessions, workload.action, steps, batches)
    local_s = time_in_process(make, workload, steps)
    ms = 1e3
    return {
        "step_per_s": 1 / statistics.fmean(step_s),
        "stepbatch64_steps_per_s": BATCH / statistics.fmean(batch_s),
        "step_p50_ms": percentile(step_s, 50) * ms, "step_p99_ms": percentile(step_s, 99) * ms,
        "stepbatch64_p50_ms": percentile(batch_s, 50) * ms, "stepbatch64_p99_ms": percentile(batch_s, 99) * ms,
        "in_process_p50_ms": percentile(local_s, 50) * ms, "in_process_p99_ms": percentile(local_s, 99) * ms,
        "added_p50_ms": (percentile(step_s, 50) - percentile(local_s, 50)) * ms,
        "added_p99_ms": (percentile(step_s, 99) - percentile(local_s, 99)) * ms,
        "stepbatch64_over_step": statistics.median(batch_s) / statistics.median(step_s),
        # Fastest over fastest: what the code costs when nothing else on the machine interrupts it.
        "stepbatch64_over_step_best": min(batch_s) / min(step_s),
    }


async def time_episodes(client: AffinityEnvironmentClient, name: str, episodes: int,
                        steps_each: int) -> tuple[float, list[float]]:
    """Steps/s of `episodes` concurrent episode loops of `steps_each` steps, and every step's latency."""
    workload, config = WORKLOADS[name], json.dumps(WORKLOADS[name].config)
    latencies: list[float] = []

    async def loop(i: int) -> None:
        seed = i * 1_000_000
        session = (await client.reset(name, config, seed)).session_id
        for _ in range(steps_each):
            started = time.perf_counter()
            result = await client.step(session, workload.action)
            latencies.append(time.perf_counter() - started)
            if result.done:
                await client.close(session)
                seed += 1
                session = (await client.reset(name, config, seed)).session_id
        await client.close(session)

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(episodes)))
    return episodes * steps_each / (time.perf_counter() - started), latencies


async def bench_episodes(port: int, name: str, episodes: int, steps_each: int, rounds: int = 3) -> dict[str, float]:
    clients = {mode: AffinityEnvironmentClient(f"ipv4:127.0.0.1:{port}", lambda a: make_channel(a, token=None),
                                               timeout_s=120, max_in_flight=in_flight)
               for mode, in_flight in (("per_step", 0), ("coalesced", 1))}
    rates: dict[str, list[float]] = {mode: [] for mode in clients}
    latency: dict[str, list[float]] = {mode: [] for mode in clients}
    try:
        for client in clients.values():  # warm-up: channels, sessions, caches
            await time_episodes(client, name, episodes, max(steps_each // 10, 2))
            client.calls.clear()
        for _ in range(rounds):  # alternating, so load from elsewhere lands on both
            for mode, client in clients.items():
                rate, lat = await time_episodes(client, name, episodes, steps_each)
                rates[mode].append(rate)
                latency[mode] += lat
        calls = clients["coalesced"].calls
    finally:
        for client in clients.values():
            await client.aclose()
    ms, out = 1e3, {"episodes": episodes}
    for mode in clients:
        out[f"{mode}_steps_per_s"] = statistics.median(rates[mode])
        out[f"{mode}_p50_ms"] = percentile(latency[mode], 50) * ms
        out[f"{mode}_p99_ms"] = percentile(latency[mode], 99) * ms
    out["coalesced_over_per_step"] = out["coalesced_steps_per_s"] / out["per_step_steps_per_s"]
    out["coalesced_calls_per_step"] = (calls["Step"] + calls["StepBatch"]) / (rounds * episodes * steps_each)
    out["coalesced_mean_batch"] = calls["batched_steps"] / max(calls["StepBatch"], 1)
    return out


async def run(args: argparse.Namespace) -> tuple[dict[str, dict[str, float]], list[dict[str, float]]]:
    cfg = RunConfig(auth=AuthConfig(disabled=True), env_gateway=EnvGatewayConfig(
        server=ServerConfig(port=0, metrics_port=-1), max_sessions=100_000))
    local = build_gateway(cfg)  # for the in-process baseline: the same factories, no gRPC
    running = await start_env_gateway(cfg)
    results = {}
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=None) as channel:
            stub = env_pb2_grpc.EnvironmentStub(channel)
            for name in args.envs:
                spec = local.registry.get(name)
                assert spec is not None and name in WORKLOADS, f"no workload for {name!r}"
                steps, batches = (args.python_steps, args.python_batches) if spec.blocking else (args.steps, args.batches)
                results[name] = await bench_env(stub, name, lambda s=spec: local.registry.create(s), steps, batches)
        concurrent = [await bench_episodes(running.port, args.episode_env, n, args.episode_steps)
                      for n in args.episodes]
    finally:
        await running.stop(None)
        local.shutdown()
    return results, concurrent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--envs", default=",".join(WORKLOADS), type=name_list(WORKLOADS, allow_empty=True),
                        help=f"comma-separated, of {sorted(WORKLOADS)} ('' to skip)")
    parser.add_argument("--steps", type=int_at_least(1), default=2000, help="timed single Steps per inline environment")
    parser.add_argument("--batches", type=int_at_least(1), default=200,
                        help="timed StepBatch(64) calls per inline environment")
    parser.add_argument("--python-steps", type=int_at_least(1), default=40)
    parser.add_argument("--python-batches", type=int_at_least(1), default=3)
    parser.add_argument("--episodes", default="1,64", type=int_list(1, allow_empty=True),
                        help="concurrent episode counts ('' to skip)")
    parser.add_argument("--episode-env", default="arith", choices=sorted(WORKLOADS))
    parser.add_argument("--episode-steps", type=int_at_least(1), default=200,
                        help="timed steps per episode loop per round")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not args.envs and not args.episodes:
        parser.error("--envs '' and --episodes '' leave nothing to run")
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    results, concurrent = asyncio.run(run(args))
    columns = ["env", "Step/s", "StepBatch64 steps/s", "Step p50 ms", "Step p99 ms", "in-process p50 ms",
               "added p50 ms", "added p99 ms", "StepBatch64 / Step"]
    keys = ["step_per_s", "stepbatch64_steps_per_s", "step_p50_ms", "step_p99_ms", "in_process_p50_ms",
            "added_p50_ms", "added_p99_ms", "stepbatch64_over_step"]
    print_table("env_gateway: built-in environments over gRPC (client in-process, 1 event loop)", columns,
                [[name, *(r[k] for k in keys)] for name, r in results.items()])
    episode_keys = ["per_step_steps_per_s", "coalesced_steps_per_s", "coalesced_over_per_step", "per_step_p50_ms",
                    "coalesced_p50_ms", "per_step_p99_ms", "coalesced_p99_ms", "coalesced_calls_per_step",
                    "coalesced_mean_batch"]
    if concurrent:
        print_table(f"concurrent {args.episode_env} episodes through the rollout's env client: one Step call "
                    "per step vs coalesced StepBatches",
                    ["episodes", "per-step steps/s", "coalesced steps/s", "coalesced / per-step", "per-step p50 ms",
                     "coalesced p50 ms", "per-step p99 ms", "coalesced p99 ms", "calls / step", "mean batch"],
                    [[r["episodes"], *(r[k] for k in episode_keys)] for r in concurrent])
    figures = {"environments": results, "batch": BATCH, "bar": 2.0, "concurrent_episodes": concurrent,
               "stepbatch64_over_step": results["arith"]["stepbatch64_over_step"] if "arith" in results else None}
    if "arith" in results:
        arith = results["arith"]
        print(f"stepbatch64_over_step (arith): {arith['stepbatch64_over_step']:.2f} median/median, "
              f"{arith['stepbatch64_over_step_best']:.2f} min/min (bar <= 2); load average {os.getloadavg()[0]:.1f} "
              f"on {os.cpu_count()} cpus")
    write_json(args.json, figures)


if __name__ == "__main__":
    run_main(main)
