"""Time from `arlo demo` to the first RL step, with a cold and a warm compile cache.

Runs `arlo demo -c CONFIG --no-eval --steps N` as a user does, on bench/grpo_tiny.py's workload
(76k by default), in a fresh $ARLO_HOME each time: first with an empty compile cache (cold),
then again with the cache that run filled (warm). The first RL step's time is its record in
the run's metrics.jsonl; the milestones on the way come from the services' logs (each
process's first line, its warm-up, the trainer's first step). Bars (issue 17): warm <= 15 s,
cold <= 60 s.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

from arlo.app.redis_server import redis_answers
from arlo.compile_cache import ENV as COMPILE_CACHE_ENV
from arlo.config import dump_config
from bench.common import (
    check_json_arg,
    int_at_least,
    machine,
    print_table,
    run_main,
    wipe_namespace,
    write_json,
)
from bench.grpo_tiny import WORKLOADS, service_config

SERVICES = ("env_gateway", "reward", "inference", "trainer", "rollout")


def _log_times(path: Path) -> list[tuple[float, str]]:
    """(Unix time, message) of each JSON log line."""
    out = []
    if not path.is_file():
        return out
    for line in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(line)
            out.append((datetime.fromisoformat(entry["ts"]).timestamp(), entry.get("msg", "")))
        except (json.JSONDecodeError, KeyError, ValueError):
            continue
    return out


def milestones(home: Path, launched: float) -> dict[str, float]:
    """Seconds after the launch at which each service logged first and finished its warm-up."""
    out: dict[str, float] = {}
    for name in SERVICES:
        lines = _log_times(home / "logs" / f"{name}.log")
        if lines:
            out[f"{name}_first_log_s"] = lines[0][0] - launched
        warm = [t for t, msg in lines if msg.startswith("warm-up done")]
        if warm:
            out[f"{name}_warm_s"] = warm[0] - launched
    return out


def first_rl_step(home: Path) -> float | None:
    for path in sorted((home / "runs").glob("*/metrics.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            if row.get("kind") == "step" and row.get("phase") == "rl":
                return float(row["time"])
    return None


def launch(workload: str, cache: Path, steps: int, label: str) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix=f"arlo-first-step-{label}-"))
    # A run id of its own: the shared Redis keeps other runs' pointers and streams.
    cfg = service_config(WORKLOADS[workload], 0, f"bench-first-{uuid.uuid4().hex[:8]}")
    config = home / "config.in.yaml"
    dump_config(cfg, config)
    env = {**os.environ, "ARLO_HOME": str(home), COMPILE_CACHE_ENV: str(cache)}
    launched = time.time()
    try:
        with open(home / "demo.out", "wb") as out:
            code = subprocess.run([sys.executable, "-m", "arlo.app.cli", "demo", "-c", str(config), "--no-eval",
                                   "--steps", str(steps)], env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    finally:
        if redis_answers(cfg.redis.url):  # the shared Redis (a demo's own went with it): its run's keys go
            wipe_namespace(cfg)
    first = first_rl_step(home)
    return {"cache": label, "exit_code": code, "home": str(home),
            "first_step_s": None if first is None else first - launched, **milestones(home, launched)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="76k", choices=sorted(WORKLOADS))
    parser.add_argument("--steps", type=int_at_least(1), default=3, help="RL steps each demo runs")
    parser.add_argument("--cache", help="compile cache directory (default: a fresh temporary one, so cold)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    if args.cache is not None:
        cache = Path(args.cache)
        if not args.cache or (cache.exists() and not cache.is_dir()):
            parser.error(f"--cache {args.cache!r} is not a folder")
        if not cache.exists() and not cache.resolve().parent.is_dir():
            parser.error(f"--cache {args.cache}: no folder {cache.resolve().parent}")
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cache = Path(args.cache or tempfile.mkdtemp(prefix="arlo-jax-cache-"))
    cache.mkdir(exist_ok=True)
    runs = [launch(args.workload, cache, args.steps, "cold" if not any(cache.iterdir()) else "given"),
            launch(args.workload, cache, args.steps, "warm")]
    keys = ["first_step_s", *[f"{s}_{k}" for s in SERVICES for k in ("first_log_s", "warm_s")]]
    rows = [[k, *[r.get(k, "") for r in runs]] for k in keys if any(k in r for r in runs)]
    print_table(f"arlo demo -> first RL step, {args.workload} (seconds after launch)", ["", *[r["cache"] for r in runs]],
                rows)
    write_json(args.json, {"workload": args.workload, "runs": runs, "bars": {"warm_s": 15, "cold_s": 60},
                           "machine": machine()})


if __name__ == "__main__":
    run_main(main)
