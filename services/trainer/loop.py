"""The training loop: stream -> whole groups -> jitted step -> publish version v+1 -> ack.

Which groups a step takes is services/trainer/intake.py's job (whole, fresh, oldest first).
What may be acknowledged when is services/trainer/durability.py's job (only what a durable
state covers); where a failed step's groups go is services/trainer/failures.py's (back to
the front, or dead-lettered after `STEP_ATTEMPTS` tries: never dropped, never acknowledged
untrained). While the jitted step runs, the loop reads the next batch (reader.py) and
finishes the previous step's tail (tail.py). A publish that fails after the update applied is
retried before the next step; a publish refused because the pointer holds a version this trainer did not write
(a hijacked or foreign pointer) is reported and re-numbered above it, as a restart does.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from arlo.coord import TrajectoryStream, WeightPointer
from arlo.model.tokenizer import ByteTokenizer
from arlo.model.weights import NonFiniteWeights, ServingCopy
from services.trainer.anatomy import StepClock, StepMarks, step_anatomy, step_timing
from services.trainer.batching import Batch, build_batch
from services.trainer.checkpoint import Checkpointer
from services.trainer.core.groups import ReadyGroup
from services.trainer.diagnostics import staleness_stats, step_record
from services.trainer.durability import Durability
from services.trainer.failures import StepFailures
from services.trainer.intake import Intake
from services.trainer.learner import Learner, StepMetrics
from services.trainer.lockstep import SINGLE, Channel, Replica
from services.trainer.publish import VersionStore
from services.trainer.publisher import Publisher
from services.trainer.reader import READ_COUNT, StreamReader
from services.trainer.state import TrainedStep, TrainerState
from services.trainer.tail import StepTails
from services.trainer.warmstart import WarmStart

log = logging.getLogger(__name__)

CLAIM_EVERY_S = 10.0
CLAIM_MIN_IDLE_MS = 30_000
CLOSE_WAIT_S = 60.0

__all__ = ["TrainedStep", "TrainerState", "TrainingLoop"]


OnStep = Callable[[dict[str, Any]], Awaitable[None]]
"""Called with each applied step's diagnostics record (services/trainer/diagnostics.py)."""


class TrainingLoop:
    def __init__(
        self, *, learner: Learner, stream: TrajectoryStream, pointer: WeightPointer, store: VersionStore,
        source: str, groups_per_step: int, max_staleness: int, read_block_ms: int,
        checkpoint_dir: str = "", checkpoint_every: int = 0, pad_id: int = ByteTokenizer.pad_id,
        filter_zero_variance: bool = False, overlong: tuple[int, int] | None = None, channel: Channel = SINGLE,
        warm_start: WarmStart | None = None, start_paused: bool = False, on_step: Sequence[OnStep] = (),
        before_run: Callable[[], Awaitable[None]] | None = None, longest_episode: int = 0,
        expiring_wait_s: float = 0.0,
    ) -> None:
        """`before_run`: awaited once when `run` starts, before any step (the start-up warm-up: it
        compiles while the rest of the fleet comes up, and the first step finds its programs).
        `longest_episode`: rollout.max_episode_tokens, the longest batch length a step needs.
        `expiring_wait_s`: trainer.expiring_wait_s (expiring.py)."""
        self.longest_episode = longest_episode
        self.before_run = before_run
        self.on_step = list(on_step)
        self.max_staleness = max_staleness
        self.warm_start = warm_start
        if checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self.overlong = overlong
        self.learner = learner
        self.stream = stream
        self.pointer = pointer
        self.store = store
        self.read_block_ms = read_block_ms
        self.checkpoint_every = checkpoint_every
        self.checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
        # Every JAX call goes through the replica: with several processes it tells the others first.
        self.replica = Replica(learner, self.checkpointer, channel)
        self.pad_id = pad_id
        self.state = TrainerState(paused=start_paused)
        self.clock = StepClock()  # where each RL step's time goes (services/trainer/anatomy.py)
        self._reader = StreamReader(stream, block_ms=read_block_ms)
        self._intake_error: Exception | None = None  # an intake during a step failed: the loop restarts
        self._tails = StepTails()  # steps' records and acks, run beside the next step (tail.py)
        self._failures = StepFailures(stream, self.state)
        self._jax_lock = asyncio.Lock()
        self.durable = Durability(replica=self.replica, checkpointer=self.checkpointer, stream=stream,
                                  pointer=pointer, store=store, state=self.state, jax_lock=self._jax_lock,
                                  every=checkpoint_every, max_held=max(stream.max_backlog // 2, 1))
        self._step_lock = asyncio.Lock()  # held from batch to publish and ack: one whole step
        self.publisher = Publisher(store=store, pointer=pointer, replica=self.replica, state=self.state,
                                   durable=self.durable, tails=self._tails, jax_lock=self._jax_lock, source=source)
        self.intake = Intake(stream=stream, groups_per_step=groups_per_step, max_staleness=max_staleness,
                             vocab_size=learner.model_cfg.vocab_size, filter_zero_variance=filter_zero_variance,
                             expiring_wait_s=expiring_wait_s, held_elsewhere=self.durable.held)

    async def start(self) -> None:
        """Resumes from the newest complete checkpoint and numbers versions above the pointer,
        so a restarted trainer never repeats one (even though its checkpoint is older)."""
        await self.stream.ensure_group()
        restored = await self.durable.restore()
        current = await self.pointer.get()
        newest_on_disk = self.checkpointer.newest_version() if self.checkpointer else 0
        base = max(current.version if current else 0, restored, newest_on_disk)
        if base > 0:
            # The fleet may hold another trainer's weights under that version: publish ours above it.
            self.state.version = base + 1
            await self.publisher.publish()

    @property
    def source(self) -> str:
        """Where the fleet pulls the weights from (the pointer's `source`); set once the server's port is known."""
        return self.publisher.source

    @source.setter
    def source(self, source: str) -> None:
        self.publisher.source = source

    @property
    def jax_lock(self) -> asyncio.Lock:
        """Held around every JAX call the loop makes (steps, publishes, checkpoints)."""
        return self._jax_lock

    @property
    def sft_steps(self) -> int:
        return self.warm_start.steps if self.warm_start else 0

    @property
    def phase(self) -> str:
        return "sft" if self.learner.step_count < self.sft_steps else "rl"

    def resume(self, until_step: int = 0) -> bool:
        """Unpauses (until `until_step` when > 0); returns whether the trainer is now paused."""
        self.state.until_step = until_step
        self.state.paused = bool(until_step) and self.learner.step_count >= until_step
        return self.state.paused

    async def run(self) -> None:
        if self.before_run is not None:
            before, self.before_run = self.before_run, None  # once, even if the loop restarts
            await before()
        while self.phase == "sft":
            if self.state.paused:
                await asyncio.sleep(0.2)
                continue
            await self.sft_once()
        await self._reread_pending()
        try:
            await self._run_rl()
        finally:
            await self._reader.close()  # what it was delivered, the next run re-reads first
            await self._tails.settle(CLOSE_WAIT_S)  # one chain of tails at a time, across restarts

    async def _run_rl(self) -> None:
        last_claim = 0.0  # a dead consumer of another name may have left entries: claim at once
        while True:
            if self.state.paused:
                await asyncio.sleep(0.2)
                continue
            # A read that finds data at once counts as platform time; one that has to wait for
            # data is idle time (only its intake afterwards counts). A read started during the
            # previous step (reader.py) counts from when it returned or from now, the later.
            started = time.perf_counter()
            read = await self._reader.read(block=False)
            if read.background:
                started = max(started, read.returned_at)
            if not read.entries:
                read = await self._reader.read(block=True)
                started = read.returned_at
            entries = list(read.entries)
            read_at = time.time()
            if time.monotonic() - last_claim > CLAIM_EVERY_S:
                entries += await self.stream.claim_stale(CLAIM_MIN_IDLE_MS)
                last_claim = time.monotonic()
            if entries:
                await self.intake.admit(entries, version=self.state.version, read_at=read_at)
                intake = time.perf_counter() - started
                self.state.io_s += intake
                self.clock.add_intake(intake)
            await self._catch_up()
            await self._train_ready(overlap=True)
            self._raise_background_error()

    def _background_failed(self) -> bool:
        return self._intake_error is not None or self._tails.error is not None

    def _raise_background_error(self) -> None:
        """An intake during a step or a deferred tail failed: the loop restarts. Entries that lost
        their hold are in this consumer's pending list, and the restarted loop re-reads them first
        (`_reread_pending`); acknowledgements left undone go with the next publish or checkpoint."""
        intake, self._intake_error = self._intake_error, None
        tail = self._tails.take_error()
        if intake is not None or tail is not None:
            raise intake or tail  # type: ignore[misc]

    async def pause(self) -> None:
        """Returns once no step is in flight, so a status read after it is final."""
        self.state.paused = True
        async with self._step_lock:
            await self._tails.settle()

    async def train_once(self, *, overlap: bool = False) -> StepMetrics:
        """One RL step from the ready groups. `overlap` (the run loop's own steps): read and group
        the stream's new entries while the step trains (reader.py), and leave this step's tail to
        run beside the next one (tail.py)."""
        async with self._step_lock:
            metrics = await self._train_once(overlap=overlap)
            self._pause_if_due()
            return metrics

    async def sft_once(self) -> StepMetrics:
        """One warm-start step; the version is published once, when the warm start is done
        (publishing each SFT step would make the fleet pull weights nobody samples from)."""
        assert self.warm_start is not None
        async with self._step_lock:
            batch = await asyncio.to_thread(self.warm_start.next_batch)
            started = time.perf_counter()
            async with self._jax_lock:
                metrics = await asyncio.to_thread(self.replica.sft_step, batch)
            self.state.busy_s += time.perf_counter() - started
            if metrics.skipped:  # weights unchanged; the warm start's next batch follows
                self.state.skipped_steps += 1
                log.error("SFT step skipped: loss %s, grad norm %s", metrics.loss, metrics.grad_norm)
                return metrics
            self.state.last = metrics
            self.state.tokens_trained += batch.num_tokens
            await self._report(step_record(phase="sft", step=self.learner.step_count, version=self.state.version,
                                           metrics=metrics, counters=await self._counters()))
            if self.phase == "rl":
                if self.learner.cfg.algorithm.reference == "after_sft":
                    async with self._jax_lock:  # the KL reference is the warm-started policy
                        await asyncio.to_thread(self.replica.set_reference)
                self.state.version += 1
                await self.publisher.publish()
                log.info("warm start done: %d SFT steps -> version %d, loss %.4f", self.learner.step_count,
                         self.state.version, metrics.loss)
            self._pause_if_due()
            return metrics

    def _pause_due(self) -> bool:
        return bool(self.state.until_step) and self.learner.step_count >= self.state.until_step

    def _pause_if_due(self) -> None:
        if self._pause_due():
            self.state.paused = True

    async def checkpoint(self) -> tuple[int, str]:
        """Writes a checkpoint of the current version; returns (version, uri) once it is complete."""
        async with self._step_lock:
            await self._tails.settle()  # the current version's overlapped publish (a save needs it stored)
            if self.publisher.due:  # it failed or met a foreign pointer: published (re-numbered) first
                await self.publisher.publish_owed()
            job = await self.durable.begin()
        return await asyncio.shield(job)  # a caller's deadline must not abandon the write

    async def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Lets a step's tail and a checkpoint in flight complete (bounded), so a clean stop leaves
        no partial checkpoint and every acknowledgement it could make."""
        await self._tails.settle(timeout_s)
        await self.durable.close(timeout_s)
        async with self._jax_lock:
            self.replica.stop()  # other processes: finish your checkpoint writes and return
        if self.checkpointer is not None:
            if self.durable.saving:  # its save may still be in orbax's hands, on a worker thread
                log.warning("a checkpoint save is still running after %.0f s; leaving its manager open", timeout_s)
                return
            await asyncio.to_thread(self.checkpointer.close)

    def dropped(self) -> dict[str, int]:
        """Trajectories not trained on, by reason."""
        intake = self.intake
        drops, dead = intake.assembler.drops, intake.dead_lettered
        return {"stale": drops.stale, "failed": drops.failed, "malformed": dead.malformed + self.stream.malformed,
                "duplicate": self.stream.duplicates + intake.repeats, "zero_variance": intake.zero_variance,
                "poisoned": dead.poisoned, "nonfinite_step": self._failures.nonfinite,
                "step_error": self._failures.step_errors}

    def fault_counters(self) -> dict[str, int | str]:
        """Faults survived, for the heartbeat (`arlo status`)."""
        s = self.state
        return {"skipped_steps": s.skipped_steps, "failed_steps": s.failed_steps,
                "publish_failures": s.publish_failures, "pointer_conflicts": s.pointer_conflicts,
                "checkpoint_failures": s.checkpoint_failures, "checkpoint_error": s.checkpoint_error,
                "held_entries": s.held_entries, "acked_undurable": s.acked_undurable,
                "checkpoint_fallbacks": s.checkpoint_fallbacks}

    # -- intake -----------------------------------------------------------------------------

    async def _reread_pending(self) -> None:
        """Entries this consumer was given but never acknowledged (a previous process died) come first."""
        after: str | None = "0-0"
        total = 0
        while after is not None:
            entries, after = await self.stream.read_own_pending(READ_COUNT, after)
            total += len(entries)
            await self.intake.admit(entries, version=self.state.version)
            await self._train_ready()
        if total:
            log.info("re-read %d unacknowledged trajectory entries", total, extra={"pending_entries": total})

    # -- steps ------------------------------------------------------------------------------

    async def _train_ready(self, *, overlap: bool = False) -> None:
        while not self.state.paused and not self._background_failed():
            await self.intake.drop_stale(self.state.version)
            if not self.intake.batch_full() or await self.intake.waiting_for_expiring(self.state.version):
                return
            await self.train_once(overlap=overlap)

    async def _catch_up(self) -> None:
        """Work owed whether or not data arrives: a failed publish, a failed checkpoint's retry."""
        if not self.publisher.due and not self.durable.retry_due():
            return
        async with self._step_lock:
            await self._tails.settle()  # a checkpoint saves the published current version
            if self.publisher.due:
                await self.publisher.publish_owed()
            if self.durable.retry_due():
                await self.durable.try_checkpoint()

    def _counters_now(self) -> dict[str, Any]:
        """The loop's cumulative figures, for a step record (the stream's backlog aside)."""
        return {"tokens_trained": self.state.tokens_trained, "generated_tokens": self.state.generated_tokens,
                "consumed": self.state.consumed, "skipped_steps": self.state.skipped_steps,
                "ready_groups": len(self.intake.ready), "dropped": self.dropped(),
                "expiring_waits": self.intake.expiring.waits, "expiring_timeouts": self.intake.expiring.timeouts}

    async def _counters(self) -> dict[str, Any]:
        return {**self._counters_now(), "queue_depth": await self.stream.backlog()}

    async def _report(self, record: dict[str, Any]) -> None:
        """Hands the record on; a failing consumer (Redis down) costs the record, never the step."""
        self.state.last_record = record
        for consumer in self.on_step:
            try:
                await consumer(record)
            except Exception:
                log.exception("step %s: diagnostics not exported", record.get("step"))

    async def _train_once(self, *, overlap: bool = False) -> StepMetrics:
        if self.publisher.due:
            await self.publisher.publish_owed()  # raises while it keeps failing: no step past an unpublished one
        groups = self.intake.take_batch()
        try:
            return await self._train_groups(groups, overlap=overlap)
        finally:
            self.intake.in_step = []

    async def _jitted_step(self, batch: Batch) -> tuple[StepMetrics, float]:
        """The update, on a worker thread; returns its metrics and when it finished (Unix seconds)."""
        started = time.perf_counter()
        async with self._jax_lock:
            metrics = await asyncio.to_thread(self.replica.step, batch)
        self.state.busy_s += time.perf_counter() - started
        return metrics, time.time()

    async def _intake_during(self, step: asyncio.Task[Any]) -> None:
        """Reads and groups new entries while `step` trains, until the next batch is ready."""
        while not step.done() and not self.intake.batch_full() and not self.state.paused:
            read = self._reader.background()
            await asyncio.wait({step, read}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                return  # the step finished first: the loop's next read takes this one's reply
            try:
                entries = self._reader.take().entries
                if entries:
                    started = time.perf_counter()
                    await self.intake.admit(entries, version=self.state.version, read_at=time.time())
                    self.clock.add_overlapped_intake(time.perf_counter() - started)
            except Exception as e:  # the step in flight must still publish: the loop raises it after
                log.exception("intake during step %d failed; the loop restarts after the step", self.learner.step_count)
                self._intake_error = e
                return

    async def _train_groups(self, groups: list[ReadyGroup], *, overlap: bool) -> StepMetrics:
        batch_at = time.time()
        try:
            batch = build_batch([g.trajectories for g in groups], self.learner.model_cfg.max_seq_len, self.pad_id,
                                overlong=self.overlong, longest_episode=self.longest_episode)
            train_at = time.time()
            step = asyncio.create_task(self._jitted_step(batch), name="trainer-step")
            if overlap:
                await self._intake_during(step)
            metrics, trained_at = await step
        except Exception as e:
            await self._failures.failed(groups, e, put_back=self.intake.put_back)
            raise
        self._failures.trained(groups)
        if metrics.skipped:
            await self._failures.refuse(groups, f"step skipped: loss {metrics.loss}, grad norm {metrics.grad_norm}")
            return metrics
        self.state.version += 1
        started = time.perf_counter()
        # The previous step's tail (its overlapped publish first) ends before this step publishes:
        # versions reach the pointer in order, and one copy of the weights is held, not one per
        # step ahead of a slow publish (a hung Redis, a hash slower than a step, would let
        # training run ahead of the pointer). Normally it ended while this step trained.
        await self._tails.settle()
        cut, published = None, False
        try:
            if overlap and self._publish_may_overlap(self.state.version):
                cut = await self.publisher.cut()
            published = cut is None and await self.publisher.publish_or_owe()
        except NonFiniteWeights as e:
            self.state.version -= 1  # nothing was published under it
            await self._failures.refuse(groups, f"not published: {e}")
            return metrics
        cut_at = time.time()
        marks = StepMarks(read_at=0.0, ready_at=0.0, batch_at=batch_at, train_at=train_at, trained_at=trained_at,
                          cut_at=cut_at, published_at=cut_at if published else 0.0)
        await self._finish_step(groups, batch, metrics, marks, published=published, cut=cut, defer_tail=overlap)
        self.state.io_s += time.perf_counter() - started
        self.clock.tail_done()
        return metrics

    async def _finish_step(self, groups: Sequence[ReadyGroup], batch: Batch, metrics: StepMetrics, marks: StepMarks, *,
                           published: bool, cut: ServingCopy | None = None, defer_tail: bool = False) -> None:
        """A published (or publish-pending, or `cut`: to be published first thing in its tail)
        step: counters and hold now; its record, log line and acks in its tail, which
        `defer_tail` runs beside the next step (tail.py)."""
        self.state.consumed += len(batch.trajectory_ids)
        self.state.last = metrics
        self.state.tokens_trained += batch.num_tokens
        trajs = [t for g in groups for t in g.trajectories]
        self.state.generated_tokens += sum(sum(t.loss_mask) for t in trajs)
        self.state.last_staleness, self.state.last_staleness_max = staleness_stats(trajs, self.state.version - 1)
        last = max(groups, key=lambda g: g.ready_at)
        marks = dataclasses.replace(marks, read_at=last.read_at, ready_at=last.ready_at)
        read_at = [g.read_at for g in groups for _ in g.entry_ids]
        entry_ids = tuple(e for g in groups for e in g.entry_ids)
        record = dict(phase="rl", step=self.learner.step_count, version=self.state.version, metrics=metrics,
                      trajectories=trajs, trained_from=self.state.version - 1,
                      timing=step_timing(self.clock, marks, trajs, read_at, entry_ids),
                      anatomy=step_anatomy(self.clock, marks, trajs, read_at, entry_ids), now=time.time())
        self.clock.step_done(marks.cut_at)
        step = TrainedStep(version=self.state.version, entry_ids=entry_ids, trajectory_ids=batch.trajectory_ids)
        self.durable.hold(step)  # from here a producer's retry of these trajectories is a repeat
        counters = self._counters_now()  # as of this step, whenever its tail runs
        if defer_tail and not self.durable.acknowledges_before_next_step(step.version) and not self._pause_due():
            self._tails.defer(self._step_tail(record, counters, step, published=published, cut=cut),
                              on_done=self.clock.add_overlapped_tail)
        else:
            await self._tails.settle()  # records and acks stay in step order
            # Made only now: a coroutine made before a settle that is cancelled would never run.
            await self._step_tail(record, counters, step, published=published, cut=cut)

    async def _step_tail(self, record: dict[str, Any], counters: dict[str, Any], step: TrainedStep, *,
                         published: bool, cut: ServingCopy | None = None) -> None:
        if cut is not None:
            published = await self.publisher.publish_cut(cut, step.version, record)
            del cut  # the device copy goes now, not when the tail ends
        counters = {**counters, "queue_depth": await self.stream.backlog()}
        await self._report(step_record(**record, counters=counters))
        # The ids make each version's data lineage auditable (and let tests prove exactly-once).
        metrics = record["metrics"]
        log.info("step %d -> version %d: loss %.4f reward %.3f tokens %d", record["step"], step.version,
                 metrics.loss, metrics.reward_mean, metrics.num_tokens,
                 extra={"step": record["step"], "version": step.version, "trajectory_ids": list(step.trajectory_ids)})
        await self.durable.acknowledge(step, published=published)
        # Off the step's path: keeps the in-flight set to the groups a batch may still take.
        await self.intake.settle_in_flight(step.version - self.max_staleness)

    # -- publishing (publisher.py) --------------------------------------------------------

    def _publish_may_overlap(self, version: int) -> bool:
        """Whether `version`'s publish may run beside the next step: not when its tail may not
        (a checkpoint due, saves failing, a pause due: `_finish_step`) nor while a publish is owed."""
        return not (self.publisher.due or self.durable.acknowledges_before_next_step(version) or self._pause_due())
