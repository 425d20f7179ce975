"""Held-out evaluation: the summary figures (overall and per environment of a mixture), the
env-config merge, and the Redis request/result round trip (a real Redis; the episodes run on the
real env gateway core and reward scorer)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from collections import Counter

import pytest
import redis.asyncio as aioredis

from arlo.config import ConfigError, EvalConfig, RolloutConfig, RolloutEnvConfig, SamplingConfig, load_config
from arlo.coord.evals import EvalQueue
from services.rollout.agent import Turn, run_episode
from services.rollout.evaluation import Evaluator, eval_env_config, eval_targets, pass_at_k, serve_evaluations
from tests.support.inprocess import TOK, CoreScorer, GatewayEnv

TASK = '{"op": "*", "max_operand": 30, "tool": true, "max_turns": 2}'


class ScriptedPolicy:
    """A stand-in policy that reads the question off the prompt: `solves` decides per call whether
    it answers right, so the expected figures are known exactly (`ops` records each question's op)."""

    def __init__(self, solves) -> None:
        self.solves = solves
        self.calls = 0
        self.ops: list[tuple[str, int, int]] = []

    async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
        text = TOK.decode(prompt)
        a, op, b = re.search(r"(\d+)([*+])(\d+)=", text).groups()
        a, b = int(a), int(b)
        self.ops.append((op, a, b))
        right = a * b if op == "*" else a + b
        answer = str(right) if self.solves(self.calls, a, b) else str(right + 1)
        self.calls += 1
        ids = TOK.encode(answer) + [TOK.eos_id]
        return Turn(token_ids=ids, logprobs=[-0.5] * len(ids), policy_versions=[7] * len(ids), finished_by_stop=True)


def rollout_cfg(**eval_kw) -> RolloutConfig:
    return RolloutConfig(env_name="arith", env_config_json=TASK, max_turns=2, group_size=2, concurrent_groups=2,
                         sampling=SamplingConfig(max_tokens=8),
                         eval=EvalConfig(env_config_json='{"split": "eval"}', **eval_kw))


def evaluator(cfg: RolloutConfig, greedy, sampled) -> Evaluator:
    env, scorer = GatewayEnv(), CoreScorer()

    async def episode(spec, gen):
        return await run_episode(spec, TOK, gen, env, scorer)

    return Evaluator(cfg, run_id="r", greedy=greedy, sampled=sampled, run_episode=episode)


def test_pass_at_k_counts_tasks_with_any_success() -> None:
    assert pass_at_k([[0, 0, 1], [0, 0, 0], [1, 1, 1], [0.4, 0.3, 0.2]]) == 0.5
    assert pass_at_k([]) == 0.0


def test_eval_config_is_merged_over_the_training_config() -> None:
    assert json.loads(eval_env_config(rollout_cfg())) == {**json.loads(TASK), "split": "eval"}
    with pytest.raises(ValueError, match="rollout.env_config_json must be a JSON object"):
        eval_env_config(RolloutConfig(env_config_json="[1]"))
    with pytest.raises(ConfigError, match="rollout.eval.env_config_json is not valid JSON"):
        load_config(overrides={"rollout": {"eval": {"env_config_json": "{split"}}})


def test_an_entry_eval_override_replaces_the_run_wide_one() -> None:
    cfg = RolloutConfig(envs=(
        RolloutEnvConfig(name="arith", label="times", config_json='{"op": "*"}'),
        RolloutEnvConfig(name="arith", label="plus", config_json='{"op": "+", "max_operand": 50}',
                         eval_config_json='{"max_operand": 5}'),
        RolloutEnvConfig(name="arith", label="as_trained", config_json='{"op": "-"}', eval_config_json="{}"),
    ), eval=EvalConfig(env_config_json='{"split": "eval"}'))
    configs = {t.key: json.loads(t.config_json) for t in eval_targets(cfg)}
    assert configs == {"times": {"op": "*", "split": "eval"}, "plus": {"op": "+", "max_operand": 5},
                       "as_trained": {"op": "-"}}
    assert json.loads(eval_env_config(cfg, "plus")) == configs["plus"]
    with pytest.raises(ConfigError, match=r"rollout.envs\[0\].eval_config_json is not valid JSON"):
        load_config(overrides={"rollout": {"envs": [{"name": "arith", "eval_config_json": "{x"}]}})


def test_each_environment_of_a_mixture_is_evaluated_and_reported_apart() -> None:
    # Two arith entries (times and plus); the policy always gets times right and plus wrong, so the
    # per-environment figures are 1 and 0 and the overall ones, over both entries' tasks, 0.5.
    cfg = RolloutConfig(
        envs=(RolloutEnvConfig(name="arith", label="times", config_json='{"op": "*", "max_turns": 1}', weight=3),
              RolloutEnvConfig(name="arith", label="plus", config_json='{"op": "+", "max_turns": 1}',
                               eval_config_json='{"split": "eval", "max_operand": 20}')),
        max_turns=1, group_size=2, concurrent_groups=2, sampling=SamplingConfig(max_tokens=8),
        eval=EvalConfig(env_config_json='{"split": "eval"}', num_tasks=4, samples=2))
    greedy, sampled = ScriptedPolicy(lambda *a: True), ScriptedPolicy(lambda *a: True)

    def right_on_times(policy: ScriptedPolicy):
        return lambda i, a, b: policy.ops[-1][0] == "*"

    greedy.solves, sampled.solves = right_on_times(greedy), right_on_times(sampled)
    result = asyncio.run(evaluator(cfg, greedy, sampled).run())
    times, plus = result["envs"]["times"], result["envs"]["plus"]
    assert list(result["envs"]) == ["times", "plus"]
    assert (times["greedy_reward"], times["sampled_reward"], times["pass_at_k"]) == (1.0, 1.0, 1.0)
    assert (plus["greedy_reward"], plus["sampled_reward"], plus["pass_at_k"]) == (0.0, 0.0, 0.0)
    assert (result["greedy_reward"], result["sampled_reward"], result["pass_at_k"]) == (0.5, 0.5, 0.5)
    assert times["num_tasks"] == plus["num_tasks"] == 4 and result["num_tasks"] == 8 and result["k"] == 2
    assert result["errors"] == times["errors"] == plus["errors"] == 0
    # Each entry ran on its own held-out config: plus's override widened its operands past arith's 9.
    asked = greedy.ops + sampled.ops
    assert sum(op == "*" for op, _, _ in asked) == sum(op == "+" for op, _, _ in asked) == 4 * 3
    from services.env_gateway.envs.arith import in_split

    assert all(in_split(a, b, "eval") for _, a, b in asked)
    assert all(a <= 9 and b <= 9 for op, a, b in asked if op == "*")
    assert any(max(a, b) > 9 for op, a, b in asked if op == "+")


def test_figures_from_a_policy_of_known_skill() -> None:
    # One turn per episode; greedy always right; the sampler right on the first of each task's 4
    # samples only: sampled mean 0.25, and every task solved once, so pass@4 is 1.
    cfg = dataclasses.replace(rollout_cfg(num_tasks=6, samples=4), max_turns=1)
    cfg = dataclasses.replace(cfg, eval=dataclasses.replace(cfg.eval, env_config_json='{"split": "eval", "max_turns": 1}'))
    counts: Counter[tuple[int, int]] = Counter()

    def first_sample_only(i: int, a: int, b: int) -> bool:
        counts[(a, b)] += 1
        return counts[(a, b)] == 1

    result = asyncio.run(evaluator(cfg, ScriptedPolicy(lambda i, a, b: True), ScriptedPolicy(first_sample_only)).run())
    assert len(counts) == 6, "the test needs 6 distinct held-out tasks"
    assert result["greedy_reward"] == 1.0
    assert result["sampled_reward"] == 0.25 and result["pass_at_k"] == 1.0
    assert (result["k"], result["num_tasks"], result["errors"]) == (4, 6, 0)
    assert result["min_version"] == result["max_version"] == 7


def test_held_out_tasks_are_the_eval_split_and_failures_count_as_errors() -> None:
    seen: list[tuple[int, int]] = []

    def record(i: int, a: int, b: int) -> bool:
        seen.append((a, b))
        return False

    class Broken:
        async def generate(self, prompt, *, max_tokens: int, session_id: str = "", seed: int | None = None) -> Turn:
            raise RuntimeError("backend down")

    result = asyncio.run(evaluator(rollout_cfg(num_tasks=5, samples=2), ScriptedPolicy(record), Broken()).run())
    from services.env_gateway.envs.arith import in_split

    assert seen and all(in_split(a, b, "eval") for a, b in seen)
    assert result["errors"] == 10 and result["sampled_reward"] == 0.0 and result["greedy_reward"] == 0.0
    # The cause travels with the count (the live view showed "greedy 0.000" and nothing else: issue 33).
    assert result["first_error"] == "RuntimeError: backend down"
    assert all(env["first_error"] == "RuntimeError: backend down" for env in result["envs"].values())


async def test_a_request_is_answered_once_through_redis(redis_url: str, run_id: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        asker = EvalQueue(client, run_id)
        await asker.ensure_group()
        request_id = await asker.request("start", min_version=3)
        versions = iter([1, 2, 3])

        async def served() -> int:
            return next(versions, 3)

        ev = evaluator(rollout_cfg(num_tasks=2, samples=1), ScriptedPolicy(lambda *a: True),
                       ScriptedPolicy(lambda *a: False))
        worker = asyncio.create_task(serve_evaluations(EvalQueue(client, run_id, consumer="w1"), ev, served,
                                                       block_ms=100))
        try:
            for _ in range(100):
                result = await asker.result(request_id)
                if result is not None:
                    break
                await asyncio.sleep(0.1)
        finally:
            worker.cancel()
        assert result["tag"] == "start" and result["served_version"] == 3 and result["requested_version"] == 3
        assert result["greedy_reward"] == 1.0 and result["sampled_reward"] == 0.0
        assert result["envs"]["arith"]["greedy_reward"] == 1.0  # one environment: its figures are the overall ones
        latest = await asker.latest_result()  # what `arlo status` shows
        assert latest["tag"] == "start" and latest["envs"] == result["envs"]
        pending = await client.xpending(f"arlo:{run_id}:eval:requests", "rollout")
        assert pending["pending"] == 0  # acknowledged: no other worker runs it again
    finally:
        await client.aclose()


async def test_an_abandoned_request_is_claimed_by_another_worker(redis_url: str, run_id: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    try:
        queue = EvalQueue(client, run_id, consumer="dead")
        await queue.ensure_group()
        request_id = await queue.request("v10", min_version=10)
        taken = await queue.take(block_ms=100, claim_idle_ms=60_000)
        assert taken is not None and taken.request_id == request_id and taken.min_version == 10
        # The worker died without answering; another takes the request once it has been idle.
        await asyncio.sleep(0.05)
        again = await EvalQueue(client, run_id, consumer="alive").take(block_ms=100, claim_idle_ms=10)
        assert again is not None and again.request_id == request_id
    finally:
        await client.aclose()
