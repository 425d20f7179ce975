"""Driving a training run against running services (`arlo train`, `arlo demo`).

The CLI's async core: it talks to services only through their gRPC contracts and to Redis
only through arlo.coord, so it works the same against local processes and a cluster.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import grpc

from arlo.app.holds import RunHolds
from arlo.app.resilient import DEFAULT_RETRY, ResilientCalls, ResilientStub, RetryPolicy, retry
from arlo.app.run_record import RunRecorder
from arlo.app.supervisor import supervising
from arlo.config import RunConfig
from arlo.coord import WeightPointer, connect
from arlo.coord.evals import EvalQueue
from arlo.coord.metrics import MetricsStream
from arlo.proto.v1 import inference_pb2, inference_pb2_grpc, trainer_pb2, trainer_pb2_grpc
from arlo.rpc import make_channel

log = logging.getLogger(__name__)

ProgressFn = Callable[[dict[str, Any]], None]
"""Called with each step row (see `StepRow`) as the driver sees it."""

THROUGHPUT_WINDOW_S = 10.0
EVAL_GRACE_S = 30.0
"""Beyond rollout.eval.timeout_s: a worker's wait for its weights and the result's trip back."""


@dataclass
class TrainReport:
    steps: int = 0
    """Optimizer steps taken during this drive (SFT and RL)."""
    sft_steps: int = 0
    """The warm start's SFT steps as configured (an interrupted drive may have done fewer: `steps`)."""
    trainer_version: int = 0
    """The trainer's newest version (as of the last step seen, when interrupted)."""
    pointer_version: int = 0
    """The weight pointer's version once the fleet served it (0 when interrupted before that)."""
    inference_versions: dict[str, int] = field(default_factory=dict)
    rewards: list[float] = field(default_factory=list)
    """Training batch reward of each RL step seen."""
    evals: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Held-out evaluations by tag: "start", "after_sft", "end", and "v<version>" on the way."""
    wall_s: float = 0.0
    rl_wall_s: float = 0.0
    """Wall time of the RL phase alone."""
    rl_steps: int = 0
    """RL steps seen during this drive."""
    trajectories: int = 0
    """Trajectories trained on by those RL steps."""
    generated_tokens: int = 0
    """Model tokens of those trajectories (what the fleet generated and the trainer used)."""
    interrupted: bool = False
    """The drive was stopped (Ctrl-C, SIGTERM, SIGHUP) before its steps were done: the figures are
    what it saw (all 0 when stopped while the services started)."""
    first_rl_step_s: float | None = None
    """Seconds from the command's start to the first RL step seen: services starting, compiles and
    the SFT warm start included (issue 17's start time; `arlo train` against running services: no start)."""
    failed: str | None = None
    """The error that ended the drive early, if one did ("Stalled: ..."); the figures are what it saw."""

    def add_rl_step(self, record: dict[str, Any]) -> None:
        """Counts one RL step record of the trainer (services/trainer/diagnostics.py `step_record`)."""
        trajectories = record.get("num_trajectories", 0)
        self.rl_steps += 1
        self.trajectories += trajectories
        self.generated_tokens += round(record.get("response_length_mean", 0.0) * trajectories)

    def throughput(self) -> dict[str, float | None]:
        """Per second of the RL phase (None before any): steps, trajectories, generated tokens."""
        def per_s(n: int) -> float | None:
            return round(n / self.rl_wall_s, 4) if self.rl_wall_s > 0 and self.rl_steps else None
        return {"rl_steps_per_s": per_s(self.rl_steps), "trajectories_per_s": per_s(self.trajectories),
                "generated_tokens_per_s": per_s(self.generated_tokens)}

    def to_json(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(self.throughput())
        for tag in ("start", "after_sft", "end"):  # reward_start, reward_after_sft, reward_end, greedy_*
            result = self.evals.get(tag, {})
            out[f"reward_{tag}"] = result.get("sampled_reward")
            out[f"greedy_reward_{tag}"] = result.get("greedy_reward")
            if len(result.get("envs") or {}) > 1:  # a mixture: each environment's sampled reward too
                out[f"reward_{tag}_by_env"] = {k: v.get("sampled_reward") for k, v in result["envs"].items()}
        out["train_reward_first"] = self.rewards[0] if self.rewards else None
        out["train_reward_last"] = self.rewards[-1] if self.rewards else None
        return out


class Stalled(RuntimeError):
    """The trainer took no step for too long; the message says which counter or limit holds it."""


class EpisodesRefused(RuntimeError):
    """A rollout worker refused an episode the run's limits cannot hold (a config error)."""


@dataclass
class _Meter:
    """Throughput over a sliding window of (time, consumed, tokens) samples."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)

    def rates(self, now: float, consumed: int, tokens: int) -> tuple[float, float]:
        self.samples.append((now, consumed, tokens))
        while len(self.samples) > 2 and now - self.samples[1][0] >= THROUGHPUT_WINDOW_S:
            self.samples.pop(0)
        t0, c0, k0 = self.samples[0]
        dt = now - t0
        return ((consumed - c0) / dt, (tokens - k0) / dt) if dt > 0 else (0.0, 0.0)


class RunDriver:
    """Resumes the trainer phase by phase (warm start, then RL), evaluates at the boundaries, and
    turns the trainer's status into step rows for the progress display and the run record."""

    def __init__(self, cfg: RunConfig, token: str | None, *, on_progress: ProgressFn,
                 check_children: Callable[[], object] = lambda: None, recorder: RunRecorder | None = None,
                 evaluate: bool = True, rl_seconds: float | None = None,
                 on_phase: Callable[[str], Awaitable[None]] | None = None,
                 eval_tags: tuple[str, ...] = ("start", "after_sft", "end"), poll_s: float = 0.2,
                 stall_s: float = 300.0, retry_policy: RetryPolicy = DEFAULT_RETRY,
                 report: TrainReport | None = None) -> None:
        """`report`: filled in as the drive goes, so a caller that holds it has what was seen
        even when the drive is interrupted (`arlo demo --json` on Ctrl-C)."""
        self.retry = retry_policy
        self.eval_tags = eval_tags
        self.rl_seconds = rl_seconds
        self.on_phase = on_phase
        self.cfg, self.token = cfg, token
        self.on_progress = on_progress
        self.check_children = check_children
        self.recorder = recorder
        self.evaluate = evaluate
        self.poll_s, self.stall_s = poll_s, stall_s
        self.report = report if report is not None else TrainReport()
        self.started = time.monotonic()
        self._started_unix, self._refusals_checked = time.time(), 0.0
        self._meter = _Meter()
        self._pending_evals: dict[str, tuple[str, int]] = {}  # tag -> (request id, version asked for)
        self._version_step: dict[int, int] = {}  # version -> the last step that trained from it or published it
        self._last_step = 0
        self._first_step = 0  # the trainer's step when this drive began
        self._last_id = "0-0"  # the newest metrics-stream entry handled
        self._sft_steps = 0
        self._until_step = 0
        self.eval_wait_s = cfg.rollout.eval.timeout_s + EVAL_GRACE_S
        """How long an evaluation may go unanswered before it is recorded as skipped."""

    async def run(self, steps: int | None) -> TrainReport:
        """`steps` RL steps after the warm start (forever when None); then pauses the trainer."""
        # Every trainer RPC and Redis call below retries through a restart or hang (resilient.py).
        redis = await retry(lambda: connect(self.cfg.redis), policy=self.retry, what="redis connect")
        self.evals = ResilientCalls(EvalQueue(redis, self.cfg.run_id), self.retry, "evals")
        self.metrics = ResilientCalls(MetricsStream(redis, self.cfg.run_id), self.retry, "metrics")
        self.holds = ResilientCalls(RunHolds(redis, self.cfg), self.retry, "run holds")
        self._last_id = await self.metrics.last_id()  # this drive's steps only
        try:
            async with ResilientStub(trainer_pb2_grpc.TrainerStub, self.cfg.trainer.server.address,
                                     token=self.token, tls=self.cfg.auth.tls, policy=self.retry) as trainer:
                await self._run_phases(trainer, steps)
        finally:
            self.report.wall_s = time.monotonic() - self.started
            await redis.aclose()
        return self.report

    async def _run_phases(self, trainer: trainer_pb2_grpc.TrainerStub, steps: int | None) -> None:
        status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        first_step = self._first_step = self._last_step = status.step
        self._sft_steps = self.report.sft_steps = status.sft_steps
        await self._evaluate_now("start", status.version)
        sft_left = max(status.sft_steps - status.step, 0)
        if sft_left:
            status = await self._drive(trainer, until=status.step + sft_left)
            pointer, _ = await wait_fleet_on_pointer(self.cfg, self.token, policy=self.retry)
            await self._evaluate_now("after_sft", pointer)
        until = status.step + steps if steps is not None else None
        if self.on_phase:
            await self.on_phase("rl_start")  # e.g. a benchmark's counters, measured over RL alone
        self.rl_started = time.monotonic()
        deadline = self.rl_started + self.rl_seconds if self.rl_seconds else None
        try:
            status = await self._drive(trainer, until=until, deadline=deadline)
        finally:
            self.report.rl_wall_s = time.monotonic() - self.rl_started
        if self.on_phase:
            await self.on_phase("rl_end")
        self.report.steps = status.step - first_step
        self.report.sft_steps = status.sft_steps
        self.report.trainer_version = status.version
        self.report.pointer_version, self.report.inference_versions = await wait_fleet_on_pointer(
            self.cfg, self.token, policy=self.retry)
        await self._evaluate_now("end", self.report.pointer_version)
        await self._collect_pending(wait=True)

    async def _drive(self, trainer: trainer_pb2_grpc.TrainerStub, *, until: int | None,
                     deadline: float | None = None):
        """Resumes until `until` steps (None: until interrupted) or the monotonic `deadline`,
        reporting every step seen."""
        await trainer.Resume(trainer_pb2.ResumeRequest(until_step=until or 0), timeout=10)
        status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
        last_step, last_progress = status.step, time.monotonic()
        try:
            while (until is None or status.step < until) and (deadline is None or time.monotonic() < deadline):
                self.check_children()
                await self._check_refusals()
                await asyncio.sleep(self.poll_s)
                status = await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)
                if status.paused and (until is None or status.step < until):
                    # Paused short of the target: the trainer restarted (it starts paused under
                    # `arlo up`, maybe at an older checkpoint's step), or someone paused it.
                    # Driving the run means resuming it.
                    log.warning("trainer paused at step %d short of %s; resuming it", status.step, until)
                    await trainer.Resume(trainer_pb2.ResumeRequest(until_step=until or 0), timeout=10)
                self._until_step = status.until_step
                await self._read_steps()
                if status.step == last_step:
                    if time.monotonic() - last_progress > self.stall_s:
                        raise Stalled(f"no trainer step for {self.stall_s:.0f}s: {await self.holds.explain(status)}")
                    continue
                last_progress, last_step = time.monotonic(), status.step
                await self._collect_pending(wait=False)
        finally:
            await self._pause(trainer)
            try:
                await self._read_steps()  # the pause waited for the step in flight: its record is there
            except Exception as e:  # the stop path never raises on a dead service
                log.warning("could not read the last step records (%s)", e)
        return await trainer.GetStatus(trainer_pb2.GetStatusRequest(), timeout=10)  # final, after the pause

    async def _check_refusals(self) -> None:
        """Stops the drive (once a second at most, it reads Redis) when a rollout worker refused an
        episode the run's limits cannot hold: no step would ever come of it."""
        if time.monotonic() - self._refusals_checked >= 1.0:
            self._refusals_checked = time.monotonic()
            if why := await self.holds.refused(self._started_unix):
                raise EpisodesRefused(f"rollout refused an episode: {why}")

    async def _pause(self, trainer: ResilientStub) -> None:
        """The stop path: never raises on a dead or hung trainer (a restarted one comes up paused)."""
        try:
            await trainer.Pause(trainer_pb2.PauseRequest(), timeout=60,
                                policy=RetryPolicy(outage_s=min(self.retry.outage_s, 30.0),
                                                   call_timeout_s=self.retry.call_timeout_s))
        except (grpc.aio.AioRpcError, OSError) as e:
            log.warning("could not pause the trainer (%s); a restarted trainer starts paused", e)

    async def _read_steps(self) -> None:
        """Every step record the trainer wrote since the last read, in order (none skipped)."""
        every = self.cfg.rollout.eval.every_versions
        while records := await self.metrics.after(self._last_id):
            for entry_id, record in records:
                self._last_id = entry_id
                self._record_step(record)
                if every and record.get("phase") == "rl" and record["version"] % every == 0:
                    await self._request_eval(f"v{record['version']}", record["version"])

    def _record_step(self, record: dict[str, Any]) -> None:
        """One row per trainer step: the trainer's record plus throughput over the last seconds."""
        trajs_per_s, tokens_per_s = self._meter.rates(record["time"], record.get("consumed", 0),
                                                       record.get("tokens_trained", 0))
        rl = record.get("phase") == "rl"
        row = {**record, "reward": record.get("reward_mean") if rl else None,
               "staleness": record.get("staleness_mean") if rl else None,
               "trajectories_per_s": trajs_per_s, "tokens_per_s": tokens_per_s,
               "elapsed_s": time.monotonic() - self.started,
               "sft_steps": self._sft_steps, "until_step": self._until_step}
        self._last_step = record["step"]
        self.report.steps = record["step"] - self._first_step  # the final status confirms it at the end
        self.report.trainer_version = max(self.report.trainer_version, record["version"])
        self._version_step[record["version"]] = record["step"]  # SFT steps share one version: the last
        if rl:
            self.report.rewards.append(record.get("reward_mean", 0.0))
            self.report.add_rl_step(record)
        if self.recorder is not None:
            self.recorder.step(row)
        self.on_progress(row)

    # -- evaluations ----------------------------------------------------------------------

    async def _request_eval(self, tag: str, min_version: int) -> None:
        if self.evaluate and tag not in self._pending_evals and tag not in self.report.evals:
            self._pending_evals[tag] = (await self.evals.request(tag, min_version=min_version), min_version)

    async def _evaluate_now(self, tag: str, min_version: int) -> None:
        """Asks for an evaluation and waits for it: the trainer is paused, so it sees one version."""
        if not self.evaluate or tag not in self.eval_tags:
            return
        await self._request_eval(tag, min_version)
        self.on_progress({"evaluating": tag})
        deadline = time.monotonic() + self.eval_wait_s
        while tag in self._pending_evals:
            self.check_children()
            await self._check_refusals()
            if time.monotonic() > deadline:
                raise Stalled(f"evaluation {tag!r} got no answer; are rollout workers running?")
            await asyncio.sleep(self.poll_s)
            await self._collect_pending(wait=False)

    async def _collect_pending(self, *, wait: bool) -> None:
        deadline = time.monotonic() + (self.eval_wait_s if wait else 0)
        while self._pending_evals:
            for tag, (request_id, asked) in list(self._pending_evals.items()):
                result = await self.evals.result(request_id)
                if result is not None:
                    del self._pending_evals[tag]
                    self._store_eval(tag, {"requested_version": asked, **result})
            if not wait:
                return
            if time.monotonic() > deadline:
                for tag, (_, asked) in list(self._pending_evals.items()):
                    # Never dropped silently: a row with its reason, like a failed evaluation.
                    del self._pending_evals[tag]
                    self._store_eval(tag, {"requested_version": asked, "skipped": True,
                                           "error": f"no answer within {self.eval_wait_s:.0f}s"})
                return
            await asyncio.sleep(self.poll_s)

    def _eval_step(self, result: dict[str, Any]) -> int:
        """The step that published the newest version the evaluation's episodes used (else the
        version asked for): evaluations share the train scalars' step axis."""
        used = result.get("max_version") or result.get("requested_version") or 0
        steps = [s for v, s in self._version_step.items() if v <= used]
        return max(steps, default=self._last_step)

    def _store_eval(self, tag: str, result: dict[str, Any]) -> None:
        if "error" in result:
            log.warning("evaluation %r not done: %s", tag, result["error"])
        self.report.evals[tag] = result
        if self.recorder is not None:
            self.recorder.evaluation(tag, result, step=self._eval_step(result), time=time.time(),
                                     elapsed_s=time.monotonic() - self.started)
        self.on_progress({"evaluated": tag, **result})


async def run_training(cfg: RunConfig, token: str | None, *, steps: int | None, on_progress: ProgressFn,
                       check_children: Callable[[], object] = lambda: None, recorder: RunRecorder | None = None,
                       evaluate: bool = True, rl_seconds: float | None = None,
                       on_phase: Callable[[str], Awaitable[None]] | None = None,
                       eval_tags: tuple[str, ...] = ("start", "after_sft", "end"),
                       retry_policy: RetryPolicy = DEFAULT_RETRY, report: TrainReport | None = None) -> TrainReport:
    """Warm start (if configured), then `steps` RL steps (forever when None; at most `rl_seconds`
    of RL when given), evaluating on the way. `report`: filled in as the drive goes (`RunDriver`).
    `check_children` also runs every second on its own (`supervising`), whatever the drive waits on."""
    driver = RunDriver(cfg, token, on_progress=on_progress, check_children=check_children, recorder=recorder,
                       evaluate=evaluate, rl_seconds=rl_seconds, on_phase=on_phase, eval_tags=eval_tags,
                       retry_policy=retry_policy, report=report)
    return await supervising(driver.run(steps), check_children)


async def wait_fleet_on_pointer(cfg: RunConfig, token: str | None, timeout_s: float = 60.0,
                                policy: RetryPolicy | None = None) -> tuple[int, dict[str, int]]:
    """Waits until every inference replica serves the pointer's version; returns what each serves.
    With `policy`, Redis and inference outages are retried under it."""
    async def pointer_version() -> int:
        redis = await connect(cfg.redis)
        try:
            pointer = await WeightPointer(redis, cfg.run_id).get()
        finally:
            await redis.aclose()
        return pointer.version if pointer else 0

    def retried(fn: Callable[[], Awaitable[Any]], what: str) -> Awaitable[Any]:
        return fn() if policy is None else retry(fn, policy=policy, what=what, attempt_timeout_s=policy.call_timeout_s * 3)

    target = await retried(pointer_version, "weight pointer")
    deadline = time.monotonic() + timeout_s
    while True:
        versions = await retried(lambda: inference_versions(cfg, token), "inference GetModelInfo")
        if all(v >= target for v in versions.values()) or time.monotonic() > deadline:
            return target, versions
        await asyncio.sleep(0.2)


async def inference_versions(cfg: RunConfig, token: str | None) -> dict[str, int]:
    address = cfg.inference.server.address
    async with make_channel(address, token=token, tls=cfg.auth.tls) as channel:
        info = await inference_pb2_grpc.InferenceStub(channel).GetModelInfo(
            inference_pb2.GetModelInfoRequest(), timeout=5)
    return {address: info.policy_version}
