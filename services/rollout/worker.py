"""Rollout worker: keeps `concurrent_groups` GRPO groups in flight and writes their trajectories.

A group's episodes run concurrently on the same task (same env seed). A retryable backend
error retries the episode with backoff; a terminal error masks the whole group (every member
is written with status ERROR, so the trainer drops the group, never half of it).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from arlo.config import RolloutConfig, RolloutEnvConfig
from arlo.coord import BacklogFull, TrajectoryStream
from arlo.groups import trainable_count
from arlo.model.tokenizer import Tokenizer
from arlo.proto.v1 import common_pb2
from arlo.tracing import in_span, span, start_span
from services.rollout import prefetch
from services.rollout.admission import AdmissionGate
from services.rollout.agent import EnvClient, EpisodeSpec, Generator, Scorer, derive_seed, run_episode
from services.rollout.mixture import TaskPicker
from services.rollout.prefetch import PrefetchedEnv
from services.rollout.types import EpisodeDoesNotFit, RetryableError

if TYPE_CHECKING:
    from opentelemetry.trace import Span, Tracer

log = logging.getLogger(__name__)

UNWIND_S = 3.0
"""A stopped worker waits this long at most for its cancelled groups to clean up."""

EPISODE_SPAN = "rollout.episode"
MAX_EPISODE_ATTEMPTS = 4
EpisodeFn = Callable[[EpisodeSpec, Any, Generator, EnvClient, Scorer], Awaitable[common_pb2.Trajectory]]


@dataclass
class WorkerStats:
    groups: int = 0
    episodes: int = 0
    retries: int = 0
    failed_groups: int = 0
    backpressure_waits: int = 0
    reward_sum: float = 0.0
    turns: int = 0
    tool_call_errors: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    refused: str = ""
    """Why the run's limits cannot hold an episode (the latest `EpisodeDoesNotFit`), for the
    heartbeat: every episode like it trains nothing, so `arlo train` stops on it."""
    last_failure: str = ""
    """The latest failed group's error, for the heartbeat (`arlo train` names it when no step comes)."""

    def snapshot(self) -> dict[str, object]:
        """The counters for /metrics (read from the scrape thread: a copy, never the live dict)."""
        return {"episodes": self.episodes, "groups": self.groups, "turns": self.turns, "retries": self.retries,
                "tool_call_errors": self.tool_call_errors, "failed_groups": self.failed_groups,
                "finish_reasons": dict(self.finish_reasons)}

    def count(self, trajs: list[common_pb2.Trajectory]) -> None:
        self.groups += 1
        self.episodes += len(trajs)
        self.reward_sum += sum(t.reward for t in trajs)
        self.turns += sum(t.num_turns for t in trajs)
        self.tool_call_errors += sum(t.tool_call_errors for t in trajs)
        for t in trajs:
            reason = t.finish_reason or "unknown"
            self.finish_reasons[reason] = self.finish_reasons.get(reason, 0) + 1


def record_episode(current: Span, traj: common_pb2.Trajectory) -> None:
    """What the episode came to, on its span (ids and reward, not its tokens)."""
    versions = [v for v in traj.policy_versions if v >= 0]
    current.set_attributes({
        "arlo.episode_id": traj.id, "arlo.turns": traj.num_turns, "arlo.reward": traj.reward,
        "arlo.finish_reason": traj.finish_reason, "arlo.status": common_pb2.TrajectoryStatus.Name(traj.status),
        "arlo.policy_version": max(versions, default=-1), "arlo.policy_version_min": min(versions, default=-1),
        "arlo.tokens": len(traj.token_ids),
    })


class RolloutWorker:
    def __init__(self, cfg: RolloutConfig, *, run_id: str, tokenizer: Tokenizer, gen: Generator,
                 env: EnvClient, scorer: Scorer, stream: TrajectoryStream, seed: int | None = None,
                 gate: AdmissionGate | None = None, filter_zero_variance: bool = False,
                 tasks: TaskPicker | None = None, episode_fn: EpisodeFn = run_episode,
                 tracer: Tracer | None = None, prefetch_max_age_s: float = prefetch.MAX_AGE_S,
                 max_prompt_tokens: int = 0) -> None:
        """`episode_fn`: how one episode runs (the built-in turn loop, or a black-box agent's
        runner, services.rollout.blackbox). `tracer`: each episode is a `rollout.episode` span, the
        parent of its RPCs (None: no tracing); one whose Resets were prefetched starts with them,
        before the admission gate, and carries a "run" event where the episode itself starts.
        `prefetch_max_age_s`: a Reset prefetched longer ago is redone (keep it inside the env
        gateway's session idle timeout). `max_prompt_tokens`: inference's (0: unchecked), for every
        episode's spec, evaluations' included (they run through `episode`)."""
        self.max_prompt_tokens = max_prompt_tokens
        self.prefetch_max_age_s = prefetch_max_age_s
        self.episode_fn = episode_fn
        self.tracer = tracer
        self.gate = gate
        self.filter_zero_variance = filter_zero_variance
        self.cfg = cfg
        self.run_id = run_id
        self.tok = tokenizer
        self.gen, self.env, self.scorer = gen, env, scorer
        self.stream = stream
        self.rng = random.Random(seed)
        # Which env and seed each group gets; without a Redis-backed picker, random seeds.
        self.tasks = tasks if tasks is not None else TaskPicker(cfg.mixture, self.rng)
        self.stats = WorkerStats()
        self._consecutive_failures = 0

    async def run(self, max_groups: int | None = None) -> None:
        """Runs groups until cancelled (or `max_groups` have been written)."""
        sem = asyncio.Semaphore(self.cfg.concurrent_groups)
        pending: set[asyncio.Task[None]] = set()
        started = 0
        try:
            while max_groups is None or started < max_groups:
                await sem.acquire()
                task = asyncio.create_task(self._group_then_release(sem))
                pending.add(task)
                task.add_done_callback(pending.discard)
                started += 1
            await asyncio.gather(*pending)
        finally:
            for task in pending:
                task.cancel()
            if pending:  # their cleanup (closes handed to the env client, gate.finish) runs before we return
                await asyncio.wait(set(pending), timeout=UNWIND_S)

    async def _group_then_release(self, sem: asyncio.Semaphore) -> None:
        written, admitted, envs, spans = 0, False, [], []
        group_id, reached_stream = uuid.uuid4().hex, False
        try:
            env, pick = self.tasks.draw_env(), None
            if not self.tasks.leases_seeds(env):
                # The group's Resets need no weights: started before the gate, they are done when
                # it opens, off the step's critical path (prefetch.py). Traced, each is a child of
                # its episode's span, started here for it. Not for a leased seed (a dataset's
                # cursor): its lease would run out while the group waits, and the seed be handed
                # out again.
                pick = await self.tasks.next(env)
                spans = [start_span(self.tracer, EPISODE_SPAN) for _ in range(self.cfg.group_size)]
                for started in spans:
                    with in_span(started, end=False):
                        envs.append(PrefetchedEnv(self.env, env.name, env.config_json, pick.seed,
                                                  max_age_s=self.prefetch_max_age_s))
            version = await self.gate.acquire(self.cfg.group_size) if self.gate is not None else 0
            admitted = True  # from here `finish` gives the slot back, whatever happens
            if self.gate is not None:
                await self.gate.mark(group_id, version)
            pick = pick if pick is not None else await self.tasks.next(env)
            trajs = await self.run_group(pick.seed, env, envs=envs, spans=spans, group_id=group_id)
            reached_stream, written = True, self.usable(trajs)
            await self.tasks.done(pick)  # not reached on a crash: the cursor hands the seed out again
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("group failed outside the episode loop")
        finally:
            await asyncio.shield(asyncio.gather(*(e.release() for e in envs), return_exceptions=True))
            for started in spans:  # those of episodes that never ran
                if started is not None and started.is_recording():
                    started.end()
            if self.gate is not None and admitted:
                # A group that reached the stream stays in flight until the trainer has it.
                await self.gate.finish(self.cfg.group_size, written, "" if reached_stream else group_id)
            sem.release()

    def usable(self, trajs: list[common_pb2.Trajectory]) -> int:
        """Trajectories of a group the trainer will train on: only those count as accepted.

        A masked group, or (with dynamic sampling) a group whose rewards are all equal, is
        dropped by the trainer; counting it would use up the staleness budget for good and
        eventually stop every worker.
        """
        return trainable_count(trajs, filter_zero_variance=self.filter_zero_variance)

    async def run_group(self, task_seed: int, env: RolloutEnvConfig | None = None, *,
                        envs: Sequence[EnvClient] = (), spans: Sequence[Span | None] = (),
                        group_id: str = "") -> list[common_pb2.Trajectory]:
        """One group of `task_seed`; `envs`: each member's env client (default: the worker's);
        `spans`: each member's episode span, started already (default: started per episode);
        `group_id`: the id its admission marked in flight (default: a new one)."""
        env = env if env is not None else self.cfg.mixture[0]
        group_id = group_id or uuid.uuid4().hex
        spec = EpisodeSpec(
            env_name=env.name, env_config_json=env.config_json, reward_fn=env.reward_fn,
            seed=task_seed, max_turns=self.cfg.max_turns,
            max_tokens_per_turn=env.max_tokens or self.cfg.sampling.max_tokens,
            max_episode_tokens=self.cfg.max_episode_tokens, run_id=self.run_id, group_id=group_id,
            group_size=self.cfg.group_size, max_wall_s=self.cfg.episode_timeout_s,
        )
        results = await asyncio.gather(*(self.episode(self._member(spec, env, i), self.gen,
                                                      envs[i] if envs else self.env, spans[i] if spans else None)
                                         for i in range(self.cfg.group_size)), return_exceptions=True)
        trajs = self._mask_if_failed(spec, results)
        for t in trajs:
            t.env_name = env.key  # per-environment metrics in a mixture
        failed = trajs[0].status == common_pb2.TRAJECTORY_STATUS_ERROR
        self._consecutive_failures = self._consecutive_failures + 1 if failed else 0
        await self._add_with_backpressure(trajs)
        self.stats.count(trajs)
        if self._consecutive_failures:
            # Every group failing means a broken backend or config: slow down instead of flooding
            # the stream with masked groups.
            await asyncio.sleep(min(0.5 * 2 ** (self._consecutive_failures - 1), 30.0))
        return trajs

    def _member(self, spec: EpisodeSpec, env: RolloutEnvConfig, index: int) -> EpisodeSpec:
        """The group's `index`th episode: with sampling.seed, its own seed from the task and place."""
        base = self.cfg.sampling.seed
        if base is None:
            return spec
        return dataclasses.replace(spec, sampling_seed=derive_seed(base, env.key, spec.seed, index))

    async def episode(self, spec: EpisodeSpec, gen: Generator, env: EnvClient | None = None,
                      started: Span | None = None) -> common_pb2.Trajectory:
        """One episode with `gen` (training's sampler, or evaluation's) and `env` (default: the
        worker's client), retrying retryable errors; traced as `started` (or a span of its own)."""
        attributes = {"arlo.env": spec.env_name, "arlo.group_id": spec.group_id, "arlo.task_seed": spec.seed}
        block = in_span(started, end=True) if started is not None else span(self.tracer, EPISODE_SPAN, attributes)
        with block as current:
            if started is not None:
                started.set_attributes(attributes)
                started.add_event("run")  # the span began at the prefetch, before the admission wait
            if self.max_prompt_tokens and not spec.max_prompt_tokens:
                spec = dataclasses.replace(spec, max_prompt_tokens=self.max_prompt_tokens)
            try:
                traj = await self._attempts(spec, gen, env if env is not None else self.env)
            except EpisodeDoesNotFit as e:
                if e.message != self.stats.refused:
                    log.error("episode refused: %s", e.message)
                self.stats.refused = e.message
                raise
            if current is not None and current.is_recording():  # not sampled: nothing to record
                record_episode(current, traj)
            return traj

    async def _attempts(self, spec: EpisodeSpec, gen: Generator, env: EnvClient) -> common_pb2.Trajectory:
        for attempt in range(MAX_EPISODE_ATTEMPTS):
            try:
                # The wall-time limit ends an episode between turns (a recorded finish reason, still
                # trainable); this hard cap only catches a turn that itself hangs past it.
                return await asyncio.wait_for(self.episode_fn(spec, self.tok, gen, env, self.scorer),
                                              2 * self.cfg.episode_timeout_s)
            except RetryableError:
                if attempt == MAX_EPISODE_ATTEMPTS - 1:
                    raise
                self.stats.retries += 1
                await asyncio.sleep(min(0.2 * 2**attempt, 5.0) * (0.5 + self.rng.random()))
        raise AssertionError("unreachable")

    def _mask_if_failed(self, spec: EpisodeSpec, results: list) -> list[common_pb2.Trajectory]:
        errors = [r for r in results if isinstance(r, BaseException)]
        if not errors:
            return list(results)
        self.stats.failed_groups += 1
        self.stats.last_failure = str(errors[0])[:500]
        log.warning("group %s masked: %s", spec.group_id, errors[0])
        return [common_pb2.Trajectory(
            id=uuid.uuid4().hex, run_id=spec.run_id, group_id=spec.group_id, group_size=spec.group_size,
            status=common_pb2.TRAJECTORY_STATUS_ERROR, error=str(errors[0])[:1000], finish_reason="error",
        ) for _ in results]

    async def _add_with_backpressure(self, trajs: list[common_pb2.Trajectory]) -> None:
        delay = 0.1
        while True:
            try:
                await self.stream.add_group(trajs)  # all or nothing: a kill -9 leaves no half group
                return
            except BacklogFull:
                # The trainer is behind: wait rather than let MAXLEN drop unread data.
                self.stats.backpressure_waits += 1
                await asyncio.sleep(delay)
                delay = min(delay * 2, 2.0)
