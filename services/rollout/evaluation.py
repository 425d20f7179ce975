"""Held-out evaluation by the rollout workers: greedy reward, mean sampled reward and pass@k,
for every environment of the mixture and overall.

Same agent loop and backends as training, but the episodes go nowhere near the trajectory
stream: they are scored and summarised, never trained on. Each mixture entry's tasks are seeds
0..num_tasks-1 of its config_json with its eval override merged over it (the entry's
`eval_config_json`, else `rollout.eval.env_config_json`: e.g. an environment's held-out split), so
successive evaluations of a run are of the same tasks and comparable. The overall figures are
over every task of every entry (each entry has num_tasks of them: entries count equally, whatever
their mixture weights).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from arlo.config import RolloutConfig, RolloutEnvConfig
from arlo.coord.evals import EvalQueue, EvalRequest
from arlo.jsonfields import parse_json_object
from arlo.proto.v1 import common_pb2
from services.rollout.agent import EpisodeSpec, Generator, derive_seed

log = logging.getLogger(__name__)

SUCCESS = 0.5
"""A sample with reward above this counts as solved for pass@k (rewards are on a 0-1 scale)."""

FIRST_ERROR_CHARS = 500
"""An episode's error as kept in an evaluation's result (what the live view and the report show)."""

RunEpisode = Callable[[EpisodeSpec, Generator], Awaitable[common_pb2.Trajectory]]


def pass_at_k(rewards_per_task: list[list[float]]) -> float:
    """Fraction of tasks solved by at least one of their samples."""
    if not rewards_per_task:
        return 0.0
    return sum(any(r > SUCCESS for r in rs) for rs in rewards_per_task) / len(rewards_per_task)


@dataclass(frozen=True, slots=True)
class EvalTarget:
    """One mixture entry as evaluated: the entry, and the config its held-out episodes reset with."""

    env: RolloutEnvConfig
    config_json: str

    @property
    def key(self) -> str:
        return self.env.key


def eval_targets(cfg: RolloutConfig) -> tuple[EvalTarget, ...]:
    """Every mixture entry with its held-out config; a bad JSON object is an error naming its field."""
    extra = parse_json_object(cfg.eval.env_config_json.strip(), "rollout.eval.env_config_json")
    out = []
    for i, env in enumerate(cfg.mixture):
        where = f"rollout.envs[{i}]" if cfg.envs else "rollout"
        base = parse_json_object(env.config_json.strip(), f"{where}.config_json" if cfg.envs else
                                 "rollout.env_config_json")
        own = env.eval_config_json.strip()
        override = parse_json_object(own, f"{where}.eval_config_json") if own else extra
        out.append(EvalTarget(env=env, config_json=json.dumps({**base, **override})))
    return tuple(out)


def eval_env_config(cfg: RolloutConfig, key: str | None = None) -> str:
    """The held-out config of the entry called `key` (default: the first)."""
    targets = eval_targets(cfg)
    return next(t for t in targets if key is None or t.key == key).config_json


@dataclass(frozen=True, slots=True)
class _Outcome:
    """One target's episodes: greedy (one per task) and sampled (k per task), None where one failed."""

    greedy: Sequence[common_pb2.Trajectory | None]
    sampled: Sequence[common_pb2.Trajectory | None]
    failures: Sequence[str] = ()
    """Why episodes failed, as they failed ("ValueError: prompt_token_ids has 417 tokens; ...")."""


class Evaluator:
    def __init__(self, cfg: RolloutConfig, *, run_id: str, greedy: Generator, sampled: Generator,
                 run_episode: RunEpisode) -> None:
        self.cfg = cfg
        self.run_id = run_id
        self.greedy, self.sampled = greedy, sampled
        self.run_episode = run_episode
        self.targets = eval_targets(cfg)  # a bad config fails at start, not at the first eval

    def _spec(self, target: EvalTarget, seed: int, sample: int = 0) -> EpisodeSpec:
        c, env = self.cfg, target.env
        # With sampling.seed, each (entry, task, sample) has its own stream: k samples of a task must differ.
        sampling_seed = None if c.sampling.seed is None else derive_seed(c.sampling.seed, "eval", target.key,
                                                                         seed, sample)
        return EpisodeSpec(env_name=env.name, env_config_json=target.config_json, reward_fn=env.reward_fn,
                           seed=seed, max_turns=c.max_turns,
                           max_tokens_per_turn=env.max_tokens or c.sampling.max_tokens,
                           max_episode_tokens=c.max_episode_tokens, run_id=self.run_id,
                           group_id=f"eval-{uuid.uuid4().hex}", group_size=1, sampling_seed=sampling_seed)

    async def run(self) -> dict[str, Any]:
        started = time.monotonic()
        e = self.cfg.eval
        sem = asyncio.Semaphore(max(self.cfg.concurrent_groups * self.cfg.group_size, 1))

        async def one(target: EvalTarget, seed: int, gen: Generator, failures: list[str],
                      sample: int = 0) -> common_pb2.Trajectory | None:
            async with sem:
                try:
                    return await self.run_episode(self._spec(target, seed, sample), gen)
                except Exception as exc:  # counted, and scored as unsolved: an eval never hangs a run
                    log.warning("evaluation episode (%s, seed %d) failed: %s", target.key, seed, exc)
                    failures.append(f"{type(exc).__name__}: {exc}")  # shown to the user (issue 33, item 3)
                    return None

        async def outcome(target: EvalTarget) -> _Outcome:
            seeds, failures = range(e.num_tasks), []
            greedy = asyncio.gather(*(one(target, s, self.greedy, failures) for s in seeds))
            sampled = asyncio.gather(*(one(target, s, self.sampled, failures, k)
                                       for s in seeds for k in range(e.samples)))
            g, s = await asyncio.gather(greedy, sampled)
            return _Outcome(greedy=g, sampled=s, failures=failures)

        outcomes = await asyncio.gather(*(outcome(t) for t in self.targets))
        every = _Outcome(greedy=[t for o in outcomes for t in o.greedy], sampled=[t for o in outcomes for t in o.sampled],
                         failures=[f for o in outcomes for f in o.failures])
        return {**summarize(every, e.samples), "k": e.samples,
                "envs": {t.key: summarize(o, e.samples) for t, o in zip(self.targets, outcomes, strict=True)},
                "wall_s": time.monotonic() - started}


def summarize(outcome: _Outcome, k: int) -> dict[str, Any]:
    """Greedy reward, mean sampled reward, pass@k, and what they are of (tasks, errors, versions, tokens)."""
    num_tasks = len(outcome.greedy)
    rewards = [[_reward(t) for t in outcome.sampled[i * k:(i + 1) * k]] for i in range(num_tasks)]
    done = [t for t in (*outcome.greedy, *outcome.sampled) if t is not None]
    versions = [v for t in done for v, m in zip(t.policy_versions, t.loss_mask, strict=True) if m]
    return {
        "greedy_reward": sum(map(_reward, outcome.greedy)) / max(num_tasks, 1),
        "sampled_reward": sum(map(sum, rewards)) / max(num_tasks * k, 1),
        "pass_at_k": pass_at_k(rewards), "num_tasks": num_tasks,
        "errors": len(outcome.greedy) + len(outcome.sampled) - len(done),
        "first_error": _first_error(outcome),
        "min_version": min(versions, default=0), "max_version": max(versions, default=0),
        "tokens": sum(sum(t.loss_mask) for t in done),
    }


def _first_error(outcome: _Outcome) -> str | None:
    """The first episode's error: one that raised, else one that ended as an error trajectory."""
    failed = [t.error for t in (*outcome.greedy, *outcome.sampled)
              if t is not None and t.status == common_pb2.TRAJECTORY_STATUS_ERROR and t.error]
    first = next(iter((*outcome.failures, *failed)), None)
    return None if first is None else first[:FIRST_ERROR_CHARS]


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
