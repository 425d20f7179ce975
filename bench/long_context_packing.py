"""bench/long_context.py's `packing` section (issue 36, item 5): what `trainer.pack` saves on a
long-tail batch, and that it changes nothing of the loss.

padding_fraction: padded tokens over real tokens of the batch's forward, packed (first-fit
decreasing into rows of the batch's length bucket, services/trainer/packing.py) and as today (one
trajectory per row, right-padded to the bucket); pure arithmetic of the packer, bar <= 0.10 on the
issue's mix (80% of 16 episodes 1k tokens, 20% 8k). The rows are the bucket's length, so a batch
of few long rows rounds up to whole rows: the jittered mixes show that granularity.

loss check: one plain-SGD RL step (GRPO, kl_coef 0.05, entropy_coef 0.01, float32, the `tiny`
preset) on the same long-tail mix scaled down (16- and 128-token episodes), packed and padded:
the largest difference of any step diagnostic (the loss among them) and of any gradient entry,
bar 1e-6.
"""

from __future__ import annotations

import argparse
import functools
import time
from typing import Any

import numpy as np

PADDING_BAR = 0.10
DIFF_BAR = 1e-6


def long_tail(episodes: int, short: int, long: int, *, jitter: float = 0.0, seed: int = 0) -> list[int]:
    """80% of `episodes` `short` tokens, 20% `long`; `jitter` > 0 draws each from
    [(1 - jitter) x, x] (x for the long ones, capped at the bucket) instead."""
    rng = np.random.default_rng(seed)
    n_long = round(episodes * 0.2)
    sizes = [short] * (episodes - n_long) + [long] * n_long
    if not jitter:
        return sizes
    return [int(rng.integers(round(s * (1 - jitter)), s + 1)) for s in sizes]


def padding_figures(lengths: list[int]) -> dict[str, Any]:
    """Rows and padding_fraction of one batch, packed and padded (services/trainer/packing.py)."""
    from services.trainer.batching import bucket_length
    from services.trainer.packing import first_fit_decreasing, padding_fraction

    length = bucket_length(max(lengths))
    rows = first_fit_decreasing(lengths, length).rows
    return {"episodes": len(lengths), "tokens": sum(lengths), "row_length": length, "packed_rows": rows,
            "padded_rows": len(lengths), "padding_fraction": padding_fraction(lengths, rows, length),
            "padding_fraction_padded": padding_fraction(lengths, len(lengths), length)}


def trajectories(lengths: list[int], group_size: int, seed: int = 0) -> list[list[Any]]:
    """Groups of random trajectories of these lengths: a 4-token prompt, then model tokens."""
    from arlo.proto.v1 import common_pb2

    rng = np.random.default_rng(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = [0] * 4 + [1] * (n - 4)
        out.append(common_pb2.Trajectory(
            id=str(i), group_id=f"g{i // group_size}", group_size=group_size,
            token_ids=[int(x) for x in rng.integers(0, 256, n)], loss_mask=mask,
            logprobs=[float(x) * m for x, m in zip(rng.normal(-3, 0.3, n), mask, strict=True)],
            policy_versions=[0 if m else -1 for m in mask], reward=float(rng.integers(0, 2))))
    return [out[g:g + group_size] for g in range(0, len(out), group_size)]


def sgd_step(groups: list[list[Any]], *, pack: bool) -> tuple[dict[str, float], list[np.ndarray]]:
    """(the step's diagnostics, its gradient) from the learner's own step function under plain
    SGD at lr 1 (the update is the gradient; Adam would normalise float noise into +-lr)."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from arlo.config import AlgorithmConfig, TrainerConfig
    from arlo.model import ModelConfig
    from arlo.model.source import ModelSource
    from services.trainer.batching import build_batch
    from services.trainer.learner import Learner, _rl_step

    tc = TrainerConfig(pack=pack, algorithm=AlgorithmConfig(kl_coef=0.05, entropy_coef=0.01))
    learner = Learner(ModelSource.from_config(ModelConfig.named("tiny"), seed=0), cfg=tc)
    tx = optax.sgd(1.0)
    before = jax.tree.leaves(jax.device_get(nnx.to_pure_dict(learner.state)))
    rewards, rows = learner.device_inputs(build_batch(groups, 256, 256), mini_batches=1)
    step = jax.jit(functools.partial(_rl_step, learner.graphdef, tx, tc, "float32", learner.sampling),
                   static_argnums=(6,))
    after, _, metrics = step(learner.state, tx.init(learner.state), learner.ref_state, rows, jnp.asarray(rewards),
                             jax.random.key_data(jax.random.key(0)), 1)
    grads = [a - b for a, b in zip(before, jax.tree.leaves(jax.device_get(nnx.to_pure_dict(after))), strict=True)]
    return {k: float(v) for k, v in jax.device_get(metrics).items()}, grads


def loss_check() -> dict[str, Any]:
    """Packed against padded on one small long-tail batch (10 episodes: 8 x 16 tokens, 2 x 128)."""
    groups = trajectories(long_tail(10, 16, 128), group_size=5)
    padded_metrics, padded = sgd_step(groups, pack=False)
    packed_metrics, packed = sgd_step(groups, pack=True)
    return {"loss_padded": padded_metrics["loss"], "loss_packed": packed_metrics["loss"],
            "max_abs_metric_diff": max(abs(packed_metrics[k] - v) for k, v in padded_metrics.items()),
            "max_abs_grad_diff": max(float(np.abs(a - b).max()) for a, b in zip(padded, packed, strict=True)),
            "max_abs_grad": max(float(np.abs(a).max()) for a in padded)}


BATCHES = {
    "issue_16": lambda: long_tail(16, 1024, 8192),
    "jittered_16": lambda: long_tail(16, 1024, 8192, jitter=0.25),
    "jittered_64": lambda: long_tail(64, 1024, 8192, jitter=0.25),
}
"""The bar's batch first (the issue's mix), then the same mix with lengths drawn below 1k / 8k."""


def packing(args: argparse.Namespace) -> tuple[list[list[Any]], dict[str, Any]]:
    """The packing section: padding per batch, then the loss check; the first batch carries the bar."""
    del args
    rows, figures = [], {}
    for name, lengths in BATCHES.items():
        f = padding_figures(lengths())
        figures[name] = f
        rows.append([f"{name}: {f['episodes']} episodes, {f['tokens']:,} tokens, rows of {f['row_length']}",
                     f"{f['packed_rows']} / {f['padded_rows']}", f"{f['padding_fraction']:.3f}",
                     f"{f['padding_fraction_padded']:.3f}", ""])
    started = time.perf_counter()
    check = loss_check()
    check["seconds"] = time.perf_counter() - started
    rows.append(["loss check: tiny, GRPO kl 0.05 entropy 0.01, f32, 8 x 16 + 2 x 128", "", "", "",
                 f"{check['max_abs_metric_diff']:.1e} / {check['max_abs_grad_diff']:.1e}"])
    bar = figures["issue_16"]["padding_fraction"]
    figures.update(padding_fraction=bar, padding_bar=PADDING_BAR, loss_check=check, diff_bar=DIFF_BAR,
                   met=bar <= PADDING_BAR and max(check["max_abs_metric_diff"], check["max_abs_grad_diff"]) <= DIFF_BAR)
    return rows, figures


COLUMNS = ["batch", "rows packed / padded", "padding packed", "padding padded", "max |diff| loss+metrics / grad"]

