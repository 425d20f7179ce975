"""bench/real_model.py's GRPO step through arlo's services, split by what the services record.

The services run as local processes, as `arlo up` + `arlo train` run them (bench/grpo_tiny.py's
`run_cluster`): the checkpoint as `model.path`, synchronous (max_staleness 0), --groups groups of
--group-size samples of up to --step-tokens new tokens per step, one turn of the built-in arith
task (its chat-templated "a*b=" prompt is 20 tokens with the bench's tokenizer; the reward is
exact match, all but always 0 for random weights: the figures do not depend on it). Nothing in
rollout.sampling forces a completion's length (no ignore_eos, no min_tokens): a random policy
rarely samples the end-of-turn token, so most run to the budget, and the mean length actually
generated is reported beside the split. Neither service warms up (warmup_programs 0), so the
first RL step carries every compile and the second is the steady state.

Per RL step, from the trainer's step record (`timing`, `anatomy`: services/trainer/anatomy.py)
and inference's `weight_sync` log line of the version the step published:

- generation: the batch's first episode start to its last trajectory's XADD into the stream,
  and the engine's part of it (the critical trajectory's Generate in the engine);
- intake (stream reads that returned data, decode, grouping), batch building, train step,
  publish (serialise, sha256, store, pointer move), and the trainer's wait for data;
- pull, verify (restore + finiteness check) and swap in inference; publish-to-serving latency
  from the publish's start and from the pointer move to inference serving the version;
- bytes per publish (the pulled payload, serving dtype), beside the serving dtype's parameter
  bytes read from the checkpoint's safetensors headers;
- step 2 on: the step's critical path (bench/step_anatomy.py's `critical_path`);
- each service's peak RSS (VmHWM) at the end of the run.
"""

from __future__ import annotations

import argparse
import json
import os
import struct
from pathlib import Path
from typing import Any

from arlo.app.local import local_cpu_shares
from arlo.compile_cache import ENV as COMPILE_CACHE_ENV
from arlo.config import RunConfig, load_config, replace_config
from bench.common import check_config, print_table
from bench.grpo_tiny import run_cluster
from bench.step_anatomy import critical_path, inference_syncs

PROMPT_TOKENS = 32
"""Room for the arith prompt (20 tokens with the bench tokenizer's ChatML), as the in-process step pads to."""
ENV_CONFIG = '{"op": "*", "max_operand": 30, "tool": false, "max_turns": 1}'
SLOW_S = 3600.0
"""Deadlines (RPCs, episodes, a step) that a 0.5B model on 2 cores must not hit: generation alone takes minutes."""
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "BF16": 2, "F32": 4, "F16": 2}


def step_config(path: Path, args: argparse.Namespace, run_id: str) -> RunConfig:
    return load_config(None, step_overrides(args, run_id, {"path": str(path.resolve())}))


def step_overrides(args: argparse.Namespace, run_id: str, model: dict[str, Any]) -> dict[str, Any]:
    """The step's config overrides; `model` names the checkpoint (its path, or a preset's name)."""
    rows, tokens = args.groups * args.group_size, args.step_tokens
    return {
        "run_id": run_id,
        "model": {**model, "param_dtype": args.param_dtype, "max_seq_len": PROMPT_TOKENS + tokens},
        "inference": {"max_tokens": tokens, "max_n": args.group_size, "max_batch": rows,
                      "max_prompt_tokens": PROMPT_TOKENS, "decode_steps": 8, "warmup_programs": 0},
        "trainer": {"max_staleness": 0, "groups_per_step": args.groups, "remat": "full",
                    "micro_batch_size": args.micro_batch, "logprob_chunk": args.logprob_chunk, "warmup_programs": 0, "sft": {"steps": 0}},
        "rollout": {"env_name": "arith", "env_config_json": ENV_CONFIG, "group_size": args.group_size,
                    "max_turns": 1, "max_episode_tokens": PROMPT_TOKENS + tokens, "concurrent_groups": args.groups,
                    "sampling": {"temperature": 1.0, "max_tokens": tokens}, "eval": {"every_versions": 0},
                    "rpc_timeout_s": SLOW_S, "episode_timeout_s": SLOW_S, "task_lease_s": 2 * SLOW_S}}


def serving_param_bytes(path: Path, dtype: str) -> int:
    """The parameters' bytes in `dtype`, from the safetensors headers (no weights are read)."""
    total = 0
    for shard in sorted(path.glob("*.safetensors")):
        with shard.open("rb") as f:
            header = json.loads(f.read(struct.unpack("<Q", f.read(8))[0]))
        for name, tensor in header.items():
            if name != "__metadata__":
                count = 1
                for dim in tensor["shape"]:
                    count *= dim
                total += count * DTYPE_BYTES[dtype]
    return total


def step_split(record: dict[str, Any], syncs: dict[int, dict[str, float]],
               pointer_at: dict[int, float] | None = None) -> dict[str, Any]:
    """One RL step's phases (seconds unless named otherwise), from its record and its version's
    swap. `pointer_at`: version -> when the pointer named it (the records' `published_at`)."""
    a, t = record["anatomy"], record["timing"]
    c = a["critical"]
    generation = c["xadd_at"] - a["first_started_at"]
    out: dict[str, Any] = {
        "version": record["version"], "step_s": t.get("step_s"), "generation_s": generation,
        "generation_engine_s": c["generate_engine_s"], "generation_engine_share": c["generate_engine_s"] / generation,
        "generation_queue_s": c["generate_queue_s"], "wait_s": t.get("wait_s"), "intake_s": t["intake_s"],
        "batch_s": t["batch_s"], "train_step_s": t["train_s"], "publish_s": t["publish_s"], "tail_s": t["tail_s"],
        "response_length_mean": record.get("response_length_mean"), "loss": record["loss"]}
    sync = syncs.get(record["version"])
    if sync is not None:
        out.update(pull_s=sync["pull_s"], verify_s=sync["verify_s"], swap_s=sync["swap_s"],
                   pull_verify_swap_s=sync["pull_s"] + sync["verify_s"] + sync["swap_s"],
                   publish_to_serving_s=sync["served_at"] - a["trained_at"],
                   bytes_per_publish=sync.get("bytes"))
        if a.get("published_at"):  # 0: the publish failed (a later version covered it)
            out["pointer_to_serving_s"] = sync["served_at"] - a["published_at"]
    path = critical_path(record, syncs, pointer_at)
    if path is not None:
        out["critical_path_s"] = path
    return out


def check_step_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The step's config as the run will build it (on a preset model: the checkpoint is written
    later), --step-cpus against this host; what arlo refuses is argparse's exit 2, before anything runs."""
    def build() -> None:
        cfg = load_config(None, step_overrides(args, "bench-real-model-step", {"name": "tiny"}))
        local_cpu_shares(replace_config(cfg, {"local": {"cpus": args.step_cpus or "off"}}))

    check_config(parser, build)


def service_step(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """--rl-steps RL steps of the workload through the services; each step's split and the run's totals."""
    home = Path(args.step_home).resolve()
    # The services share one compile cache, as a user's runs share $ARLO_HOME's.
    os.environ.setdefault(COMPILE_CACHE_ENV, str(home / "jax-cache"))
    cfg = step_config(path, args, run_id="bench-real-model-step")
    run = run_cluster(cfg, home, args.step_cpus or "off", args.rl_steps, start_timeout_s=900.0,
                      stall_s=SLOW_S)
    syncs = inference_syncs(home / "logs" / "inference.log")
    rl = [r for r in run.records if r.get("phase") == "rl" and r.get("anatomy", {}).get("critical")]
    pointer_at = {r["version"]: r["anatomy"].get("published_at", 0.0) for r in rl}
    steps = [step_split(r, syncs, pointer_at) for r in rl]
    publishes = {s["bytes_per_publish"] for s in steps if s.get("bytes_per_publish")}
    param_bytes = serving_param_bytes(path, args.param_dtype)
    workload = {k: getattr(args, k) for k in ("groups", "group_size", "step_tokens", "micro_batch", "logprob_chunk", "param_dtype",
                                              "rl_steps", "step_cpus")}
    out: dict[str, Any] = {"workload": {**workload, "max_staleness": 0, "remat": "full"},
                           "steps": steps, "serving_param_bytes": param_bytes,
                           "peak_rss_bytes": run.peak_rss, "logs": str(home / "logs"),
                           "late_compiles": {s: int(float(run.status.get(s, {}).get("late_compiles", 0)))
                                             for s in ("inference", "trainer")}}
    if len(publishes) == 1:
        out["bytes_per_publish"] = publishes.pop()
        out["publish_overhead_bytes"] = out["bytes_per_publish"] - param_bytes
    return out


ROWS = (("step (cut to cut)", "step_s"), ("generation (first start -> last XADD)", "generation_s"),
        ("  engine (critical trajectory)", "generation_engine_s"), ("  engine share", "generation_engine_share"),
        ("  queue (critical trajectory)", "generation_queue_s"), ("trainer wait for data", "wait_s"),
        ("intake", "intake_s"), ("batch", "batch_s"), ("train step", "train_step_s"), ("publish", "publish_s"),
        ("trainer tail", "tail_s"), ("pull", "pull_s"), ("verify", "verify_s"), ("swap", "swap_s"),
        ("pull + verify + swap", "pull_verify_swap_s"), ("publish start -> serving", "publish_to_serving_s"),
        ("pointer move -> serving", "pointer_to_serving_s"), ("bytes per publish (MB)", "bytes_per_publish"),
        ("mean completion tokens", "response_length_mean"))


def print_service_step(figures: dict[str, Any], title: str) -> None:
    steps = figures["steps"]
    rows = []
    for label, key in ROWS:
        values = [s.get(key) for s in steps]
        if key == "bytes_per_publish":
            values = [v / 1e6 if v else None for v in values]
        rows.append([label, *["" if v is None else float(v) for v in values]])
    print_table(title, ["phase (s)", *[f"RL step {i + 1} (v{s['version']})" for i, s in enumerate(steps)]], rows)
    published = figures.get("bytes_per_publish")
    print(f"serving-dtype parameter bytes {figures['serving_param_bytes']:,}; bytes per publish "
          f"{'varied' if published is None else f'{published:,}'}; late compiles {figures['late_compiles']}")
    print_table("peak RSS per service (VmHWM at the end)", ["service", "MB"],
                [[name, rss / 1e6] for name, rss in sorted(figures["peak_rss_bytes"].items())])
