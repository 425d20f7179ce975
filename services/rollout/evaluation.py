"""Held-out evaluation by the rollout workers: greedy reward, mean sampled reward and pass@k.

Same agent loop and backends as training, but the episodes go nowhere near the trajectory
stream: they are scored and summarised, never trained on. Tasks are seeds 0..num_tasks-1 of
the env config with `eval.env_config_json` merged over it (e.g. an environment's held-out
split), so successive evaluations of a run are of the same tasks and comparable.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

from arlo.config import RolloutConfig
from arlo.coord.evals import EvalQueue, EvalRequest
from arlo.jsonfields import parse_json_object
from arlo.proto.v1 import common_pb2
from services.rollout.agent import EpisodeSpec, Generator, derive_seed

log = logging.getLogger(__name__)

SUCCESS = 0.5
"""A sample with reward above this counts as solved for pass@k (rewards are on a 0-1 scale)."""

RunEpisode = Callable[[EpisodeSpec, Generator], Awaitable[common_pb2.Trajectory]]


def pass_at_k(rewards_per_task: list[list[float]]) -> float:
    """Fraction of tasks solved by at least one of their samples."""
    if not rewards_per_task:
        return 0.0
    return sum(any(r > SUCCESS for r in rs) for rs in rewards_per_task) / len(rewards_per_task)


def eval_env_config(cfg: RolloutConfig) -> str:
    # Evaluation runs the mixture's first entry (per-environment evaluation is not built yet).
    where = "rollout.envs[0].config_json" if cfg.envs else "rollout.env_config_json"
    base = parse_json_object(cfg.mixture[0].config_json.strip(), where)
    extra = parse_json_object(cfg.eval.env_config_json.strip(), "rollout.eval.env_config_json")
    return json.dumps({**base, **extra})


class Evaluator:
    def __init__(self, cfg: RolloutConfig, *, run_id: str, greedy: Generator, sampled: Generator,
                 run_episode: RunEpisode) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.greedy, self.sampled = greedy, sampled
        self.run_episode = run_episode
        self.env_config_json = eval_env_config(cfg)  # a bad config fails at start, not at the first eval

    def _spec(self, seed: int, sample: int = 0) -> EpisodeSpec:
        c, env = self.cfg, self.cfg.mixture[0]
        # With sampling.seed, each (task, sample) has its own stream: k samples of a task must differ.
        sampling_seed = None if c.sampling.seed is None else derive_seed(c.sampling.seed, "eval", seed, sample)
        return EpisodeSpec(env_name=env.name, env_config_json=self.env_config_json, reward_fn=env.reward_fn,
                           seed=seed, max_turns=c.max_turns, max_tokens_per_turn=c.sampling.max_tokens,
                           max_episode_tokens=c.max_episode_tokens, run_id=self.run_id,
                           group_id=f"eval-{uuid.uuid4().hex}", group_size=1, sampling_seed=sampling_seed)

    async def run(self) -> dict[str, Any]:
        started = time.monotonic()
        e = self.cfg.eval
        sem = asyncio.Semaphore(max(self.cfg.concurrent_groups * self.cfg.group_size, 1))

        async def one(seed: int, gen: Generator, sample: int = 0) -> common_pb2.Trajectory | None:
            async with sem:
                try:
                    return await self.run_episode(self._spec(seed, sample), gen)
                except Exception as exc:  # counted, and scored as unsolved: an eval never hangs a run
                    log.warning("evaluation episode (seed %d) failed: %s", seed, exc)
                    return None

        seeds = range(e.num_tasks)
        greedy = asyncio.gather(*(one(s, self.greedy) for s in seeds))
        sampled = asyncio.gather(*(one(s, self.sampled, k) for s in seeds for k in range(e.samples)))
        greedy_trajs, sampled_trajs = await asyncio.gather(greedy, sampled)
        rewards = [[_reward(t) for t in sampled_trajs[i * e.samples:(i + 1) * e.samples]] for i in seeds]
        done = [t for t in (*greedy_trajs, *sampled_trajs) if t is not None]
        versions = [v for t in done for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m]
        return {
            "greedy_reward": sum(_reward(t) for t in greedy_trajs) / e.num_tasks,
            "sampled_reward": sum(map(sum, rewards)) / (e.num_tasks * e.samples),
            "pass_at_k": pass_at_k(rewards), "k": e.samples, "num_tasks": e.num_tasks,
            "errors": len(greedy_trajs) + len(sampled_trajs) - len(done),
            "min_version": min(versions, default=0), "max_version": max(versions, default=0),
            "tokens": sum(sum(t.loss_mask) for t in done), "wall_s": time.monotonic() - started,
        }


def _reward(traj: common_pb2.Trajectory | None) -> float:
    return traj.reward if traj is not None and traj.status == common_pb2.TRAJECTORY_STATUS_OK else 0.0


async def serve_evaluations(queue: EvalQueue, evaluator: Evaluator, served_version: Callable[[], Awaitable[int]],
                            *, block_ms: int = 1000, claim_idle_ms: int = 60_000) -> None:
    """A worker's evaluation loop: take a request, wait for its weights, evaluate, answer. Forever."""
    await queue.ensure_group()
    while True:
        request = await queue.take(block_ms, claim_idle_ms)
        if request is None:
            continue
        result = await _answer(request, evaluator, served_version)
        await queue.finish(request, result)
        if "error" in result:
            log.warning("evaluation %r not done: %s", request.tag, result["error"], extra={"eval": result})
        log.info("evaluation %r: %s", request.tag, result, extra={"eval": result, "tag": request.tag})


async def _answer(request: EvalRequest, evaluator: Evaluator,
                  served_version: Callable[[], Awaitable[int]]) -> dict[str, Any]:
    deadline = time.monotonic() + evaluator.cfg.eval.timeout_s
    while (served := await served_version()) < request.min_version:
        if time.monotonic() > deadline:
            return {"tag": request.tag, "requested_version": request.min_version,
                    "error": f"inference still serves v{served} < v{request.min_version}"}
        await asyncio.sleep(0.2)
    try:
        result = await asyncio.wait_for(evaluator.run(), evaluator.cfg.eval.timeout_s)
    except TimeoutError:
        return {"tag": request.tag, "requested_version": request.min_version,
                "error": f"evaluation took over {evaluator.cfg.eval.timeout_s}s"}
    # The policy may move on while the episodes run: min_version..max_version (of the episodes'
    # model tokens) say which versions the figures are of, whatever version was asked for.
    return {"tag": request.tag, "requested_version": request.min_version, "served_version": served, **result}
