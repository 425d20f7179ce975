"""The in-process baselines of bench/grpo_tiny.py's multi-turn `agent` workload: one process, no services.

Each step runs prompts x samples arith episodes of `--turns` model turns (bench/arith_turns.py):
the env's own code answers each turn ("no" or "answer with a number" to a wrong one), and the
episode is rendered as arlo's rollout renders it (chat template, model tokens verbatim, a turn
cut by the budget closed with the end-of-turn token, the reply's template continuation), so
both sides see the same tokens per turn. Then one GRPO step (the trainer's own Learner) over
the whole trajectories, only the model's tokens in the loss mask. Generation is either

- batched (default): each turn, one jitted generate call over every episode's current prompt,
  right-padded to that turn's longest possible prompt (one program per turn, compiled in the
  warm-up), then the env's replies host-side, then the next turn; or
- `--batch1` (Tunix's agentic style): one generate call per turn per episode, at batch 1.

Row streams are keyed by the episode, so both draw the same tokens from one seed. Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from arlo.model.tokenizer import ByteTokenizer
from bench.arith_turns import env_config, episode_tokens, turn_prompt_tokens
from bench.common import int_at_least, run_main
from bench.grpo_inprocess import (
    Episode,
    Generate,
    make_generate,
    make_learner,
    pack_batch,
    pad_prompts,
    parse_args,
    parser,
    run_timed,
    turn_length,
)
from services.env_gateway.envs.arith import ArithEnv
from services.trainer.batching import Batch, bucket_length


class EpisodeRun:
    """One arith episode on the host, its tokens laid out as services/rollout/agent.py lays them out."""

    def __init__(self, tok: ByteTokenizer, config: Mapping[str, Any], seed: int) -> None:
        self.tok, self.env = tok, ArithEnv()
        reset = self.env.reset(seed, config)
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.mask: list[int] = []
        self.turns, self.done, self.reward = 0, False, 0.0
        self._add(tok.encode_messages(reset.observation, add_generation_prompt=True, add_bos=True))

    def _add(self, ids: Sequence[int], logprobs: Sequence[float] | None = None) -> None:
        """Context (mask 0) without `logprobs`; the model's own tokens with them."""
        self.tokens += ids
        self.logprobs += [0.0] * len(ids) if logprobs is None else logprobs
        self.mask += [0 if logprobs is None else 1] * len(ids)

    def add_turn(self, out: Sequence[int], logprobs: Sequence[float]) -> None:
        """A model turn (cut after its end token), then the env's reply to it."""
        n = turn_length(out, self.tok.eos_id)
        self._add(out[:n], logprobs[:n])
        if out[n - 1] not in self.tok.stop_token_ids:
            self._add([self.tok.eos_id])  # closed as the rollout closes a budget-cut turn
        step = self.env.step(self.tok.decode(out[:n]))
        self.turns += 1
        if step.done:
            self.done, self.reward = True, step.reward
        else:
            self._add(self.tok.encode_messages(step.observation, add_generation_prompt=True, add_bos=False))

    def episode(self) -> Episode:
        return Episode(tokens=self.tokens, logprobs=self.logprobs, mask=self.mask, reward=self.reward,
                       turns=self.turns)


class AgentBaseline:
    """Episodes, generation and the GRPO step of one run; `step(i)` is step i."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.tok = args, ByteTokenizer()
        self.cfg, self.learner = make_learner(args)
        self.config = env_config(args.turns)
        self.rows = args.prompts * args.samples
        rows = 1 if args.batch1 else self.rows
        # One program per turn, its prompts padded to that turn's longest: compiled once, in the warm-up.
        self.widths = [turn_prompt_tokens(self.tok, self.config, args.tokens, t) for t in range(1, args.turns + 1)]
        self.generates: list[Generate] = [make_generate(self.cfg, self.learner.graphdef, rows=rows, prompt_len=w,
                                                        tokens=args.tokens) for w in self.widths]
        # The trainer's own bucket for the longest episode, which is also the services' max_episode_tokens
        # (build_batch pads a batch to it as well).
        longest = episode_tokens(self.tok, self.config, args.tokens)
        self.width = min(bucket_length(longest, longest_episode=longest), self.cfg.max_seq_len)
        self.rng, self.key = random.Random(0), jax.random.key(0)

    def episodes(self, i: int) -> list[EpisodeRun]:
        """Step i's episodes, every task's `samples` together (GRPO groups)."""
        seeds = [self.rng.randrange(1 << 30) for _ in range(self.args.prompts)]
        return [EpisodeRun(self.tok, self.config, s) for s in seeds for _ in range(self.args.samples)]

    def rollout(self, episodes: list[EpisodeRun], key: jax.Array) -> None:
        state, ids = self.learner.state, jnp.arange(len(episodes))
        turn_keys = [jax.random.fold_in(key, t) for t in range(self.args.turns)]
        if self.args.batch1:
            for r, e in enumerate(episodes):
                for turn in range(self.args.turns):
                    if e.done:
                        break
                    prompt, length = pad_prompts([e.tokens], self.widths[turn])
                    toks, lps = jax.device_get(self.generates[turn](state, prompt, length, turn_keys[turn],
                                                                    ids[r:r + 1]))
                    e.add_turn(toks[0].tolist(), lps[0].tolist())
            return
        for turn in range(self.args.turns):
            # An episode already over (a right answer) keeps its row, so the program's shape holds.
            prompt_bt, lengths = pad_prompts([e.tokens for e in episodes], self.widths[turn])
            toks, lps = jax.device_get(self.generates[turn](state, prompt_bt, lengths, turn_keys[turn], ids))
            for r, e in enumerate(episodes):
                if not e.done:
                    e.add_turn(toks[r].tolist(), lps[r].tolist())

    def batch(self, i: int) -> tuple[Batch, list[Episode]]:
        """Step i's rollout, packed as the trainer's Batch (no training)."""
        runs = self.episodes(i)
        self.rollout(runs, jax.random.fold_in(self.key, i))
        episodes = [r.episode() for r in runs]
        return pack_batch(episodes, samples=self.args.samples, width=self.width), episodes

    def step(self, i: int) -> list[Episode]:
        batch, episodes = self.batch(i)
        self.learner.step(batch)
        return episodes


def agent_parser() -> argparse.ArgumentParser:
    p = parser(__doc__)
    p.add_argument("--turns", type=int_at_least(1), default=3, help="model turns per episode (the env's max_turns)")
    p.add_argument("--batch1", action="store_true", help="one generate call per turn per episode")
    return p


def main() -> None:
    args = parse_args(agent_parser())
    baseline = AgentBaseline(args)
    # Every turn prefills each row's whole prompt: nothing is shared, within a group or across turns.
    print(json.dumps({**run_timed(args, baseline.cfg, baseline.step), "shared_prefill_fraction": 0.0}))


if __name__ == "__main__":
    run_main(main)
