"""GRPO on tiny Qwen-shaped policies: arlo's services (sync and async) against an in-process loop.

Issue 17's workloads, same shapes on both sides:

- `76k`: `qwen3-76k` (qk_norm, grouped KV), 4 prompts x 4 samples x 16 tokens per step;
- `596k`: `qwen3-596k`, 8 prompts x 4 samples x 32 tokens per step;
- `4m`: `qwen2-4m` (q/k/v biases, grouped KV), 8 prompts x 8 samples x 32 tokens per step, with
  activation rematerialisation (`trainer.remat: full`) on both sides;
- `agent`: `qwen3-76k`, 4 prompts x 4 samples, arith multi-turn: 3 model turns of 16 tokens per
  episode (a random policy is wrong each turn, so the env answers and it tries again). Two
  baselines: turns batched across episodes, and Tunix-style batch-1 generate calls
  (bench/grpo_inprocess_agent.py); `arlo_over_batch1_agent` is arlo async over the latter.

arlo runs the demo's services as local processes (the arith task, one turn, no tool, no warm
start, no evaluation) and is timed between the trainer's pointer moves: the bench subscribes to
the weights channel and stamps each new version, so the first `--warmup` steps (compilation)
are left out and no polling blurs the figures. The in-process baseline (bench/grpo_inprocess.py)
is one process: jitted KV-cache generation of the whole batch, the reward, the Learner's jitted
GRPO step. Reported: steps/s, completions/s, generated tokens/s (every turn's model tokens),
model turns per episode, trajectories dropped as stale, and `arlo_over_inprocess` (arlo async
steps/s over the baseline's).

`--batch-window-s 0` turns off the rollout's call coalescing (rollout.batch_window_s: one
Generate and one Score call per episode, as before GenerateBatch). Two back-to-back runs on the
2-core dev machine, nothing else running (steps/s; in-process | arlo sync | arlo async):

| workload | coalescing on | off |
|---|---|---|
| 76k | 63.3 / 9.13 / 11.63 | 62.2 / 7.43 / 6.55 |
| 596k | 6.80 / 4.23 / 4.38 | 5.90 / 2.54 / 3.03 |
| agent | 14.7 / 5.67 / 6.70 | 11.0 / 3.70 / 4.46 |

The same machine ran the 596k workload at 7.46 / 4.34 / 5.47 in an earlier run on: its figures
move by 20% between runs, so compare ratios taken in one run.

Closes off the critical path (services/rollout/env_closes.py: an episode no longer waits for its
session's Close; those of episodes that end together leave as one CloseBatch), `--workloads
76k,agent` at d7d3313 (before) and after, back to back: agent sync 5.55 -> 7.30 and 5.95,
async 7.21 -> 8.90 and 9.18 steps/s (arlo over the batch-1 loop 0.84 -> 1.03 and 1.05); 76k
flat (12.5 / 13.7 -> 12.2 / 13.8).

On one H200 (16 cores; JAX 0.11.2, the image's flax 0.12.10; `JAX_PLATFORMS=cuda python -m
bench.grpo_tiny --workloads 596k --warmup 5 --steps 20 --inprocess-cpus ''`), two runs, steps/s,
in-process | arlo sync | arlo async: 54.5 / 6.18 / 7.38 and 36.7 / 4.82 / 6.89. So arlo over
in-process is 0.14 and 0.19, and async over sync 1.19 and 1.43. A step of this model costs the
baseline 18-27 ms on the GPU, and arlo's fixed per-step cost (RPCs, Redis, the weight chain;
bench/step_anatomy.py: 50% of an async step, 65% of a sync one there) decides. Inference and the
trainer shared the one GPU, each with 45% of its memory (local.accelerator_memory).

Issue 34 (trainer as a pure core plus one driver), 2026-12-06, the 2-core dev machine shared with
other agents' tests and demos (load average 4-14, mostly 6-8): `--workloads 596k --no-inprocess
--steps 20`, before (33301d4, b1a364d^) and after (59f88a1) interleaved, ten pairs, steps/s sync /
async. Before's run 1, and run 2's async side, failed at start (inference not healthy in 180 s:
a cold compile cache at load 10-14). Means: sync 1.19 -> 1.62 (x1.36), async 1.55 -> 1.42 (x0.92); one tree spans
0.4-2.4, so no change shows through this noise.

| pair | before | after | pair | before | after |
|---|---|---|---|---|---|
| 1 | failed | 1.90 / 2.31 | 6 | 1.94 / 1.42 | 1.93 / 1.59 |
| 2 | 0.59 / failed | 1.99 / 0.87 | 7 | 1.71 / 1.07 | 1.08 / 0.61 |
| 3 | 0.40 / 1.93 | 1.88 / 2.44 | 8 | 0.59 / 1.11 | 1.20 / 0.96 |
| 4 | 1.88 / 1.33 | 1.48 / 1.37 | 9 | 0.92 / 1.97 | 1.55 / 0.90 |
| 5 | 1.39 / 1.65 | 1.98 / 1.78 | 10 | 1.33 / 1.86 | 1.23 / 1.43 |
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from arlo.app.driver import RunDriver
from arlo.app.local import INFRA_SERVICES, local_cpu_shares, prepare_cluster
from arlo.app.supervisor import Supervisor
from arlo.compile_cache import ENV as COMPILE_CACHE_ENV
from arlo.config import RunConfig, load_config, replace_config
from arlo.coord import Keys, connect, read_statuses
from arlo.coord.metrics import MetricsStream
from arlo.data import resource_path
from arlo.model.tokenizer import ByteTokenizer
from bench.arith_turns import env_config, env_config_json, episode_tokens, turn_prompt_tokens
from bench.common import (
    check_config,
    check_json_arg,
    int_at_least,
    int_list,
    machine,
    name_list,
    print_table,
    run_main,
    stop_cluster,
    write_json,
)

DEMO_CONFIG = resource_path("demo.yaml")
OnStamp = Callable[[RunConfig, int], None]
DEFAULT_CPUS = "auto"
"""`local.cpus` of the runs: the layout a user's `arlo demo` gets (arlo/app/cpu_layout.py)."""


@dataclass(frozen=True)
class Workload:
    name: str
    model: str
    prompts: int
    samples: int
    tokens: int
    """New tokens per model turn."""
    turns: int = 1
    """Model turns per episode (the arith env's max_turns and the rollout's)."""
    remat: str = "none"
    """The trainer's activation rematerialisation, on both sides."""

    @property
    def completions(self) -> int:
        return self.prompts * self.samples


# max_turns 3 for `agent`: its longest episode (106 tokens, bench/arith_turns.py) still fits the
# 76k policy's 128-token context, so no turn is cut short; a fourth turn would need 146.
WORKLOADS = {w.name: w for w in (Workload("76k", "qwen3-76k", 4, 4, 16), Workload("596k", "qwen3-596k", 8, 4, 32),
                                 Workload("4m", "qwen2-4m", 8, 8, 32, remat="full"),
                                 Workload("agent", "qwen3-76k", 4, 4, 16, turns=3))}
# "a*b=": exact match scores the answer. A turn's budget is the workload's (no stop token is
# forced: a random policy rarely emits EOS, so most turns run to it).
LEARNING_RATE = 0.002
PROMPT_TOKENS = 16
"""The chat-templated "a*b=" prompt fits in 16 tokens (the baseline pads its prompts to 16 as well)."""


def token_limits(w: Workload) -> tuple[int, int]:
    """(the longest prompt the rollout sends, the longest episode): inference.max_prompt_tokens and
    rollout.max_episode_tokens. Multi-turn prompts grow by a turn and the env's reply each turn."""
    if w.turns == 1:
        return PROMPT_TOKENS, PROMPT_TOKENS + w.tokens
    tok, config = ByteTokenizer(), env_config(w.turns)
    return turn_prompt_tokens(tok, config, w.tokens, w.turns), episode_tokens(tok, config, w.tokens)


def warmup_programs(w: Workload) -> tuple[dict[str, int], dict[str, int]]:
    """(inference, trainer) overrides that compile every program of a multi-turn workload at start.

    A later turn's prompt reuses the episode's KV prefix, so prefills come at many offsets: the
    agent's limits allow 43 engine programs (its start-up log counts them), past the default
    warm-up of 16, and its episodes span 4 trainer buckets (16..112), past 3. Left so, they would
    compile mid-run, in the timed window; a single turn's few programs are warmed up already."""
    return ({}, {}) if w.turns == 1 else ({"warmup_programs": 128}, {"warmup_programs": 8})


def service_config(w: Workload, staleness: int, run_id: str) -> RunConfig:
    prompt_tokens, episode = token_limits(w)
    inference, trainer = warmup_programs(w)
    return load_config(DEMO_CONFIG, {
        "run_id": run_id, "model": {"name": w.model},
        # Limits sized to the workload, as a user sizes them: they bound the engine's program set.
        "inference": {"max_tokens": w.tokens, "max_n": w.samples, "max_batch": 2 * w.completions,
                      "max_prompt_tokens": prompt_tokens, **inference},
        "trainer": {"max_staleness": staleness, "groups_per_step": w.prompts, "learning_rate": LEARNING_RATE,
                    "remat": w.remat, "sft": {"steps": 0}, **trainer},
        "rollout": {"env_config_json": env_config_json(w.turns), "group_size": w.samples, "max_turns": w.turns,
                    # The episode budget counts the prompt (and every turn's reply) too.
                    "max_episode_tokens": episode, "concurrent_groups": 2 * w.prompts,
                    "sampling": {"temperature": 1.0, "max_tokens": w.tokens}, "eval": {"every_versions": 0}}})


async def stamp_versions(cfg: RunConfig, stamps: dict[int, float], ready: asyncio.Event,
                         on_stamp: OnStamp | None = None) -> None:
    """Records when each version is published (the trainer's step end), from the pointer's channel;
    `on_stamp(cfg, version)` runs at each new version (e.g. a scrape of a service's counters then)."""
    redis = await connect(cfg.redis)
    pubsub = redis.pubsub(ignore_subscribe_messages=True)
    try:
        await pubsub.subscribe(Keys(cfg.run_id).weights_events)
        ready.set()
        async for message in pubsub.listen():
            version = int(message["data"])
            if version not in stamps:
                stamps[version] = time.monotonic()
                if on_stamp is not None:
                    on_stamp(cfg, version)
    finally:
        await pubsub.aclose()
        await redis.aclose()


async def counters(cfg: RunConfig) -> dict[str, dict[str, Any]]:
    redis = await connect(cfg.redis)
    try:
        return {s["service"]: s for s in await read_statuses(redis, cfg.run_id)}
    finally:
        await redis.aclose()


async def metric_records(cfg: RunConfig) -> list[dict[str, Any]]:
    """Every step record the trainer wrote to the run's metrics stream, oldest first."""
    redis = await connect(cfg.redis)
    try:
        stream, out, last = MetricsStream(redis, cfg.run_id), [], "0-0"
        while batch := await stream.after(last):
            last = batch[-1][0]
            out += [r for _, r in batch]
        return out
    finally:
        await redis.aclose()


@dataclass
class ServiceRun:
    """What one run through the services left: pointer stamps, heartbeats, step records, where its
    logs are, each service's peak RSS (VmHWM, bytes) and the rollout's and inference's /metrics
    counters, read just before the stop."""

    stamps: dict[int, float]
    status: dict[str, dict[str, Any]]
    records: list[dict[str, Any]]
    home: Path
    peak_rss: dict[str, int] = field(default_factory=dict)
    metrics: dict[str, dict[str, float]] = field(default_factory=dict)


def scrape(port: int) -> dict[str, float]:
    """A service's Prometheus counters, `name{labels}` -> value (e.g. the rollout's turns_total);
    empty when the scrape fails: the figures that need them are missing, the run's others stand."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError as e:
        logging.warning("no /metrics on port %d: %s", port, e)
        return {}
    return counters_of(text)


def counters_of(text: str) -> dict[str, float]:
    """The `arlo_*_total` samples of a Prometheus text exposition."""
    return {name: float(value) for name, _, value in (line.rpartition(" ") for line in text.splitlines())
            if name.startswith("arlo_") and name.split("{")[0].endswith("_total")}


def generate_calls(inference: dict[str, float]) -> tuple[int, int]:
    """(Generate calls answered OK, answered with an error: a prompt over max_prompt_tokens, ...)."""
    calls = {k: v for k, v in inference.items() if k.startswith("arlo_rpc_requests_total{") and "Generate" in k}
    ok = sum(v for k, v in calls.items() if 'code="OK"' in k)
    return int(ok), int(sum(calls.values()) - ok)


async def drive(cfg: RunConfig, token: str | None, steps: int, check: Any, stall_s: float = 300.0,
                on_stamp: OnStamp | None = None) -> tuple[dict[int, float], dict, list]:
    """`steps` RL steps, as `arlo train` drives them; `stall_s`: the longest a step may take."""
    stamps: dict[int, float] = {}
    ready = asyncio.Event()
    stamper = asyncio.create_task(stamp_versions(cfg, stamps, ready, on_stamp))
    await ready.wait()
    try:
        await RunDriver(cfg, token, on_progress=lambda row: None, check_children=check, evaluate=False,
                        eval_tags=(), stall_s=stall_s).run(steps)
        await asyncio.sleep(2.5)  # one heartbeat period: the counters are fresh
        return stamps, await counters(cfg), await metric_records(cfg)
    finally:
        stamper.cancel()


def peak_rss(supervisor: Supervisor) -> dict[str, int]:
    """Service -> its peak resident set (VmHWM) so far, in bytes; a service already gone is left out."""
    out = {}
    for name, child in supervisor.children.items():
        try:
            status = Path(f"/proc/{child.process.pid}/status").read_text()
        except OSError:
            continue
        for line in status.splitlines():
            if line.startswith("VmHWM:"):
                out[name] = int(line.split()[1]) * 1024
    return out


def local_overrides(cpus: str, compute_nice: int | None) -> dict[str, Any]:
    return {"local": {"cpus": cpus, **({} if compute_nice is None else {"compute_nice": compute_nice})}}


def run_cluster(cfg: RunConfig, home: Path, cpus: str, steps: int, *, compute_nice: int | None = None,
                start_timeout_s: float = 180.0, stall_s: float = 300.0, on_stamp: OnStamp | None = None) -> ServiceRun:
    """`cfg` through the services as local processes (a fresh run under `home`) for `steps` RL steps;
    `cpus`: their `local.cpus` ("auto", "off" or explicit shares); `compute_nice`: local.compute_nice
    (None: the default); `on_stamp(cfg, version)`: called as each version is published (`cfg` with
    the ports the run got). The run's Redis keys are deleted at the end (its figures are read by then)."""
    cfg = replace_config(cfg, local_overrides(cpus, compute_nice))
    cluster = prepare_cluster(cfg, home=home, free_ports=True, fresh_run=True)
    try:
        cluster.start(INFRA_SERVICES, timeout_s=start_timeout_s)
        cluster.start(("rollout",), timeout_s=start_timeout_s)
        stamps, status, records = asyncio.run(drive(cluster.cfg, cluster.token, steps, cluster.supervisor.check,
                                                    stall_s=stall_s, on_stamp=on_stamp))
        peaks = peak_rss(cluster.supervisor)
        metrics = {name: scrape(getattr(cluster.cfg, name).server.metrics_port) for name in ("rollout", "inference")}
    finally:
        stop_cluster(cluster)
    return ServiceRun(stamps=stamps, status=status, records=records, home=home, peak_rss=peaks, metrics=metrics)


def bench_config(w: Workload, staleness: int, args: argparse.Namespace, tag: str) -> RunConfig:
    """The workload's service config with the flags' overrides (--batch-window-s)."""
    cfg = service_config(w, staleness, f"bench-{tag}-{w.name}-s{staleness}")
    if getattr(args, "batch_window_s", None) is not None:  # A/B of the rollout's call coalescing
        cfg = replace_config(cfg, {"rollout": {"batch_window_s": args.batch_window_s}})
    return cfg


def check_service_args(parser: argparse.ArgumentParser, args: argparse.Namespace, workloads: list[str],
                       modes: list[int]) -> None:
    """Builds every run's config as the run will (the flags' overrides, --cpus against this host's
    CPUs) and refuses what arlo refuses (ConfigError) with argparse's exit 2, before anything runs."""
    def build_all() -> None:
        for name in workloads:
            for staleness in modes:
                local_cpu_shares(replace_config(bench_config(WORKLOADS[name], staleness, args, "check"),
                                                local_overrides(args.cpus, args.compute_nice)))

    check_config(parser, build_all)


def run_services(w: Workload, staleness: int, args: argparse.Namespace, steps: int, tag: str = "grpo") -> ServiceRun:
    """The workload through the services (local processes, CPU shares from --cpus) for `steps` RL steps."""
    cfg = bench_config(w, staleness, args, tag)
    # One compile cache for every run of the bench (a user's runs share $ARLO_HOME's the same way).
    os.environ.setdefault(COMPILE_CACHE_ENV, str(Path(args.home).resolve() / "jax-cache"))
    return run_cluster(cfg, Path(args.home).resolve() / f"{w.name}-s{staleness}", args.cpus, steps,
                       compute_nice=args.compute_nice)


def run_arlo(w: Workload, staleness: int, args: argparse.Namespace) -> dict[str, Any]:
    run = run_services(w, staleness, args, args.warmup + args.steps)
    stamps, status = run.stamps, run.status
    versions = sorted(v for v in stamps if v >= args.warmup)
    first = args.warmup
    if first not in stamps or len(versions) < 2:
        raise RuntimeError(f"{w.name} staleness {staleness}: versions {sorted(stamps)} seen published, not "
                           f"{first}..{first + args.steps}; the run's logs are under {run.home / 'logs'}")
    last = versions[-1]
    wall = stamps[last] - stamps[first]
    steps_per_s = (last - first) / wall
    # A step that compiles a new shape mid-run (a new length bucket) stalls for seconds; the
    # median step shows the steady state beside the mean that includes them.
    intervals = [stamps[v] - stamps[v - 1] for v in versions if v - 1 in stamps and v > first]
    inference = status.get("inference", {})
    requests = float(inference.get("requests", 1))
    trainer = status.get("trainer", {})
    # Model tokens of the trajectories trained in the timed window (the records' running total).
    generated = {r["version"]: r["generated_tokens"] for r in run.records if r.get("phase") == "rl"}
    rollout = run.metrics.get("rollout", {})
    ok, refused = generate_calls(run.metrics.get("inference", {}))
    return {"workload": w.name, "side": "arlo sync" if staleness == 0 else f"arlo async (staleness {staleness})",
            "staleness": staleness, "steps_timed": last - first, "wall_s": wall, "steps_per_s": steps_per_s,
            "completions_per_s": steps_per_s * w.completions,
            "generated_tokens_per_s": (generated[last] - generated[first]) / wall,
            "median_step_s": statistics.median(intervals), "max_step_s": max(intervals),
            "shared_prefill_fraction": float(inference.get("shared_prefills", 0)) / max(requests, 1.0),
            "inference_programs": int(float(inference.get("programs", 0))),
            # XLA compiles after each service's warm-up (stalls on the critical path; 0 is the goal).
            "late_compiles_inference": int(float(inference.get("late_compiles", 0))),
            "late_compiles_trainer": int(float(trainer.get("late_compiles", 0))),
            "dropped_stale": int(float(trainer.get("dropped_stale", 0))),
            "consumed": int(float(trainer.get("consumed", 0))),
            # Over the whole run (warm-up included): every episode the rollout finished.
            "turns_per_episode": rollout.get("arlo_rollout_turns_total", 0.0)
            / max(rollout.get("arlo_rollout_episodes_total", 0.0), 1.0),
            "failed_groups": int(rollout.get("arlo_rollout_failed_groups_total", 0)),
            # 0 refused is the check that the limits cover the workload (0 ok: the scrape failed).
            "generate_ok": ok, "refused_requests": refused}


def inprocess_sides(w: Workload) -> dict[str, list[str]]:
    """Baseline side -> its module and flags: single-turn workloads have one, `agent` two."""
    if w.turns == 1:
        return {"in-process": ["bench.grpo_inprocess"]}
    agent = ["bench.grpo_inprocess_agent", "--turns", str(w.turns)]
    return {"in-process": agent, "in-process batch-1": [*agent, "--batch1"]}


def run_inprocess(w: Workload, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The baselines, each in its own process (its own JAX, pinned like the trainer), JSON on stdout."""
    rows = []
    for side, module in inprocess_sides(w).items():
        cmd = [sys.executable, "-m", *module, "--model", w.model, "--prompts", str(w.prompts),
               "--samples", str(w.samples), "--tokens", str(w.tokens), "--warmup", str(args.warmup),
               "--steps", str(args.steps), "--learning-rate", str(LEARNING_RATE), "--remat", w.remat]
        if args.inprocess_cpus:
            cmd = ["taskset", "-c", args.inprocess_cpus, *cmd]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"the {side} baseline ({' '.join(cmd)}) exited {proc.returncode}:\n"
                               f"{proc.stderr[-3000:]}")
        out = proc.stdout
        rows.append({"workload": w.name, "side": side, "staleness": 0, **json.loads(out.strip().splitlines()[-1])})
    return rows


# Baseline side -> the figure naming arlo async's steps/s over it.
RATIOS = {"in-process": "arlo_over_inprocess", "in-process batch-1": "arlo_over_batch1"}


def ratios(rows: list[dict[str, Any]], names: list[str]) -> dict[str, float]:
    """arlo async (its best staleness) over each baseline and over arlo sync, per workload."""
    out = {}
    for name in names:
        mine = [r for r in rows if r["workload"] == name]
        sync = next((r for r in mine if r["side"] == "arlo sync"), None)
        best = max((r for r in mine if r["staleness"] > 0), key=lambda r: r["steps_per_s"], default=None)
        if best is None:
            continue
        for r in mine:
            if r["side"] in RATIOS:
                out[f"{RATIOS[r['side']]}_{name}"] = best["steps_per_s"] / r["steps_per_s"]
        if sync:
            out[f"async_over_sync_{name}"] = best["steps_per_s"] / sync["steps_per_s"]
    return out


MIN_INPROCESS_STEPS = 2
"""Timed steps the in-process baseline needs: its median step is over the intervals between them."""


def cpu_list_problem(text: str) -> str | None:
    """Why taskset's CPU list `text` ("0,1", "0-3") would not pin the baseline here (None: it would)."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        return f"expected CPUs as taskset takes them (0,1 or 0-3), got {text!r}"
    if hasattr(os, "sched_getaffinity") and not cpus <= (usable := os.sched_getaffinity(0)):
        return f"CPUs {sorted(cpus - usable)} are not among this process's {','.join(map(str, sorted(usable)))}"
    if shutil.which("taskset") is None:
        return "taskset is not installed"
    return None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="76k", type=name_list(WORKLOADS),
                        help=f"comma-separated, of {sorted(WORKLOADS)}")
    parser.add_argument("--modes", default="0,1", type=int_list(0), help="arlo max_staleness values; 0 is synchronous")
    parser.add_argument("--warmup", type=int_at_least(1, "arlo's timing starts at the version the last warm-up "
                                                        "step publishes; the initial weights are never published"),
                        default=10, help="steps left out of the timing (compilation)")
    parser.add_argument("--steps", type=int_at_least(1), default=30,
                        help=f"timed steps per side (>= {MIN_INPROCESS_STEPS} with the in-process baseline)")
    parser.add_argument("--cpus", default=DEFAULT_CPUS, help="local.cpus: auto, off or service=cpu[+cpu],...")
    parser.add_argument("--compute-nice", type=int, help="local.compute_nice (default: the config's)")
    parser.add_argument("--inprocess-cpus", default="0,1", help="taskset CPUs of the baseline ('' = no pinning)")
    parser.add_argument("--no-inprocess", action="store_true", help="arlo only")
    parser.add_argument("--batch-window-s", type=float,
                        help="rollout.batch_window_s (default: the config's; 0: one Generate/Score call each)")
    parser.add_argument("--home", default=".arlo/bench-grpo", help="logs and state of the runs")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if not args.no_inprocess and args.steps < MIN_INPROCESS_STEPS:
        parser.error(f"--steps must be >= {MIN_INPROCESS_STEPS} with the in-process baseline (its median step "
                     f"needs two timed steps), got {args.steps}; --no-inprocess times arlo alone from 1")
    if not args.no_inprocess and args.inprocess_cpus and (problem := cpu_list_problem(args.inprocess_cpus)):
        parser.error(f"--inprocess-cpus {args.inprocess_cpus}: {problem} ('' runs the baseline unpinned)")
    check_service_args(parser, args, args.workloads, args.modes)
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    rows: list[dict[str, Any]] = []
    started = time.monotonic()

    def progress(new: list[dict[str, Any]]) -> None:  # a run of several minutes says how far it is
        for r in new:
            print(f"[{time.monotonic() - started:.0f}s] {r['workload']} {r['side']}: {r['steps_per_s']:.2f} steps/s",
                  file=sys.stderr, flush=True)
        rows.extend(new)

    for name in args.workloads:
        w = WORKLOADS[name]
        if not args.no_inprocess:
            progress(run_inprocess(w, args))
        for m in args.modes:
            progress([run_arlo(w, m, args)])
    figures: dict[str, Any] = {"rows": rows, "cpus": args.cpus, "warmup": args.warmup, "steps": args.steps,
                               **ratios(rows, args.workloads)}
    keys = ["workload", "side", "steps_per_s", "completions_per_s", "generated_tokens_per_s", "turns_per_episode",
            "median_step_s", "max_step_s", "dropped_stale", "shared_prefill_fraction"]
    print_table(f"GRPO tiny: {args.steps} timed steps after {args.warmup}; cpus {args.cpus}",
                ["workload", "side", "steps/s", "completions/s", "gen tokens/s", "turns/episode", "median step s",
                 "max step s", "dropped stale", "shared prefill"],
                [[r.get(k, "") for k in keys] for r in rows])
    for key, value in figures.items():
        if key.startswith(("arlo_over", "async_over")):
            print(f"{key} {value:.2f}")
    figures["machine"] = machine()
    write_json(args.json, figures)


if __name__ == "__main__":
    run_main(main)
