"""The trainer's driver: the only place the trainer's overlap lives. What to do is the core's
(services/trainer/core/); this performs it, through stream_side.py (the one module that calls
the trajectory stream), the replica (lockstep.py), the publisher and the saves.

One trajectory goes one way: read (stream_side.py) -> the core (screen, admit: core/book.py) -> a
batch -> the jitted step (lockstep.py `Replica`) -> publish (publisher.py) -> held until durable
(core/holds.py) -> acknowledged. Overlap, and its backpressure, in three places:
- while the jitted step runs on a worker thread, the next batch's entries are read and admitted
  (`_intake_during`): at most one read in flight, and it stops once a batch is ready;
- a step's tail (its overlapped publish, record, log line and acknowledgements) runs beside the
  next step (tail.py): one tail at a time, in step order, and a step publishes only after the
  previous tail ended, so at most one step trains past an unpublished version;
- a checkpoint save is written beside the next steps (saves.py): one at a time; the
  next one due waits for it.
A tail is not deferred when its step starts a checkpoint, pauses the loop or comes while saves
fail (a checkpoint copies the arrays the next step donates; a pause promises a final status).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from arlo.background import MustRestart
from arlo.config.trainer import WeightPublishConfig
from arlo.coord import TrajectoryStream, WeightPointer
from arlo.coord.lease import TrainerLease
from arlo.model.tokenizer import ByteTokenizer
from arlo.model.weights import NonFiniteWeights, ServingCopy
from arlo.routing_replay import routing_shape
from services.trainer.anatomy import StepClock, StepMarks, step_anatomy, step_timing
from services.trainer.batching import Batch, build_batch
from services.trainer.checkpoint import Checkpointer
from services.trainer.core.groups import ReadyGroup
from services.trainer.core.records import TrainedStep, Wait
from services.trainer.core.trainer import CoreConfig, TrainerCore
from services.trainer.diagnostics import step_record
from services.trainer.learner import Learner, StepMetrics
from services.trainer.lockstep import SINGLE, Channel, Replica
from services.trainer.publish import VersionStore
from services.trainer.publisher import Publisher
from services.trainer.saves import Saves
from services.trainer.stream_side import StreamSide
from services.trainer.tail import StepTails
from services.trainer.warmstart import WarmStart

log = logging.getLogger(__name__)

CLAIM_EVERY_S = 10.0
CLAIM_MIN_IDLE_MS = 30_000
CLOSE_WAIT_S = 60.0

OnStep = Callable[[dict[str, Any]], Awaitable[None]]
"""Called with each applied step's diagnostics record (services/trainer/diagnostics.py)."""


class TrainingLoop:
    def __init__(
        self, *, learner: Learner, stream: TrajectoryStream, pointer: WeightPointer, store: VersionStore,
        source: str, core: CoreConfig, read_block_ms: int, checkpoint_dir: str = "",
        pad_id: int = ByteTokenizer.pad_id, overlong: tuple[int, int] | None = None, channel: Channel = SINGLE,
        warm_start: WarmStart | None = None, on_step: Sequence[OnStep] = (),
        before_run: Callable[[], Awaitable[None]] | None = None, longest_episode: int = 0,
        weights: WeightPublishConfig | None = None, lease: TrainerLease | None = None,
    ) -> None:
        """`before_run`: awaited once when `run` starts, before any step (the start-up warm-up).
        `longest_episode`: rollout.max_episode_tokens, the longest batch length a step needs.
        `weights`: how versions go out (trainer.weights: deltas, shared storage).
        `lease`: the run's one-trainer lease (arlo/coord/lease.py), held (taken before the model
        is built) and given back by `close`; the stream and pointer carry its fence."""
        if core.checkpoint_every and not checkpoint_dir:
            raise ValueError("checkpoint_every needs checkpoint_dir")
        self.core = TrainerCore(dataclasses.replace(core, checkpoints=bool(checkpoint_dir)))
        self.state = self.core.state  # read-only here: the core writes it
        self.learner, self.stream, self.pointer, self.store, self.lease = learner, stream, pointer, store, lease
        self.warm_start, self.on_step, self.before_run = warm_start, list(on_step), before_run
        self.longest_episode, self.overlong, self.pad_id = longest_episode, overlong, pad_id
        self.checkpointer = Checkpointer(checkpoint_dir) if checkpoint_dir else None
        # Every JAX call goes through the replica: with several processes it tells the others first.
        self.replica = Replica(learner, self.checkpointer, channel)
        self.clock = StepClock()  # where each RL step's time goes (services/trainer/anatomy.py)
        self._jax_lock = asyncio.Lock()
        self._step_lock = asyncio.Lock()  # held from batch to publish and ack: one whole step
        self.intake = StreamSide(stream, self.core, block_ms=read_block_ms,
                                 start_checkpoint=lambda why: self._checkpoints().try_start(why))
        self._tails = StepTails()
        self._intake_error: Exception | None = None  # an intake during a step failed: the loop restarts
        self.saves = Saves(replica=self.replica, checkpointer=self.checkpointer, jax_lock=self._jax_lock,
                           core=self.core, learner=learner, store=store, pointer=pointer,
                           perform=self.intake.perform) if self.checkpointer else None
        self.publisher = Publisher(store=store, pointer=pointer, replica=self.replica, jax_lock=self._jax_lock,
                                   source=source, core=self.core, tails=self._tails, perform=self.intake.perform,
                                   weights=weights)

    # -- start and stop -----------------------------------------------------------------------

    async def start(self) -> None:
        """Resumes from the newest complete checkpoint and numbers versions above the pointer,
        so a restarted trainer never repeats one (even though its checkpoint is older)."""
        await self.intake.ensure_group()
        restored = await self._restore()
        current = await self.pointer.get()
        version = self.core.started(restored=restored, pointer=current.version if current else 0,
                                    on_disk=self.checkpointer.newest_version() if self.checkpointer else 0,
                                    step_count=self.learner.step_count)
        if version:  # the fleet may hold another trainer's weights under that number: ours above it
            await self.publisher.publish()

    async def _restore(self) -> int:
        if self.saves is None:
            log.warning("CHECKPOINTS ARE OFF (trainer.checkpoint_dir is empty): nothing the trainer learns is "
                        "durable; a restart begins again from the initial weights while every trajectory "
                        "trained before stays acknowledged", extra={"checkpoints": False})
            return 0
        restored = await self.saves.restore(self.lease.token if self.lease is not None else "")
        if restored is None:
            return 0
        meta = restored.meta
        if restored.set_aside:
            log.error("set aside %d newer checkpoint(s) another trainer wrote after it lost the run: %s",
                      len(restored.set_aside), "; ".join(restored.set_aside),
                      extra={"checkpoints_set_aside": len(restored.set_aside)})
        if restored.skipped:
            self.core.restored_past(len(restored.skipped))
            log.error("fell back to checkpoint %s past %d damaged newer one(s): %s; trajectories acknowledged "
                      "after it are not in the restored weights", restored.uri, len(restored.skipped),
                      "; ".join(restored.skipped), extra={"checkpoint_fallbacks": len(restored.skipped)})
        self.core.holds.checkpointed(meta.version, restored.uri)
        # The process may have died between the checkpoint completing and these two writes.
        await self.pointer.set_checkpoint(meta.version, restored.uri)
        await self.intake.restored(meta.trajectory_ids)
        log.info("resumed from checkpoint %s: step %d, version %d", restored.uri, meta.step, meta.version,
                 extra={"step": meta.step, "version": meta.version, "checkpoint_uri": restored.uri})
        return meta.version

    async def close(self, timeout_s: float = CLOSE_WAIT_S) -> None:
        """Lets a step's tail and a checkpoint in flight complete (bounded), so a clean stop leaves
        no partial checkpoint and every acknowledgement it could make."""
        await self._tails.settle(timeout_s)
        if self.saves is not None and self.saves.job is not None:
            await asyncio.wait([self.saves.job], timeout=timeout_s)
        async with self._jax_lock:
            self.replica.stop()  # other processes: finish your checkpoint writes and return
        if self.checkpointer is not None:
            if self.saving:  # its save may still be in orbax's hands, on a worker thread
                log.warning("a checkpoint save is still running after %.0f s; leaving its manager open", timeout_s)
                return
            await asyncio.to_thread(self.checkpointer.close)
        if self.lease is not None:  # last: nothing of this trainer writes after it (the next one starts at once)
            try:
                await self.lease.release()
            except Exception:  # Redis down: the lease expires on its own
                log.warning("could not give the trainer lease back; it expires in %.0f s", self.lease.ttl_s)

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

    def _checkpoints(self) -> Saves:
        if self.saves is None:
            raise ValueError("trainer.checkpoint_dir is not set; checkpoints are disabled")
        return self.saves

    @property
    def saving(self) -> bool:
        """A checkpoint save is in flight."""
        return self.saves is not None and self.saves.saving

    # -- control (the gRPC servicer's) ----------------------------------------------------------

    def resume(self, until_step: int = 0) -> bool:
        """Unpauses (until `until_step` when > 0); returns whether the trainer is now paused."""
        return self.core.resume(until_step, self.learner.step_count)

    async def pause(self) -> None:
        """Returns once no step is in flight, so a status read after it is final."""
        self.core.pause()
        async with self._step_lock:
            await self._tails.settle()

    async def checkpoint(self) -> tuple[int, str]:
        """Writes a checkpoint of the current version; returns (version, uri) once it is complete."""
        async with self._step_lock:
            await self._tails.settle()  # the current version's overlapped publish (a save needs it stored)
            if self.core.owes_publish:  # it failed or met a foreign pointer: published (re-numbered) first
                await self.publisher.publish_owed()
            job = await self._checkpoints().begin("requested")
        return await asyncio.shield(job)  # a caller's deadline must not abandon the write

    def dropped(self) -> dict[str, int]:
        """Trajectories not trained on, by reason."""
        return self.core.dropped(**self.intake.decode_drops())

    def fault_counters(self) -> dict[str, int | str]:
        """Faults survived, for the heartbeat (`arlo status`)."""
        s = self.state
        return {"skipped_steps": s.skipped_steps, "failed_steps": s.failed_steps,
                "publish_failures": s.publish_failures, "pointer_conflicts": s.pointer_conflicts,
                "checkpoint_failures": s.checkpoint_failures, "checkpoint_error": s.checkpoint_error,
                "held_entries": s.held_entries, "acked_undurable": s.acked_undurable,
                "checkpoint_fallbacks": s.checkpoint_fallbacks, "waiting_on": s.waiting_on}

    # -- the run ------------------------------------------------------------------------------

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
            await self.intake.reader.close()  # what it was delivered, the next run re-reads first
            await self._tails.settle(CLOSE_WAIT_S)  # one chain of tails at a time, across restarts

    async def _run_rl(self) -> None:
        last_claim = 0.0  # a dead consumer of another name may have left entries: claim at once
        while True:
            if self.state.paused:
                await asyncio.sleep(0.2)
                continue
            # A read that finds data at once counts as platform time; one that has to wait for
            # data is idle time (only its intake afterwards counts). A read started during the
            # previous step counts from when it returned or from now, the later.
            started = time.perf_counter()
            read = await self.intake.reader.read(block=False)
            if read.background:
                started = max(started, read.returned_at)
            if not read.entries:
                read = await self.intake.reader.read(block=True)
                started = read.returned_at
            entries = list(read.entries)
            read_at = time.time()
            if time.monotonic() - last_claim > CLAIM_EVERY_S:
                entries += await self.intake.claim_stale(CLAIM_MIN_IDLE_MS)
                last_claim = time.monotonic()
            if entries:
                await self._admit(entries, read_at=read_at)
                intake = time.perf_counter() - started
                self.core.add_time(io_s=intake)
                self.clock.add_intake(intake)
            await self._catch_up()
            await self._train_ready(overlap=True)
            self._raise_background_error()

    def _raise_background_error(self) -> None:
        """An intake during a step or a deferred tail failed: the loop restarts. Entries that lost
        their hold are in this consumer's pending list, and the restarted loop re-reads them first
        (`_reread_pending`); acknowledgements left undone go with the next publish or checkpoint."""
        self._raise_if_damaged()
        intake, self._intake_error = self._intake_error, None
        tail = self._tails.take_error()
        if isinstance(tail, MustRestart):  # before an intake error, which would only restart the loop in place
            raise tail
        if intake is not None or tail is not None:
            raise intake or tail  # type: ignore[misc]

    async def _reread_pending(self) -> None:
        """Entries this consumer was given but never acknowledged (a previous process died) come first."""
        after: str | None = "0-0"
        total = 0
        while after is not None:
            entries, after = await self.intake.own_pending(after)
            total += len(entries)
            await self._admit(entries)
            await self._train_ready()
        if total:
            log.info("re-read %d unacknowledged trajectory entries", total, extra={"pending_entries": total})

    async def _admit(self, entries: Sequence[Any], *, read_at: float = 0.0) -> None:
        await self.intake.admit(entries, version=self.state.version, read_at=read_at)

    async def _next_batch(self) -> list[ReadyGroup] | Wait:
        await self.intake.perform(self.core.book.drop_stale(self.state.version))
        book = self.core.book
        choice = book.next_batch(self.state.version, time.monotonic())
        if isinstance(choice, Wait) and choice.in_flight_floor is not None:
            timeouts, floor = book.expiring.timeouts, choice.in_flight_floor
            in_flight = await self.intake.settle_in_flight(floor)
            choice = book.next_batch(self.state.version, time.monotonic(), in_flight if in_flight is not None else set())
            if book.expiring.timeouts > timeouts:
                log.warning("group(s) of version %d still in flight after %.1f s (trainer.expiring_wait_s): the "
                            "step goes ahead, and they will be dropped as stale", floor,
                            book.expiring.bound_s, extra={"expiring_timeouts": book.expiring.timeouts})
        if isinstance(choice, Wait):
            self.core.waiting(choice.why)
        return choice

    async def _train_ready(self, *, overlap: bool = False) -> None:
        while not self.state.paused and not self._background_failed():
            async with self._step_lock:
                if self.core.owes_publish:
                    await self.publisher.publish_owed()  # raises while it keeps failing: no step past an unpublished one
                groups = await self._next_batch()
                if isinstance(groups, Wait):
                    return
                await self._train_groups(groups, overlap=overlap)
                self.core.pause_if_due(self.learner.step_count)

    def _background_failed(self) -> bool:
        return self._intake_error is not None or self._tails.error is not None

    async def _catch_up(self) -> None:
        """Work owed whether or not data arrives: a failed publish, a failed checkpoint's retry,
        a save the hold bound asks for."""
        if not self.core.owes_publish and not self._save_owed():
            return
        async with self._step_lock:
            await self._tails.settle()  # a checkpoint saves the published current version
            if self.core.owes_publish:
                await self.publisher.publish_owed()
            if self._save_owed():
                await self._checkpoints().try_start("owed")

    def _save_owed(self) -> bool:
        return self.core.holds.owed(time.monotonic(), save_in_flight=self.saving)

    # -- steps ----------------------------------------------------------------------------------

    async def train_once(self, *, overlap: bool = False) -> StepMetrics | None:
        """One RL step from the ready groups (None: no batch is ready)."""
        async with self._step_lock:
            if self.core.owes_publish:
                await self.publisher.publish_owed()
            groups = await self._next_batch()
            if isinstance(groups, Wait):
                return None
            metrics = await self._train_groups(groups, overlap=overlap)
            self.core.pause_if_due(self.learner.step_count)
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
            self.core.add_time(busy_s=time.perf_counter() - started)
            if metrics.skipped:  # weights unchanged; the warm start's next batch follows
                self.core.refused()
                log.error("SFT step skipped: loss %s, grad norm %s", metrics.loss, metrics.grad_norm)
                return metrics
            self.core.sft_stepped(metrics, num_tokens=batch.num_tokens)
            await self._report(step_record(phase="sft", step=self.learner.step_count, version=self.state.version,
                                           metrics=metrics, counters=await self._counters()))
            if self.phase == "rl":
                if self.learner.cfg.algorithm.reference == "after_sft":
                    async with self._jax_lock:  # the KL reference is the warm-started policy
                        await asyncio.to_thread(self.replica.set_reference)
                version = self.core.warm_start_done()
                await self.publisher.publish()
                log.info("warm start done: %d SFT steps -> version %d, loss %.4f; groups sampled before it are "
                         "not trained", self.learner.step_count, version, metrics.loss)
                if self.saves is not None:
                    # The warm start is the run's costliest unit of work and no RL step's cadence
                    # covers it: a crash before the first RL checkpoint would redo every SFT step.
                    await self.saves.try_start("warm start")
            self.core.pause_if_due(self.learner.step_count)
            return metrics

    async def _jitted_step(self, batch: Batch) -> tuple[StepMetrics, float]:
        """The update, on a worker thread; returns its metrics and when it finished (Unix seconds)."""
        started = time.perf_counter()
        async with self._jax_lock:
            metrics = await asyncio.to_thread(self.replica.step, batch)
        self.core.add_time(busy_s=time.perf_counter() - started)
        return metrics, time.time()

    async def _intake_during(self, step: asyncio.Task[Any]) -> None:
        """Reads and admits new entries while `step` trains, until the next batch is ready."""
        while not step.done() and not self.core.book.batch_full() and not self.state.paused:
            read = self.intake.reader.background()
            await asyncio.wait({step, read}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                return  # the step finished first: the loop's next read takes this one's reply
            try:
                entries = self.intake.reader.take().entries
                if entries:
                    started = time.perf_counter()
                    await self._admit(entries, read_at=time.time())
                    self.clock.add_overlapped_intake(time.perf_counter() - started)
            except Exception as e:  # the step in flight must still publish: the loop raises it after
                log.exception("intake during step %d failed; the loop restarts after the step", self.learner.step_count)
                self._intake_error = e
                return

    async def _train_groups(self, groups: list[ReadyGroup], *, overlap: bool) -> StepMetrics:
        batch_at = time.time()
        try:
            batch = build_batch([g.trajectories for g in groups], self.learner.model_cfg.max_seq_len, self.pad_id,
                                overlong=self.overlong, longest_episode=self.longest_episode,
                                routing=routing_shape(self.learner.model_cfg), kept_width=self.core.cfg.kept_width)
            train_at = time.time()
            step = asyncio.create_task(self._jitted_step(batch), name="trainer-step")
            if overlap:
                await self._intake_during(step)
            metrics, trained_at = await step
        except Exception as e:
            decisions = self.core.step_failed(e)
            log.error("step failed (%s: %s); its groups are put back, or dead-lettered after their last try",
                      type(e).__name__, e, extra={"failed_steps": self.state.failed_steps})
            await self.intake.perform(decisions)
            raise
        if metrics.skipped:
            self.core.book.trained()
            await self._refuse(groups, f"step skipped: loss {metrics.loss}, grad norm {metrics.grad_norm}")
            return metrics
        version = self.core.stepped()
        started = time.perf_counter()
        # The previous step's tail (its overlapped publish first) ends before this step publishes:
        # versions reach the pointer in order, and one copy of the weights is held, not one per
        # step ahead of a slow publish. Normally it ended while this step trained.
        await self._tails.settle()
        cut, published = None, False
        try:
            if overlap and self._publish_may_overlap(version):
                cut = await self.publisher.cut(version)
            published = cut is None and await self.publisher.publish_or_owe()
        except NonFiniteWeights as e:
            await self._refuse(groups, f"not published: {e}", unpublished=True)
            return metrics
        cut_at = time.time()
        marks = StepMarks(read_at=0.0, ready_at=0.0, batch_at=batch_at, train_at=train_at, trained_at=trained_at,
                          cut_at=cut_at, published_at=cut_at if published else 0.0)
        await self._finish_step(groups, batch, metrics, marks, published=published, cut=cut, defer_tail=overlap)
        self.core.add_time(io_s=time.perf_counter() - started)
        self.clock.tail_done()
        return metrics

    async def _refuse(self, groups: Sequence[ReadyGroup], reason: str, *, unpublished: bool = False) -> None:
        """A step that would corrupt the weights: nothing published, its groups dead-lettered."""
        await self.intake.perform(self.core.step_refused(groups, reason, unpublished=unpublished))
        self.core.refused()  # with its dead letters durable: a reader sees both or neither
        log.error("step refused (%s); its trajectories moved to %s, version stays %d", reason,
                  self.intake.dead_letters, self.state.version,
                  extra={"skipped_steps": self.state.skipped_steps, "version": self.state.version})
        self._raise_if_damaged()

    def _raise_if_damaged(self) -> None:
        """The core found that this process may not train on (a damaged state, the run taken over)."""
        if self.state.must_restart:
            raise MustRestart(f"{self.state.must_restart}; the restart restores the newest good checkpoint "
                              f"({self.state.checkpoint_uri or 'none yet: the initial weights'})")

    def _publish_may_overlap(self, version: int) -> bool:
        """Whether `version`'s publish may run beside the next step: not when its tail may not
        (a checkpoint due, saves failing, a pause due) nor while a publish is owed."""
        return not (self.core.owes_publish or self._tail_inline(version))

    def _tail_inline(self, version: int) -> bool:
        return (self.core.holds.acknowledges_before_next_step(version, time.monotonic())
                or self.core.pause_due(self.learner.step_count))

    async def _finish_step(self, groups: Sequence[ReadyGroup], batch: Batch, metrics: StepMetrics, marks: StepMarks,
                           *, published: bool, cut: ServingCopy | None = None, defer_tail: bool = False) -> None:
        """A published (or publish-pending, or `cut`: to be published first thing in its tail)
        step: counted and held now; its record, log line and acks in its tail, which `defer_tail`
        runs beside the next step (tail.py)."""
        step = self.core.finished(groups, metrics, num_tokens=batch.num_tokens)
        trajs = [t for g in groups for t in g.trajectories]
        last = max(groups, key=lambda g: g.ready_at)
        marks = dataclasses.replace(marks, read_at=last.read_at, ready_at=last.ready_at)
        read_at = [g.read_at for g in groups for _ in g.entry_ids]
        record = dict(phase="rl", step=self.learner.step_count, version=step.version, metrics=metrics,
                      trajectories=trajs, trained_from=step.version - 1,
                      staleness=(self.state.last_staleness, self.state.last_staleness_max),
                      timing=step_timing(self.clock, marks, trajs, read_at, step.entry_ids),
                      anatomy=step_anatomy(self.clock, marks, trajs, read_at, step.entry_ids), now=time.time())
        self.clock.step_done(marks.cut_at)
        counters = self._counters_now()  # as of this step, whenever its tail runs
        if defer_tail and not self._tail_inline(step.version):
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
        counters = {**counters, "queue_depth": await self.intake.backlog(), **self.publisher.figures(step.version)}
        await self._report(step_record(**record, counters=counters))
        # The ids make each version's data lineage auditable (and let tests prove exactly-once).
        metrics = record["metrics"]
        log.info("step %d -> version %d: loss %.4f reward %.3f tokens %d", record["step"], step.version,
                 metrics.loss, metrics.reward_mean, metrics.num_tokens,
                 extra={"step": record["step"], "version": step.version, "trajectory_ids": list(step.trajectory_ids)})
        await self.intake.perform(self.core.holds.stepped(step.version, published=published, now=time.monotonic()))
        # Off the step's path: keeps the in-flight set to the groups a batch may still take.
        await self.intake.settle_in_flight(self.core.lineage.floor(step.version))

    # -- records --------------------------------------------------------------------------------

    def _counters_now(self) -> dict[str, Any]:
        """The loop's cumulative figures, for a step record (the stream's backlog aside)."""
        book = self.core.book
        return {"tokens_trained": self.state.tokens_trained, "generated_tokens": self.state.generated_tokens,
                "consumed": self.state.consumed, "skipped_steps": self.state.skipped_steps,
                "ready_groups": len(book.ready), "dropped": self.dropped(),
                "expiring_waits": book.expiring.waits, "expiring_timeouts": book.expiring.timeouts}

    async def _counters(self) -> dict[str, Any]:
        return {**self._counters_now(), "queue_depth": await self.intake.backlog()}

    async def _report(self, record: dict[str, Any]) -> None:
        """Hands the record on; a failing consumer (Redis down) costs the record, never the step."""
        self.core.recorded(record)
        for consumer in self.on_step:
            try:
                await consumer(record)
            except Exception:
                log.exception("step %s: diagnostics not exported", record.get("step"))

