"""The critical path of an RL step through the services, synchronous and asynchronous.

Runs bench/grpo_tiny.py's workload (76k by default, `--workload 596k`) through the services and
lays each RL step, the interval between two version cuts (the trainer done with a step: its
pointer moved, or its weights copied for a publish beside the next step), along its critical path from what
the services record anyway:

- the trainer's step record (`arlo:{run}:metrics`, services/trainer/anatomy.py): its tail
  (record, acks), waiting for data, intake, batch, train step and publish, the marks of each,
  and the timings of the step's *critical* trajectory (the last to complete the batch);
- that trajectory's own timings (Trajectory.timings): Reset, Generate (the engine's queue and
  compute, the rest being the RPC), Step, Score, and its XADD time (the stream entry id);
- inference's log line of each installed version: when it saw the version, pull, verify, swap.

A step whose trainer waited for data is data-bound: the path runs back from the read that
completed the batch through the critical trajectory (Redis wait, XADD, Score, Step, Generate,
Reset, admission) and, when that episode started after the previous version was served,
through the swap chain (the previous publish's overlapped rest, publish -> notify, pull, verify,
swap). Everything is clipped to the
step's interval, so what overlapped the previous step is not counted. A step whose trainer
never waited is trainer-bound: the path is the trainer's own phases.

Platform overhead = everything on the path but generation (the engine's compute for the
critical trajectory) and the train step, as a fraction of the step. Reported per phase: mean
milliseconds on the path and share of the mean step (they add up to the step).

Publish beside the next step (services/trainer/loop.py), `--workload 596k --modes 1 --steps 60`,
before (8597084) and after, alternating on an otherwise idle 2-core machine: the publish on the
path 11.6 / 14.5 -> 3.5 / 4.0 ms, overhead over trainer-bound steps 9.8 / 14.0% -> 7.9 / 5.3%,
4.61 / 4.68 -> 5.12 / 4.75 steps/s (data-bound steps, where generation on the shared cores
holds the step, stay at 16-22%). With a step's publish waiting for the previous step's tail
(the bound on copies held: 35967a7), against 9e9d16a alternating: publish 4.8 / 5.1 -> 3.8 /
4.2 ms, 3.62 / 3.76 -> 4.47 / 3.86 steps/s (a busier machine by then).

On one H200 (16 cores, `JAX_PLATFORMS=cuda XLA_FLAGS=--xla_gpu_autotune_level=0 python -m
bench.step_anatomy --workload 596k --warmup 5 --steps 25`), mean ms on the path, sync | async:
- generate: engine 43.5 | 37.0, train 21.2 | 30.3;
- the swap chain in sync: the overlapped publish 26.6, pull 15.3, verify 10.3, swap 3.3;
- publish 5.8 | 18.0, admission 9.9 | 14.6, generate: rpc 13.9 | 10.3, score 13.3 | 8.0;
- step 183 | 135 ms; platform overhead 64.6% | 50.1%; every step data-bound.
The engine's 32 tokens take longer than the in-process baseline's whole step (18-27 ms there).
In async, the train step shares the GPU with the engine and takes 9 ms longer than in sync.
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from bench.common import check_json_arg, int_at_least, int_list, machine, print_table, run_main, write_json
from bench.grpo_tiny import DEFAULT_CPUS, WORKLOADS, check_service_args, run_services

PHASES = ("trainer tail", "publish: overlapped", "publish -> notify", "pull", "verify", "swap", "admission", "reset", "generate: queue",
          "generate: engine", "generate: rpc", "env step", "score", "episode other", "group wait + xadd",
          "redis wait", "intake", "trainer other", "batch", "train", "publish")
WORK = ("generate: engine", "train")
"""What is not platform overhead."""
WAITED_S = 1e-3
"""A step whose trainer waited less than this for data is trainer-bound."""


def inference_syncs(log_path: Path) -> dict[int, dict[str, float]]:
    """Version -> inference's marks for it (notified_at, pull_s, verify_s, swap_s, served_at)."""
    out: dict[int, dict[str, float]] = {}
    if not log_path.is_file():
        return out
    for line in log_path.read_text(errors="replace").splitlines():
        if '"weight_sync"' not in line:
            continue
        try:
            sync = json.loads(line)["weight_sync"]
        except (json.JSONDecodeError, KeyError):
            continue
        out[int(sync["version"])] = sync
    return out


def _clipped(segments: Iterable[tuple[str, float, float]], lo: float, hi: float) -> dict[str, float]:
    out: dict[str, float] = {}
    for label, start, end in segments:
        length = min(end, hi) - max(start, lo)
        if length > 0:
            out[label] = out.get(label, 0.0) + length
    return out


def rollout_chain(record: Mapping[str, Any], syncs: Mapping[int, Mapping[str, float]],
                  pointer_at: Mapping[int, float]) -> list[tuple[str, float, float]]:
    """The data's path into a step, as (phase, start, end) in Unix seconds: from the previous
    cut (when the critical episode started after that version was served) or the episode's
    start, to the trainer's read of it. `pointer_at`: version -> when the pointer named it."""
    a = record["anatomy"]
    c, start = a["critical"], a["prev_cut_at"]
    began = c["started_at"]
    segments: list[tuple[str, float, float]] = []
    sync = syncs.get(record["version"] - 1)
    if sync is not None and began >= sync["served_at"]:
        pulled = sync["notified_at"] + sync["pull_s"]
        pointed = min(max(pointer_at.get(record["version"] - 1, start), start), sync["notified_at"])
        segments += [("publish: overlapped", start, pointed), ("publish -> notify", pointed, sync["notified_at"]),
                     ("pull", sync["notified_at"], pulled),
                     ("verify", pulled, pulled + sync["verify_s"]), ("swap", pulled + sync["verify_s"], sync["served_at"]),
                     ("admission", sync["served_at"], began)]
    else:
        segments.append(("admission", start, began))
    at = began
    rpc = c["generate_s"] - c["generate_queue_s"] - c["generate_engine_s"]
    for label, seconds in (("reset", c["reset_s"]), ("generate: queue", c["generate_queue_s"]),
                           ("generate: engine", c["generate_engine_s"]), ("generate: rpc", rpc),
                           ("env step", c["env_s"]), ("score", c["reward_s"])):
        segments.append((label, at, at + max(seconds, 0.0)))
        at += max(seconds, 0.0)
    ended = began + c["total_s"]
    segments += [("episode other", at, ended), ("group wait + xadd", ended, c["xadd_at"]),
                 ("redis wait", c["xadd_at"], a["read_at"])]
    return segments


def critical_path(record: Mapping[str, Any], syncs: Mapping[int, Mapping[str, float]],
                  pointer_at: Mapping[int, float] | None = None) -> dict[str, float] | None:
    """Phase -> seconds on one RL step's critical path (they sum to the step); None for the first
    step. `pointer_at`: version -> when the pointer named it (the records' `published_at`)."""
    a, t = record.get("anatomy") or {}, record.get("timing") or {}
    start, end = a.get("prev_cut_at"), a.get("cut_at")
    if not start or not end or "critical" not in a:
        return None
    work = {"batch": t["batch_s"], "train": t["train_s"], "publish": t["publish_s"]}
    if t.get("wait_s", 0.0) < WAITED_S:
        # Trainer-bound: the previous step's tail, then the loop's own intake (what it read while
        # that step trained is not on the path: services/trainer/stream_side.py), then the batch.
        intake = t.get("intake_s", 0.0)
        other = max(a["batch_at"] - start - t["tail_s"] - intake, 0.0)
        return {"trainer tail": t["tail_s"], "intake": intake, "trainer other": other, **work}
    # Data-bound: up to the read, the data's path (the trainer's tail ran beside it).
    read_at, ready_at = max(a["read_at"], start), max(a["ready_at"], start)
    return {**_clipped(rollout_chain(record, syncs, pointer_at or {}), start, read_at), "intake": ready_at - read_at,
            "trainer other": a["batch_at"] - ready_at, **work}


def summarise(records: list[dict[str, Any]], syncs: Mapping[int, Mapping[str, float]], warmup: int) -> dict[str, Any]:
    """Mean seconds per phase over the timed RL steps, the step, and the overhead fraction."""
    paths, steps, per_step = [], [], []
    pointer_at = {r["version"]: r["anatomy"].get("published_at", 0.0) for r in records
                  if r.get("phase") == "rl" and r.get("anatomy")}
    for r in records:
        if r.get("phase") != "rl" or r["version"] <= warmup:
            continue
        path = critical_path(r, syncs, pointer_at)
        if path is None:
            continue
        paths.append(path)
        steps.append(r["anatomy"]["cut_at"] - r["anatomy"]["prev_cut_at"])
        bound = "data" if (r.get("timing") or {}).get("wait_s", 0.0) >= WAITED_S else "trainer"
        per_step.append({"version": r["version"], "step_s": steps[-1], "bound": bound, **path})
    if not paths:
        return {"steps": 0}
    # Split by which side held the step up: trainer-bound steps show the trainer's own overhead,
    # data-bound ones the rollout chain's (which one a bar should hold depends on the bottleneck).
    by_bound: dict[str, list[dict[str, Any]]] = {"trainer": [], "data": []}
    for row in per_step:
        by_bound[row["bound"]].append(row)
    n = len(paths)
    mean = {p: sum(path.get(p, 0.0) for path in paths) / n for p in PHASES}
    step = sum(steps) / n
    work = sum(mean[p] for p in WORK)
    return {"steps": n, "step_s": step, "median_step_s": statistics.median(steps), "steps_per_s": 1 / step,
            "phases_s": mean, "unattributed_s": step - sum(mean.values()),
            "data_bound_fraction": sum(1 for r in records if r.get("phase") == "rl" and r["version"] > warmup
                                       and (r.get("timing") or {}).get("wait_s", 0.0) >= WAITED_S) / n,
            "platform_overhead": (step - work) / step,
            "platform_overhead_by_bound": {side: _overhead(rows) for side, rows in by_bound.items() if rows},
            "per_step": per_step}


def _overhead(rows: list[dict[str, Any]]) -> float:
    """Platform overhead over these steps: their time but generation and training, over their time."""
    total = sum(r["step_s"] for r in rows)
    return (total - sum(r.get(p, 0.0) for r in rows for p in WORK)) / total


def run_mode(workload: str, staleness: int, args: argparse.Namespace) -> dict[str, Any]:
    w = WORKLOADS[workload]
    run = run_services(w, staleness, args, args.warmup + args.steps, tag="anatomy")
    syncs = inference_syncs(run.home / "logs" / "inference.log")
    summary = summarise(run.records, syncs, args.warmup)
    return {"workload": workload, "staleness": staleness, **summary,
            "late_compiles": {s: int(float(run.status.get(s, {}).get("late_compiles", 0)))
                              for s in ("inference", "trainer")}}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="76k", choices=sorted(WORKLOADS))
    parser.add_argument("--modes", default="0,1", type=int_list(0), help="max_staleness values; 0 is synchronous")
    parser.add_argument("--warmup", type=int_at_least(1, "the first RL step has no previous version cut to "
                                                        "measure from"),
                        default=5, help="RL steps left out (the first publishes)")
    parser.add_argument("--steps", type=int_at_least(1), default=30, help="timed steps per mode")
    parser.add_argument("--cpus", default=DEFAULT_CPUS, help="local.cpus: auto, off or service=cpu[+cpu],...")
    parser.add_argument("--compute-nice", type=int, help="local.compute_nice (default: the config's)")
    parser.add_argument("--home", default=".arlo/bench-anatomy", help="logs and state of the runs")
    parser.add_argument("--batch-window-s", type=float,
                        help="rollout.batch_window_s (default: the config's; 0: one Generate/Score call each)")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    check_service_args(parser, args, [args.workload], args.modes)
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    modes = [run_mode(args.workload, m, args) for m in args.modes]
    names = [("sync" if m["staleness"] == 0 else f"async s={m['staleness']}") for m in modes]
    rows = []
    for phase in PHASES:
        row: list[Any] = [phase]
        for m in modes:
            seconds = m.get("phases_s", {}).get(phase, 0.0)
            row += [seconds * 1e3, 100 * seconds / m["step_s"] if m.get("step_s") else 0.0]
        rows.append(row)
    rows.append(["step (mean)", *[v for m in modes for v in (m.get("step_s", 0.0) * 1e3, 100.0)]])
    columns = ["phase on the critical path", *[f"{n} {u}" for n in names for u in ("ms", "%")]]
    print_table(f"RL step anatomy, {args.workload}: {args.steps} steps after {args.warmup}; cpus {args.cpus}"
                f"{'' if args.compute_nice is None else f', compute_nice {args.compute_nice}'}",
                columns, rows)
    for name, m in zip(names, modes, strict=True):
        if m.get("steps"):
            print(f"{name}: {m['steps_per_s']:.2f} steps/s (median step {m['median_step_s'] * 1e3:.0f} ms), "
                  f"platform overhead {m['platform_overhead']:.1%} ("
                  + ", ".join(f"{v:.1%} over {k}-bound steps" for k, v in m["platform_overhead_by_bound"].items())
                  + f"), data-bound steps {m['data_bound_fraction']:.0%}, "
                  f"late compiles {m['late_compiles']}")
    write_json(args.json, {"workload": args.workload, "modes": modes, "cpus": args.cpus, "warmup": args.warmup,
                           "compute_nice": args.compute_nice, "steps": args.steps, "machine": machine()})
    if empty := [n for n, m in zip(names, modes, strict=True) if not m.get("steps")]:
        raise SystemExit(f"no step of {', '.join(empty)} could be laid out (records without anatomy?): "
                         f"the figures above are empty; logs under {Path(args.home).resolve()}")


if __name__ == "__main__":
    run_main(main)
