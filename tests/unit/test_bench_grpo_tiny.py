"""bench/grpo_tiny.py's workloads: the service configs' limits against the prompts the rollout really
sends, and the multi-turn in-process baselines' episodes against the rollout's own episode loop.

The figures are for full runs (see the bench's docstring); these check that both sides of a
workload build the same episodes, and that arlo's services will not refuse them mid-run.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable

import numpy as np
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from arlo.model import ModelConfig
from arlo.model.tokenizer import ASSISTANT, EOS, ByteTokenizer
from arlo.rpc.metrics import RpcMetrics
from bench.arith_turns import env_config, env_config_json, episode_tokens
from bench.grpo_inprocess_agent import AgentBaseline, EpisodeRun, agent_parser
from bench.grpo_tiny import (
    WORKLOADS,
    counters_of,
    generate_calls,
    inprocess_sides,
    service_config,
    token_limits,
)
from services.env_gateway.envs.arith import ArithConfig, draw_task
from services.inference.requests import SamplingRequest, validate_request
from services.rollout.agent import EpisodeSpec, Turn, run_episode
from services.trainer.batching import Batch
from tests.support.inprocess import CoreScorer, GatewayEnv

TOK = ByteTokenizer()
TURNS, TOKENS = 3, 16
Script = Callable[[int, str], tuple[str, bool]]
"""(turn, the prompt's text) -> (what the model says, whether it ends the turn with EOS). A turn without EOS
must fill its budget, as a generation that does not stop does."""


class ScriptedModel:
    """A Generator saying what `script` says (cut to the turn's budget); records every prompt."""

    def __init__(self, script: Script) -> None:
        self.script, self.prompts = script, []

    def ids(self, turn: int, prompt: list[int], budget: int) -> list[int]:
        text, eos = self.script(turn, TOK.decode(prompt))
        return (TOK.encode(text) + [EOS] * eos)[:budget]

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        self.prompts.append(list(prompt))
        ids = self.ids(len(self.prompts), list(prompt), max_tokens)
        return Turn(token_ids=ids, logprobs=[-1.0] * len(ids), policy_versions=[0] * len(ids),
                    finished_by_stop=ids[-1] == EOS)


def rollout_episode(script: Script, seed: int, *, turns: int, tokens: int, episode: int):
    spec = EpisodeSpec(env_name="arith", env_config_json=env_config_json(turns), reward_fn="exact_match", seed=seed,
                       max_turns=turns, max_tokens_per_turn=tokens, max_episode_tokens=episode, run_id="r",
                       group_id="g", group_size=1)
    model = ScriptedModel(script)
    return asyncio.run(run_episode(spec, TOK, model, GatewayEnv(), CoreScorer())), model.prompts


def product(prompt: str) -> str:
    """The right answer to the episode's question (the prompt's text starts with it: specials decode to nothing)."""
    match = re.match(r"(\d+)\*(\d+)=", prompt)
    assert match is not None, prompt
    return str(int(match[1]) * int(match[2]))


SCRIPTS: dict[str, Script] = {
    "words, cut by the budget": lambda turn, prompt: ("x" * 40, False),
    "wrong numbers ending in EOS": lambda turn, prompt: (f"{turn}", True),
    "right at the second turn": lambda turn, prompt: ("?" * 40, False) if turn == 1 else (product(prompt), True),
}


@pytest.mark.parametrize("name", sorted(SCRIPTS))
def test_the_baselines_episode_is_the_rollouts_token_for_token(name: str) -> None:
    script, seed = SCRIPTS[name], 11
    traj, _ = rollout_episode(script, seed, turns=TURNS, tokens=TOKENS,
                              episode=episode_tokens(TOK, env_config(TURNS), TOKENS))
    run, model = EpisodeRun(TOK, env_config(TURNS), seed), ScriptedModel(script)
    while not run.done:
        ids = model.ids(run.turns + 1, run.tokens, TOKENS)
        out = ids + [ASSISTANT] * (TOKENS - len(ids))  # generation runs on past EOS: the turn is cut at it
        run.add_turn(out, [-1.0] * TOKENS)
    e = run.episode()
    assert e.tokens == list(traj.token_ids) and e.mask == list(traj.loss_mask)
    assert e.turns == traj.num_turns and e.reward == traj.reward


def test_service_limits_cover_every_prompt_the_rollout_sends() -> None:
    for w in WORKLOADS.values():
        cfg = service_config(w, 1, f"t-{w.name}")
        assert cfg.rollout.max_turns == w.turns and cfg.trainer.remat == w.remat
        assert f'"max_turns": {w.turns}' in cfg.rollout.env_config_json
        max_seq_len = cfg.inference.max_seq_len or ModelConfig.named(cfg.model.name).max_seq_len
        # The worst case: two-digit operands, never a number (the longest reply) and never EOS (every
        # turn its full budget).
        seed = next(s for s in range(1000) if min(draw_task(s, ArithConfig(**env_config(w.turns)))) >= 10)
        traj, prompts = rollout_episode(SCRIPTS["words, cut by the budget"], seed, turns=w.turns, tokens=w.tokens,
                                        episode=cfg.rollout.max_episode_tokens)
        for prompt in prompts:  # the inference service's own check, as it would refuse a request
            validate_request(SamplingRequest(prompt=tuple(prompt), max_tokens=cfg.rollout.sampling.max_tokens),
                             cfg.inference, vocab_size=ModelConfig.named(cfg.model.name).vocab_size,
                             max_seq_len=max_seq_len)
        assert traj.num_turns == w.turns and sum(traj.loss_mask) == w.turns * w.tokens, w.name
        # Multi-turn limits are tight (they bound the engine's programs): the worst case reaches them.
        assert w.turns == 1 or len(prompts[-1]) == token_limits(w)[0]
    assert WORKLOADS["4m"].remat == "full" and "--batch1" in inprocess_sides(WORKLOADS["agent"])["in-process batch-1"]


def turn_runs(mask: np.ndarray) -> int:
    """Model turns in one row: runs of 1s in its loss mask."""
    return int(np.sum(np.diff(np.concatenate([[0], mask])) == 1))


SMALL_TURNS, SMALL_TOKENS = 2, 8
"""The baselines' test size: one generate program per turn compiles, so fewer turns keep the test short."""


def baseline_batches(batch1: bool) -> tuple[dict, list[Batch]]:
    """2 warm-up + 2 timed steps of the agent baseline at a tiny size; the batches its Learner got."""
    from bench.grpo_inprocess import run_timed

    args = agent_parser().parse_args(["--prompts", "2", "--samples", "2", "--tokens", str(SMALL_TOKENS), "--turns",
                                      str(SMALL_TURNS), "--warmup", "2", "--steps", "2", *(["--batch1"] * batch1)])
    baseline, batches = AgentBaseline(args), []
    step = baseline.learner.step
    baseline.learner.step = lambda batch: (batches.append(batch), step(batch))[1]
    return run_timed(args, baseline.cfg, baseline.step), batches


# Two baseline runs, compiles included: slow tier. The default tier holds the baseline's episodes
# to the rollout's token for token (test_the_baselines_episode_is_the_rollouts_token_for_token).
@pytest.mark.slow
@pytest.mark.timeout(120)
def test_the_agent_baselines_run_whole_episodes_and_train_on_model_tokens_only() -> None:
    figures, batches = baseline_batches(batch1=False)
    figures1, batches1 = baseline_batches(batch1=True)
    assert len(batches) == len(batches1) == 4 and figures["turns_per_episode"] == figures1["turns_per_episode"] == SMALL_TURNS
    for batch, batch1 in zip(batches, batches1, strict=True):
        assert batch.tokens_bt.shape == batch1.tokens_bt.shape == (4, 64)  # 10 + 8 + 1 + 23 + 8 = 50 at most
        np.testing.assert_array_equal(batch.mask_bt, batch1.mask_bt)  # same turns, same replies, same cuts
        # Row streams are keyed by episode: batch 1 draws the very tokens the batched call drew.
        np.testing.assert_array_equal(batch.tokens_bt, batch1.tokens_bt)
        np.testing.assert_allclose(batch.behaviour_logprobs_bt, batch1.behaviour_logprobs_bt, atol=1e-4)
        for row in range(4):
            mask, tokens = batch.mask_bt[row], batch.tokens_bt[row]
            assert turn_runs(mask) == SMALL_TURNS
            # Outside the mask: the template's ids and the env's replies ("no" / "answer with a number").
            context = TOK.decode(tokens[(mask == 0) & (np.arange(tokens.size) < np.flatnonzero(mask)[-1])].tolist())
            assert context.count("no") + context.count("answer with a number") == SMALL_TURNS - 1
            assert not batch.behaviour_logprobs_bt[row][mask == 0].any()
            assert (batch.behaviour_logprobs_bt[row][mask == 1] < 0).all()


def test_refused_generate_calls_are_counted_from_the_inference_metrics() -> None:
    registry = CollectorRegistry()
    rpc = RpcMetrics(registry, "inference")
    for code in ("OK", "OK", "INVALID_ARGUMENT"):
        rpc.observe("/arlo.v1.Inference/Generate", code, 0.01)
    rpc.observe("/arlo.v1.Inference/GetModelInfo", "NOT_FOUND", 0.01)
    assert generate_calls(counters_of(generate_latest(registry).decode())) == (2, 1)
