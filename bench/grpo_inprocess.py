"""The in-process GRPO baseline of bench/grpo_tiny.py: one process, no services.

Each step: one jitted program generates the whole batch (prefill of every row, then a
`lax.scan` of KV-cache decode steps with temperature sampling), the host scores the answers
(exact match on "a*b="), and the trainer's own `Learner` takes its jitted GRPO step. Shapes
are fixed, so everything compiles once, in the warm-up steps. Prints one JSON line.

The generate program, the Batch packing and the timed loop are shared with the multi-turn
baseline (bench/grpo_inprocess_agent.py).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

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
from bench.arith_turns import env_config
from bench.common import float_above, int_at_least, run_main
from services.env_gateway.envs.arith import ArithConfig, draw_task, parse_answer
from services.trainer.batching import Batch
from services.trainer.learner import Learner

PROMPT_LEN = 16  # "a*b=" right-padded; longer than any operand pair up to 30

Generate = Callable[..., tuple[jax.Array, jax.Array]]


def make_generate(cfg: ModelConfig, graphdef: Any, *, rows: int, prompt_len: int, tokens: int) -> Generate:
    """generate(state, prompt_bt, lengths_b, key, ids_b) -> (tokens_bt, logprobs_bt), `tokens` per row.

    Row r samples from fold_in(key, ids_b[r]), so it draws the same tokens whatever batch it
    shares: the batch-1 baseline and the batched one sample the same episodes from one key.
    """
    @jax.jit
    def generate(state, prompt_bt, lengths_b, key, ids_b):
        model = nnx.merge(graphdef, state)
        cache = init_cache(cfg, batch=rows, length=prompt_len + tokens)
        logits, cache = model.prefill(prompt_bt, lengths_b, cache)
        keys_b = jax.vmap(jax.random.fold_in, (None, 0))(key, ids_b)

        def body(carry, t):
            logits, cache, pos = carry
            step_keys_b = jax.vmap(jax.random.fold_in, (0, None))(keys_b, t)
            tok, lp = sample(logits, step_keys_b, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0)
            logits, cache = model.decode_step(tok, pos, cache)
            return (logits, cache, pos + 1), (tok, lp)

        _, (toks, lps) = jax.lax.scan(body, (logits, cache, lengths_b), jnp.arange(tokens))
        return toks.T, lps.T

    return generate


def pad_prompts(prompts: Sequence[Sequence[int]], width: int) -> tuple[jax.Array, jax.Array]:
    """Right-padded prompts [rows, width] and their lengths, on the device."""
    prompt_bt = np.zeros((len(prompts), width), np.int32)
    lengths = np.zeros(len(prompts), np.int32)
    for r, ids in enumerate(prompts):
        assert len(ids) <= width, f"a prompt of {len(ids)} tokens in a program for {width}"
        prompt_bt[r, :len(ids)], lengths[r] = ids, len(ids)
    return jnp.asarray(prompt_bt), jnp.asarray(lengths)


def turn_length(out: Sequence[int], stop_id: int) -> int:
    """Tokens of a model turn: up to and including its first stop token, else all of them."""
    out = list(out)
    return out.index(stop_id) + 1 if stop_id in out else len(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class Episode:
    """One trajectory as the trainer sees it: 1 in `mask` on the model's own tokens."""

    tokens: list[int]
    logprobs: list[float]
    mask: list[int]
    reward: float
    turns: int = 1

    @property
    def model_tokens(self) -> int:
        return sum(self.mask)


def pack_batch(episodes: Sequence[Episode], *, samples: int, width: int) -> Batch:
    """Right-pads the episodes (groups of `samples` in order) to `width`: the trainer's Batch."""
    rows = len(episodes)
    tokens_bt = np.zeros((rows, width), np.int32)
    lp_bt = np.zeros_like(tokens_bt, dtype=np.float32)
    mask_bt = np.zeros_like(lp_bt)
    for r, e in enumerate(episodes):
        n = len(e.tokens)
        tokens_bt[r, :n], lp_bt[r, :n], mask_bt[r, :n] = e.tokens, e.logprobs, e.mask
    rewards = np.asarray([e.reward for e in episodes], np.float32).reshape(-1, samples)
    return Batch(tokens_bt=tokens_bt, behaviour_logprobs_bt=lp_bt, mask_bt=mask_bt, rewards_gk=rewards,
                 token_rewards_bt=np.zeros_like(lp_bt),
                 trajectory_ids=tuple(str(i) for i in range(rows)), num_tokens=int(mask_bt.sum()))


def single_turn_episode(tok: ByteTokenizer, task: tuple[int, int], out: Sequence[int],
                        logprobs: Sequence[float]) -> Episode:
    """"a*b=" then the completion cut after its end token; reward 1 for the exact product."""
    a, b = task
    prompt = tok.encode(f"{a}*{b}=")
    n = turn_length(out, tok.eos_id)
    answer = parse_answer(tok.decode(out[:n]))
    return Episode(tokens=prompt + list(out[:n]), logprobs=[0.0] * len(prompt) + list(logprobs[:n]),
                   mask=[0] * len(prompt) + [1] * n, reward=float(answer == str(a * b)))


def parser(doc: str) -> argparse.ArgumentParser:
    """The flags every in-process baseline takes (the workload's shapes and the timing)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-76k")
    p.add_argument("--prompts", type=int_at_least(1), default=4)
    p.add_argument("--samples", type=int_at_least(1), default=4)
    p.add_argument("--tokens", type=int_at_least(1), default=16, help="new tokens per model turn")
    p.add_argument("--warmup", type=int_at_least(0), default=5)
    p.add_argument("--steps", type=int_at_least(2, "the median step needs two timed steps"), default=30)
    p.add_argument("--learning-rate", type=float_above(0), default=0.002)
    p.add_argument("--remat", default="none", choices=("none", "full", "dots"), help="the trainer's remat")
    return p


def make_learner(args: argparse.Namespace) -> tuple[ModelConfig, Learner]:
    cfg = ModelConfig.named(args.model)
    tc = TrainerConfig(learning_rate=args.learning_rate, groups_per_step=args.prompts, remat=args.remat)
    return cfg, Learner(ModelSource.from_config(cfg, seed=0), cfg=tc)


StepFn = Callable[[int], Sequence[Episode]]


def run_timed(args: argparse.Namespace, cfg: ModelConfig, step: StepFn) -> dict[str, Any]:
    """`args.warmup` untimed steps (compilation), then `args.steps` timed ones; the figures.

    `step(i)` runs step i (generation, reward, the Learner's step) and returns its episodes.
    """
    generated, turns, intervals = 0, 0, []
    started = last = time.perf_counter()
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            started, generated, turns = time.perf_counter(), 0, 0
        if i > args.warmup:
            intervals.append(time.perf_counter() - last)
        last = time.perf_counter()
        episodes = step(i)
        generated += sum(e.model_tokens for e in episodes)
        turns += sum(e.turns for e in episodes)
    wall = time.perf_counter() - started
    rows = args.prompts * args.samples
    return {"steps_timed": args.steps, "wall_s": wall, "steps_per_s": args.steps / wall,
            "completions_per_s": args.steps * rows / wall, "generated_tokens_per_s": generated / wall,
            "median_step_s": statistics.median(intervals), "max_step_s": max(intervals),
            "turns_per_episode": turns / (args.steps * rows), "dropped_stale": 0, "params": cfg.num_params()}


def parse_args(p: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """`p`'s arguments, --model checked (an unknown one is argparse's exit 2)."""
    args = p.parse_args(argv)
    try:
        ModelConfig.named(args.model)
    except ValueError as e:
        p.error(f"--model: {e}")
    return args


def main() -> None:
    args = parse_args(parser(__doc__))
    cfg, learner = make_learner(args)
    tok = ByteTokenizer()
    rows = args.prompts * args.samples
    generate = make_generate(cfg, learner.graphdef, rows=rows, prompt_len=PROMPT_LEN, tokens=args.tokens)
    arith = ArithConfig(op="*", max_operand=env_config(1)["max_operand"])
    rng, key, ids = random.Random(0), jax.random.key(0), jnp.arange(rows)

    def step(i: int) -> list[Episode]:
        tasks = [draw_task(rng.randrange(1 << 30), arith) for _ in range(args.prompts)]
        prompt_bt, lengths = pad_prompts([tok.encode(f"{a}*{b}=") for a, b in tasks for _ in range(args.samples)],
                                         PROMPT_LEN)
        toks, lps = jax.device_get(generate(learner.state, prompt_bt, lengths, jax.random.fold_in(key, i), ids))
        episodes = [single_turn_episode(tok, tasks[r // args.samples], toks[r].tolist(), lps[r].tolist())
                    for r in range(rows)]
        learner.step(pack_batch(episodes, samples=args.samples, width=PROMPT_LEN + args.tokens))
        return episodes

    print(json.dumps({**run_timed(args, cfg, step), "shared_prefill_fraction": 0.0}))  # every row prefills its own copy


if __name__ == "__main__":
    run_main(main)
