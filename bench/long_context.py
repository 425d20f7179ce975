"""Long agentic trajectories (issue 36): what a long sequence costs, section by section.

    python -m bench.long_context [--sections train_memory] [--json PATH]

Each section is a function `(args) -> (table rows, figures)` registered in SECTIONS by name, so
later sections add themselves without touching the others; `--sections` picks which run, and the
JSON holds one object per section. Sections: train_memory (below), packing
(bench/long_context_packing.py), capacity, prefix and paged_vs_dense (bench/long_context_paged.py).

train_memory: the compiled RL step's temporaries (`memory_analysis().temp_size_in_bytes` of the
learner's own jitted step, compiled, never run) with the KL penalty (`kl_coef` 0.05) and the
entropy bonus (`entropy_coef` 0.01) on, over the same step with both off
(`kl_entropy_temp_ratio`, bar <= 1.2). With `trainer.logprob_chunk` every forward of the step
(the policy's logprobs and entropy, the reference's logprobs, every KL form) takes its logits a
chunk at a time, so the two extra terms cost a few [batch, length] arrays, not [batch, length,
vocab] logits. The model is narrow (dim 64, 2 layers, 4 heads) so that the compile stays quick on
a CPU; at 8 x 4096 the step's own temporaries are then mostly attention scores ([rows, heads,
length, length] float32, 2 GiB each), at 8 x 512 mostly a chunk's logits.

Measured (CPU, jax 0.10.2; off / kl / entropy / kl+entropy MiB, ratio):
  vocab 151,936, 8 x 4096, chunk 128: before 8,792 / 19,167 / 94,995 / 95,053 (10.8x);
                                      after  8,792 /  8,834 /  8,793 /  8,834 (1.005x)
  vocab 32,768, 8 x 512, chunk 32:    before 152 / 536 / 2,561 / 2,562 (16.9x; issue 36's figures);
                                      after  152 / 152 / 152 / 152 (1.001x)
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from collections.abc import Callable
from typing import Any

from bench import long_context_throughput
from bench.common import check_json_arg, name_list, print_table, run_main, write_json
from bench.long_context_packing import COLUMNS as PACKING_COLUMNS
from bench.long_context_packing import packing
from bench.long_context_paged import (
    CAPACITY_COLUMNS,
    PAGED_COLUMNS,
    PREFIX_COLUMNS,
    capacity,
    paged_vs_dense,
    prefix,
)

MIB = 2**20
RATIO_BAR = 1.2


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class MemoryShape:
    """One compiled-step shape of the train_memory section."""

    name: str
    vocab: int
    rows: int
    length: int
    """Tokens per row (the step's targets are length - 1)."""
    chunk: int
    remat: str = "full"
    dim: int = 64
    num_layers: int = 2


MEMORY_SHAPES = (
    # The bar's shape: a Qwen2.5 vocabulary, 8 rows of 4k tokens.
    MemoryShape(name="qwen_vocab_4k", vocab=151_936, rows=8, length=4096, chunk=128),
    # The shape issue 36 measured before the change (152 / 536 / 2,561 MiB off / kl / entropy).
    MemoryShape(name="issue_32k_512", vocab=32_768, rows=8, length=512, chunk=32),
)

TERMS = {"off": {}, "kl": {"kl_coef": 0.05}, "entropy": {"entropy_coef": 0.01},
         "kl+entropy": {"kl_coef": 0.05, "entropy_coef": 0.01}}


def step_temp_bytes(shape: MemoryShape, **algorithm: Any) -> int:
    """Temporaries XLA plans for the learner's RL step at `shape` with `algorithm` set
    (the real step: `Learner._rl_step`, lowered on abstract rows, compiled, not run)."""
    import jax
    import jax.numpy as jnp

    from arlo.config import AlgorithmConfig, TrainerConfig
    from arlo.model import ModelConfig
    from arlo.model.source import ModelSource
    from services.trainer.learner import Learner

    cfg = ModelConfig(vocab_size=shape.vocab, dim=shape.dim, num_layers=shape.num_layers, num_heads=4,
                      num_kv_heads=2, head_dim=shape.dim // 4, mlp_dim=2 * shape.dim, max_seq_len=shape.length)
    tc = TrainerConfig(remat=shape.remat, logprob_chunk=shape.chunk, algorithm=AlgorithmConfig(**algorithm))
    learner = Learner(ModelSource.from_config(cfg, seed=0), cfg=tc)

    def rows(dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((1, shape.rows, shape.length), dtype)

    batch = {"tokens_bt": rows(jnp.int32), "behaviour_logprobs_bt": rows(jnp.float32), "mask_bt": rows(jnp.float32)}
    rewards = jax.ShapeDtypeStruct((shape.rows // 2, 2), jnp.float32)
    key = jax.random.key_data(jax.random.key(0))
    compiled = learner._rl_step.lower(learner.state, learner.opt_state, learner.ref_state, batch, rewards, key,
                                      1).compile()
    return int(compiled.memory_analysis().temp_size_in_bytes)


def train_memory(args: argparse.Namespace) -> tuple[list[list[Any]], dict[str, Any]]:
    """The train_memory section: temporaries by term, per shape; the ratio on the first shape is the bar."""
    rows, figures = [], {}
    for shape in MEMORY_SHAPES:
        if args.shapes and shape.name not in args.shapes:
            continue
        started = time.perf_counter()
        mib = {term: step_temp_bytes(shape, **settings) / MIB for term, settings in TERMS.items()}
        ratio = mib["kl+entropy"] / mib["off"]
        rows.append([f"{shape.name}: vocab {shape.vocab:,}, {shape.rows} x {shape.length}, chunk {shape.chunk}, "
                     f"remat {shape.remat}", *(f"{v:,.0f}" for v in mib.values()), f"{ratio:.3f}"])
        figures[shape.name] = {**dataclasses.asdict(shape), "temp_mib": mib, "kl_entropy_temp_ratio": ratio,
                               "compile_s": time.perf_counter() - started}
    first = next(iter(figures.values()), None)
    if first is not None:
        figures["kl_entropy_temp_ratio"] = first["kl_entropy_temp_ratio"]
        figures["bar"] = RATIO_BAR
        figures["met"] = first["kl_entropy_temp_ratio"] <= RATIO_BAR
    return rows, figures


SECTIONS: dict[str, tuple[Callable[[argparse.Namespace], tuple[list[list[Any]], dict[str, Any]]], list[str]]] = {
    "train_memory": (train_memory, ["compiled RL step", *(f"{t} MiB" for t in TERMS), "kl+entropy / off"]),
    "packing": (packing, PACKING_COLUMNS),
    "capacity": (capacity, CAPACITY_COLUMNS),
    "prefix": (prefix, PREFIX_COLUMNS),
    "paged_vs_dense": (paged_vs_dense, PAGED_COLUMNS),
    "throughput": (long_context_throughput.throughput, long_context_throughput.COLUMNS),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sections", type=name_list(SECTIONS), default=list(SECTIONS),
                        help=f"comma-separated, of {', '.join(SECTIONS)} (default all)")
    parser.add_argument("--shapes", type=name_list([s.name for s in MEMORY_SHAPES]), default=[],
                        help="train_memory: only these shapes (default all)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    report: dict[str, Any] = {}
    for name in args.sections:
        section, columns = SECTIONS[name]
        rows, figures = section(args)
        print_table(name, columns, rows)
        report[name] = figures
    import jax

    write_json(args.json, {**report, "jax": jax.__version__, "device": str(jax.devices()[0])})


if __name__ == "__main__":
    run_main(main)
