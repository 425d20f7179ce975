"""The demo's SFT warm start at several learning rates, full fine-tuning and LoRA, in process.

What rate the LoRA demo (examples/lora_demo.yaml) warm-starts at: the demo's full fine-tuning
rate (0.01) is already high, and rank-8 adapters on its randomly initialised, frozen base learn
best below it, not at the 10x LoRA usually wants. Each run is the trainer's own Learner and
WarmStart on the config's demonstrations (seeded: every run sees the same batches); the table
gives the mean SFT loss over each window of `--window` steps.

Measured on a 2-core host under heavy load (the losses compare, the seconds do not), mean loss
per 50 steps, `python -m bench.lora_sft_rates --steps 600 --runs 8:0.002 8:0.003 8:0.005 8:0.01 8:0.02`
(`--steps 300 --runs 8:0.03 8:0.1` for the last two rows):
- rank 8, 0.002: 3.91 1.83 1.41 1.14 0.92 0.77 0.69 0.63 0.59 0.56 0.55 0.51
- rank 8, 0.003: 3.61 1.67 1.27 1.01 0.84 0.72 0.66 0.60 0.59 0.55 0.54 0.52
- rank 8, 0.005: 3.27 1.57 1.23 1.01 0.85 0.73 0.67 0.63 0.61 0.58 0.57 0.54
- rank 8, 0.01:  2.93 1.53 1.35 1.20 1.08 0.97 0.89 0.83 0.79 0.76 0.74 0.79
- rank 8, 0.02:  2.76 2.08 2.35 2.36 2.40 2.48 2.34 2.26 2.26 2.33 2.22 2.24
- rank 8, 0.03:  2.81 2.60 2.85 3.07 2.88 2.63
- rank 8, 0.1:   3.37 3.02 2.86 3.05 2.98 2.91
Full fine-tuning at 0.01 (the built-in demo) ends its warm start at 0.21 (its last 50 steps in
`arlo demo`'s metrics.jsonl).

`--floor` prints why the adapters stop there, and why sampled reward stays low after RL: with
the final norm's scale and the tied embeddings frozen at the preset's init, a logit is at most
sqrt(dim) x |embedding row|, so each token has a highest probability any final state can give
it. Demo preset, over the digits and `calc *=`: 0.870 on average, 0.758 to 0.976.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np

from arlo.config import load_config
from bench.common import check_json_arg, int_at_least, print_table, run_main, write_json

DEMO = "arlo/data/demo.yaml"


def run(config: str, rank: int, sft_lr: float, steps: int, window: int) -> dict[str, Any]:
    from services.trainer.learner import Learner
    from services.trainer.warmstart import WarmStart

    trainer: dict[str, Any] = {"sft": {"learning_rate": sft_lr}, "lora": {"rank": rank}}
    cfg = load_config(config, {"trainer": trainer})
    source = cfg.model_source()
    learner = Learner(source, cfg=cfg.trainer, sampling=cfg.rollout.sampling)
    warm = WarmStart(cfg.trainer.sft, source.tokenizer(), max_seq_len=learner.model_cfg.max_seq_len,
                     seed=cfg.model.seed)
    start, losses = time.perf_counter(), []
    for _ in range(steps):
        losses.append(float(learner.sft_step(warm.next_batch()).loss))
    means = [float(np.mean(losses[i:i + window])) for i in range(0, steps, window)]
    return {"rank": rank, "sft_learning_rate": sft_lr, "loss_means": means, "seconds": time.perf_counter() - start}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default=DEMO, help="the run whose warm start is measured (default: the demo)")
    p.add_argument("--runs", nargs="+", default=["0:0.01", "8:0.01", "8:0.02"],
                   help="RANK:SFT_LEARNING_RATE per run; rank 0 is full fine-tuning")
    p.add_argument("--steps", type=int_at_least(1), default=600)
    p.add_argument("--window", type=int_at_least(1), default=50)
    p.add_argument("--floor", action="store_true",
                   help="instead: each digit's and `calc *=`'s highest probability with the base frozen (byte tokenizer)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    check_json_arg(p, args)
    try:
        args.runs = [(int(r), float(lr)) for r, lr in (spec.split(":") for spec in args.runs)]
    except ValueError:
        p.error(f"--runs: expected RANK:LEARNING_RATE pairs such as 8:0.01, got {args.runs}")
    return args


def probability_ceiling(config: str, text: str, steps: int = 2000) -> list[float]:
    """Per character of `text` (byte-tokenizer ids), the highest probability any final hidden state
    gives it when the final norm's scale and the tied embeddings are frozen at init: logits are
    sqrt(dim) * scale * unit(h) @ E^T; maximised over unit(h) by gradient descent on the sphere."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from arlo.model import create_model

    cfg = load_config(config)
    model_cfg = cfg.model_source().cfg
    assert model_cfg.tie_embeddings, "the ceiling is computed for tied embeddings"
    state = nnx.state(create_model(model_cfg, cfg.model.seed))
    table = jnp.asarray(state["embedder"]["table_vd"].get_value())
    gain = jnp.sqrt(float(model_cfg.dim)) * jnp.asarray(state["final_norm"]["scale"].get_value())

    def nll(u: jax.Array, token: int) -> jax.Array:
        logits = table @ (gain * u / jnp.linalg.norm(u))
        return -jax.nn.log_softmax(logits)[token]

    grad = jax.jit(jax.value_and_grad(nll), static_argnums=1)
    out = []
    for token in (ord(c) for c in text):
        u, value = table[token], jnp.inf
        for _ in range(steps):
            value, g = grad(u, token)
            u = u - 0.05 * g
        out.append(float(jnp.exp(-value)))
    return out


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    if args.floor:
        text = "0123456789calc *="
        ceiling = probability_ceiling(args.config, text)
        print_table("highest probability of each token with the final norm and embeddings frozen", ["token", "p"],
                    [[repr(c), p] for c, p in zip(text, ceiling, strict=True)])
        print(f"mean {np.mean(ceiling):.3f}, min {min(ceiling):.3f}, max {max(ceiling):.3f}")
        write_json(args.json, {"config": args.config, "ceiling": dict(zip(text, ceiling, strict=True))})
        return
    results = [run(args.config, rank, lr, args.steps, args.window) for rank, lr in args.runs]
    print_table(f"SFT loss, mean per {args.window} steps", ["rank:lr", *[str((i + 1) * args.window)
                                                                        for i in range(len(results[0]["loss_means"]))]],
                [[f"{r['rank']}:{r['sft_learning_rate']:g}", *r["loss_means"]] for r in results])
    write_json(args.json, {"config": args.config, "steps": args.steps, "window": args.window, "runs": results})


if __name__ == "__main__":
    run_main(main)
