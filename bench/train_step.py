"""Train-step throughput against this machine's roofline, and the longest sequence that fits.

    python -m bench.train_step [--model small] [--groups 4] [--group-size 4] [--seq 256]
                               [--budget-mib 1024] [--json PATH]

FLOPs are counted as the issue defines them: 6 x non-embedding parameters x tokens, plus
attention (QK^T and AV over the full padded length, forward and backward: 12 x B x T^2 x
heads x head_dim x layers). Bytes for the memory floor: parameters read in forward and
backward, gradients written, AdamW reading and writing params, m and v (9 x 4 bytes/param).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from arlo.config import TrainerConfig
from arlo.hostmem import reexec_with_tunables
from arlo.model import ModelConfig
from arlo.model.source import ModelSource
from arlo.proto.v1 import common_pb2
from bench.common import check_json_arg, int_at_least, print_table, run_main, write_json
from bench.roofline import best_time, measure_ceilings
from services.trainer.batching import build_batch
from services.trainer.learner import Learner

MIN_SWEEP_LEN = 256
"""The memory sweep's shortest sequence length (it doubles up to --max-len)."""


def synthetic_groups(groups: int, size: int, seq: int, seed: int = 0) -> list[list[common_pb2.Trajectory]]:
    """Full-length trajectories: a quarter prompt, the rest generated."""
    rng = np.random.default_rng(seed)
    prompt = seq // 4
    out = []
    for g in range(groups):
        members = []
        for k in range(size):
            ids = [int(x) for x in rng.integers(0, 256, seq)]
            members.append(common_pb2.Trajectory(
                id=f"{g}-{k}", group_id=f"g{g}", group_size=size, token_ids=ids,
                logprobs=[0.0] * prompt + [-3.0] * (seq - prompt), loss_mask=[0] * prompt + [1] * (seq - prompt),
                policy_versions=[-1] * prompt + [0] * (seq - prompt), reward=float(rng.integers(0, 2))))
        out.append(members)
    return out


def step_flops(cfg: ModelConfig, rows: int, length: int) -> float:
    embed = cfg.vocab_size * cfg.dim * (1 if cfg.tie_embeddings else 2)
    dense = 6.0 * (cfg.num_params() - embed) * rows * length
    attention = 12.0 * rows * length**2 * cfg.num_heads * cfg.head_dim * cfg.num_layers
    return dense + attention


def measure_step(cfg: ModelConfig, groups: int, size: int, seq: int) -> dict[str, float]:
    learner = Learner(ModelSource.from_config(cfg, seed=0), cfg=TrainerConfig(learning_rate=1e-4))
    batch = build_batch(synthetic_groups(groups, size, seq), cfg.max_seq_len + 1, 256)
    seconds = best_time(lambda: learner.step(batch).loss, repeats=3)
    rows, length = batch.tokens_bt.shape
    return {"step_s": seconds, "tokens_per_s": rows * length / seconds, "rows": rows, "length": length,
            "flops": step_flops(cfg, rows, length - 1), "bytes": 9 * 4 * cfg.num_params()}


def step_memory_bytes(cfg: ModelConfig, seq: int, fwd: TrainerConfig) -> int:
    """Peak bytes XLA plans for one train step on one sequence (compiled, not run)."""
    long_cfg = dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq + 1))
    learner = Learner(ModelSource.from_config(long_cfg, seed=0), cfg=fwd)
    batch = build_batch(synthetic_groups(1, 1, seq), long_cfg.max_seq_len + 1, 256)
    rows = learner._device_rows(batch)
    compiled = learner._rl_step.lower(learner.state, learner.opt_state, None, rows,
                                      jnp.asarray(batch.rewards_gk)).compile()
    mem = compiled.memory_analysis()
    return int(mem.temp_size_in_bytes + mem.argument_size_in_bytes + mem.output_size_in_bytes)


def longest_fitting(cfg: ModelConfig, budget: int, fwd: TrainerConfig, lengths: list[int]) -> tuple[int, dict]:
    best, seen = 0, {}
    for seq in lengths:
        need = step_memory_bytes(cfg, seq, fwd)
        seen[seq] = need
        if need > budget:
            break
        best = seq
    return best, seen


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="small")
    parser.add_argument("--groups", type=int_at_least(1), default=4)
    parser.add_argument("--group-size", type=int_at_least(1), default=4)
    parser.add_argument("--seq", type=int_at_least(1), default=256)
    parser.add_argument("--budget-mib", type=int_at_least(1), default=1024)
    parser.add_argument("--max-len", type=int_at_least(MIN_SWEEP_LEN, "the memory sweep's shortest length"),
                        default=16384, help="longest length tried in the memory sweep")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    try:
        ModelConfig.named(args.model)
    except ValueError as e:
        parser.error(f"--model: {e}")
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    reexec_with_tunables()  # the trainer service runs with these (arlo/hostmem.py); ARLO_DEFAULT_MALLOC=1 opts out
    cfg = dataclasses.replace(ModelConfig.named(args.model), dtype=args.dtype)
    started = time.perf_counter()
    ceilings = measure_ceilings(dtype=args.dtype)
    step = measure_step(cfg, args.groups, args.group_size, args.seq)
    floor = ceilings.floor_s(step["flops"], step["bytes"])
    fraction = floor / step["step_s"]
    lengths = [2**k for k in range(MIN_SWEEP_LEN.bit_length() - 1, 40) if 2**k <= args.max_len]
    budget = args.budget_mib << 20
    plain, plain_seen = longest_fitting(cfg, budget, TrainerConfig(), lengths)
    lean, lean_seen = longest_fitting(cfg, budget, TrainerConfig(remat="full", logprob_chunk=128), lengths)
    print_table(f"train step, {args.model} ({cfg.num_params() / 1e6:.1f}M params, {args.dtype}) on {ceilings.device}",
                ["rows x length", "step s", "tokens/s", "TFLOP/s", "GEMM TFLOP/s", "roofline_fraction"],
                [[f"{step['rows']} x {step['length']}", step["step_s"], step["tokens_per_s"],
                  step["flops"] / step["step_s"] / 1e12, ceilings.gemm_flops_per_s / 1e12, fraction]])
    print_table(f"longest sequence within {args.budget_mib} MiB (batch 1)", ["setting", "longest", "bytes by length"],
                [["plain", plain, {k: f"{v / 2**20:.0f}MiB" for k, v in plain_seen.items()}],
                 ["remat=full + logprob_chunk=128", lean, {k: f"{v / 2**20:.0f}MiB" for k, v in lean_seen.items()}]])
    write_json(args.json, {
        "model": args.model, "dtype": args.dtype, "device": ceilings.device, "jax": jax.__version__,
        "glibc_tunables": os.environ.get("GLIBC_TUNABLES", ""),
        "rows": step["rows"], "length": step["length"],
        "step_s": step["step_s"], "tokens_per_s": step["tokens_per_s"], "flops_per_step": step["flops"],
        "gemm_flops_per_s": ceilings.gemm_flops_per_s, "mem_bytes_per_s": ceilings.mem_bytes_per_s,
        "floor_s": floor, "roofline_fraction": fraction, "budget_mib": args.budget_mib,
        "longest_seq_plain": plain, "longest_seq_remat_chunked": lean,
        "peak_bytes_plain": plain_seen, "peak_bytes_remat_chunked": lean_seen,
        "wall_s": time.perf_counter() - started,
    })


if __name__ == "__main__":
    run_main(main)
