"""The in-process GRPO baseline of bench/grpo_tiny.py: one process, no services.

Each step: one jitted program generates the whole batch (prefill of every row, then a
`lax.scan` of KV-cache decode steps with temperature sampling), the host scores the answers
(exact match on "a*b="), and the trainer's own `Learner` takes its jitted GRPO step. Shapes
are fixed, so everything compiles once, in the warm-up steps. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from arlo.config import TrainerConfig
from arlo.model import ModelConfig
from arlo.model.kv_cache import init_cache
from arlo.model.sampling import sample
from arlo.model.source import ModelSource
from arlo.model.tokenizer import ByteTokenizer
from services.env_gateway.envs.arith import ArithConfig, draw_task, parse_answer
from services.trainer.batching import Batch
from services.trainer.learner import Learner

PROMPT_LEN = 16  # "a*b=" right-padded; longer than any operand pair up to 30


def make_generate(cfg: ModelConfig, graphdef, *, rows: int, tokens: int):
    @jax.jit
    def generate(state, prompt_bt, lengths_b, key):
        model = nnx.merge(graphdef, state)
        cache = init_cache(cfg, batch=rows, length=PROMPT_LEN + tokens)
        logits, cache = model.prefill(prompt_bt, lengths_b, cache)

        def body(carry, _):
            logits, cache, pos, key = carry
            key, sub = jax.random.split(key)
            tok, lp = sample(logits, sub, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
            logits, cache = model.decode_step(tok, pos, cache)
            return (logits, cache, pos + 1, key), (tok, lp)

        _, (toks, lps) = jax.lax.scan(body, (logits, cache, lengths_b, key), None, length=tokens)
        return toks.T, lps.T

    return generate


def step_batch(tok: ByteTokenizer, tasks: list[tuple[int, int]], samples: int, completions: np.ndarray,
               logprobs: np.ndarray) -> tuple[Batch, int]:
    """Right-padded prompt+completion rows (cut after EOS), rewards by exact match."""
    rows, tokens = completions.shape
    tokens_bt = np.zeros((rows, PROMPT_LEN + tokens), np.int32)
    lp_bt = np.zeros_like(tokens_bt, dtype=np.float32)
    mask_bt = np.zeros_like(lp_bt)
    rewards = np.zeros((len(tasks), samples), np.float32)
    generated = 0
    for r in range(rows):
        a, b = tasks[r // samples]
        prompt = tok.encode(f"{a}*{b}=")
        out = completions[r].tolist()
        n = out.index(tok.eos_id) + 1 if tok.eos_id in out else tokens
        generated += n
        p = len(prompt)
        tokens_bt[r, :p], tokens_bt[r, p:p + n] = prompt, out[:n]
        lp_bt[r, p:p + n], mask_bt[r, p:p + n] = logprobs[r, :n], 1.0
        answer = parse_answer(tok.decode([t for t in out[:n] if t != tok.eos_id]))
        rewards[r // samples, r % samples] = float(answer == str(a * b))
    return Batch(tokens_bt=tokens_bt, behaviour_logprobs_bt=lp_bt, mask_bt=mask_bt, rewards_gk=rewards,
                 token_rewards_bt=np.zeros_like(lp_bt),
                 trajectory_ids=tuple(str(i) for i in range(rows)), num_tokens=int(mask_bt.sum())), generated


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="qwen3-76k")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--learning-rate", type=float, default=0.002)
    args = parser.parse_args()
    cfg = ModelConfig.named(args.model)
    tok = ByteTokenizer()
    learner = Learner(ModelSource.from_config(cfg, seed=0), cfg=TrainerConfig(learning_rate=args.learning_rate,
                                                     groups_per_step=args.prompts))
    rows = args.prompts * args.samples
    generate = make_generate(cfg, learner.graphdef, rows=rows, tokens=args.tokens)
    arith, rng, key = ArithConfig(op="*", max_operand=30), random.Random(0), jax.random.key(0)
    generated, intervals = 0, []
    started = last = time.perf_counter()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            started, generated = time.perf_counter(), 0
        if i > args.warmup:
            intervals.append(time.perf_counter() - last)
        last = time.perf_counter()
        tasks = [draw_task(rng.randrange(1 << 30), arith) for _ in range(args.prompts)]
        prompt_bt = np.zeros((rows, PROMPT_LEN), np.int32)
        lengths = np.zeros(rows, np.int32)
        for r in range(rows):
            ids = tok.encode(f"{tasks[r // args.samples][0]}*{tasks[r // args.samples][1]}=")
            prompt_bt[r, :len(ids)], lengths[r] = ids, len(ids)
        key, sub = jax.random.split(key)
        toks, lps = jax.device_get(generate(learner.state, jnp.asarray(prompt_bt), jnp.asarray(lengths), sub))
        batch, n = step_batch(tok, tasks, args.samples, np.asarray(toks), np.asarray(lps))
        learner.step(batch)
        generated += n
    wall = time.perf_counter() - started
    print(json.dumps({"steps_timed": args.steps, "wall_s": wall, "steps_per_s": args.steps / wall,
                      "completions_per_s": args.steps * rows / wall, "generated_tokens_per_s": generated / wall,
                      "median_step_s": statistics.median(intervals), "max_step_s": max(intervals),
                      "dropped_stale": 0, "shared_prefill_fraction": 1 - 1 / args.samples,
                      "params": cfg.num_params()}))



if __name__ == "__main__":
    main()
