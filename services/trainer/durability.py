"""What the trainer may acknowledge, and the checkpoints that make it durable.

The rule: a trajectory is marked trained (`seen:`) and acknowledged only once a durable
state covers it. With checkpoints (`trainer.checkpoint_dir`) that is a COMPLETE checkpoint
whose step used it: until then its step is held here, so a kill -9 at any moment re-delivers
exactly what the restored model has not learned from, and `seen:` never hides an entry the
restored weights lack. Without checkpoints nothing is durable (a restart begins again from
the initial weights): a step is acknowledged once its version is published, and the trainer
warns at start.

Saves are written in the background: a step waits only for the arrays' copy to host, and for
the previous save when the next one is due before it finished. A save that fails (disk full,
I/O error) is logged, counted, reported in the status and retried with backoff on the loop's
clock, not only when the next due version comes (with producers stalled, none would come);
training goes on meanwhile. Held steps pin their entries in the stream's pending list, which
producers count as backlog: while saves fail and more than `max_held` entries are held, the
oldest published steps are acknowledged without a checkpoint (`acked_undurable`, logged as an
error), so a storage outage cannot stall the run, and the status says what a crash would lose.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import traceback
from typing import TYPE_CHECKING

from services.trainer.checkpoint import Checkpointer, CheckpointMeta, SaveArrays
from services.trainer.state import TrainedStep, TrainerState

if TYPE_CHECKING:
    from arlo.coord import TrajectoryStream, WeightPointer
    from services.trainer.lockstep import Replica
    from services.trainer.publish import VersionStore

log = logging.getLogger(__name__)

RETRY_FIRST_S = 1.0
RETRY_MAX_S = 30.0
ROOM_CHECK_S = 5.0
"""How long a failed save's look at the disk's free space may take (a network volume can hang)."""
ERROR_CHARS = 500
"""The status's checkpoint_error is cut to this length."""


class Durability:
    def __init__(self, *, replica: Replica, checkpointer: Checkpointer | None, stream: TrajectoryStream,
                 pointer: WeightPointer, store: VersionStore, state: TrainerState, jax_lock: asyncio.Lock,
                 every: int, max_held: int) -> None:
        self.replica, self.checkpointer, self.stream, self.pointer = replica, checkpointer, stream, pointer
        self.store, self.state, self.jax_lock = store, state, jax_lock
        self.every = every
        self.max_held = max_held
        self._awaiting: list[TrainedStep] = []  # trained, not yet covered by a checkpoint (or published)
        self._saving: list[TrainedStep] = []  # covered by the checkpoint being written
        self._job: asyncio.Task[tuple[int, str]] | None = None
        self._job_version = 0
        self._failing = 0  # consecutive failed saves
        self._undurable_through = 0  # newest version with steps acknowledged without a checkpoint
        self._published_through = 0  # newest version the pointer names (the bound acknowledges up to it)
        self._retry_at = 0.0

    def held(self) -> tuple[TrainedStep, ...]:
        return (*self._awaiting, *self._saving)

    def _put_back(self, steps: list[TrainedStep]) -> None:
        """Steps held again (a failed save or acknowledgement), in version order: a save's job and
        a step's tail may each hand steps back, and the hold bound takes the oldest first."""
        self._awaiting = sorted((*steps, *self._awaiting), key=lambda s: s.version)

    def _count_held(self) -> None:
        self.state.held_entries = sum(len(s.entry_ids) for s in self.held())

    # -- restore ----------------------------------------------------------------------------

    async def restore(self) -> int:
        """Loads the newest complete, intact checkpoint, if any; returns its version (0: none)."""
        if self.checkpointer is None:
            log.warning("CHECKPOINTS ARE OFF (trainer.checkpoint_dir is empty): nothing the trainer learns is "
                        "durable; a restart begins again from the initial weights while every trajectory "
                        "trained before stays acknowledged", extra={"checkpoints": False})
            return 0
        async with self.jax_lock:
            restored = await asyncio.to_thread(self.replica.restore_newest)
        if restored is None:
            return 0
        meta = restored.meta
        if restored.skipped:
            self.state.checkpoint_fallbacks += len(restored.skipped)
            log.error("fell back to checkpoint %s past %d damaged newer one(s): %s; trajectories acknowledged "
                      "after it are not in the restored weights", restored.uri, len(restored.skipped),
                      "; ".join(restored.skipped), extra={"checkpoint_fallbacks": len(restored.skipped)})
        self.state.checkpoint_version, self.state.checkpoint_uri = meta.version, restored.uri
        # The process may have died between the checkpoint completing and these two writes.
        await self.pointer.set_checkpoint(meta.version, restored.uri)
        await self.stream.mark_trained(meta.trajectory_ids)
        log.info("resumed from checkpoint %s: step %d, version %d", restored.uri, meta.step, meta.version,
                 extra={"step": meta.step, "version": meta.version, "checkpoint_uri": restored.uri})
        return meta.version

    # -- acknowledgement --------------------------------------------------------------------

    def hold(self, step: TrainedStep) -> None:
        """Holds a step whose update applied (step lock held) until `acknowledge` says what may go."""
        self._awaiting.append(step)
        self._count_held()

    def checkpoint_due(self, version: int) -> bool:
        """`acknowledge(version)` would start a checkpoint (which copies the arrays a step donates)."""
        return (self.checkpointer is not None and self.every > 0 and version % self.every == 0
                and time.monotonic() >= self._retry_at)

    def acknowledges_before_next_step(self, version: int) -> bool:
        """`acknowledge(version)` must finish before the next step starts: it starts a checkpoint,
        or saves are failing and the hold bound is applied as each step joins the held ones (with
        acknowledgements deferred, several steps' entries could be above it at once)."""
        return self.checkpoint_due(version) or bool(self._failing)

    async def acknowledge(self, step: TrainedStep, *, published: bool) -> None:
        """After `hold(step)`: acknowledges what the rule allows; starts the checkpoint when due."""
        if published:
            self._published_through = max(self._published_through, step.version)
        if self.checkpointer is None:
            if published:
                await self.published(step.version)
            return
        if self.checkpoint_due(step.version):
            await self.try_checkpoint()
        elif self._failing and self.state.held_entries > self.max_held and published:
            await self._ack_undurable(step.version)

    async def published(self, version: int) -> None:
        """Without checkpoints, a published version is as durable as it gets: acknowledge up to it."""
        self._published_through = max(self._published_through, version)
        if self.checkpointer is None:
            done = [s for s in self._awaiting if s.version <= version]
            self._awaiting = [s for s in self._awaiting if s.version > version]
            await self._ack(done)
        elif self._failing and self.state.held_entries > self.max_held:
            await self._ack_undurable(version)

    async def _ack(self, steps: list[TrainedStep]) -> None:
        try:
            await self.stream.mark_trained([t for s in steps for t in s.trajectory_ids])
            await self.stream.ack([e for s in steps for e in s.entry_ids])
        except BaseException:
            self._put_back(steps)  # still unacknowledged: the next call tries again
            raise
        finally:
            self._count_held()

    async def _ack_undurable(self, version: int) -> None:
        await self._ack_past_bound(self._take_past_bound(version))

    def _take_past_bound(self, version: int) -> list[TrainedStep]:
        """Takes the oldest held steps up to `version` while more than `max_held` entries are held,
        and counts what stays held at once (a status read while they are acknowledged sees it).
        Counted from the live lists: a failed save's job and a step may both apply the bound."""
        excess = sum(len(s.entry_ids) for s in self.held()) - self.max_held
        done: list[TrainedStep] = []
        while self._awaiting and excess > 0 and self._awaiting[0].version <= version:
            done.append(self._awaiting.pop(0))
            excess -= len(done[-1].entry_ids)
        self._count_held()
        return done

    async def _ack_past_bound(self, done: list[TrainedStep]) -> None:
        """Acknowledges steps `_take_past_bound` took, without a checkpoint."""
        if not done:
            return
        await self._ack(done)  # a failure puts them back, held and uncounted
        n = sum(len(s.trajectory_ids) for s in done)
        self.state.acked_undurable += n
        self._undurable_through = max(self._undurable_through, done[-1].version)
        log.error("checkpoint saves keep failing (%s); %d trajectories acknowledged WITHOUT a checkpoint so "
                  "producers are not stalled by the held backlog (bound %d entries); a crash now loses them",
                  self.state.checkpoint_error, n, self.max_held, extra={"acked_undurable": self.state.acked_undurable})

    # -- checkpoints ------------------------------------------------------------------------

    def retry_due(self) -> bool:
        """A save is owed and due (the loop calls `try_checkpoint` then, data or not)."""
        if self.checkpointer is None:
            return False
        owed = checkpoint_owed([s.version for s in self._awaiting], every=self.every,
                               undurable_through=self._undurable_through,
                               checkpoint_version=self.state.checkpoint_version)
        return owed and time.monotonic() >= self._retry_at and (self._job is None or self._job.done())

    async def try_checkpoint(self) -> None:
        """Starts a save of the current version; a failure to start is logged and retried later."""
        try:
            await self.begin()
        except Exception as e:
            self._failed(e, await self._room_error(e))
            log.exception("could not start checkpoint %d; its steps stay held", self.state.version)

    async def begin(self) -> asyncio.Future[tuple[int, str]]:
        """Starts a checkpoint of the current version (step lock held); the future completes with it."""
        if self.checkpointer is None:
            raise ValueError("trainer.checkpoint_dir is not set; checkpoints are disabled")
        version = self.state.version
        if self._job is not None and not self._job.done() and self._job_version == version:
            return self._job
        await self.settle()  # one save at a time: wait for the previous one to finish
        if version < 1:
            raise ValueError("nothing to checkpoint yet: no version has been published")
        if version == self.state.checkpoint_version:
            covered = [s for s in self._awaiting if s.version <= version]
            if covered:  # complete on disk, but acknowledging its steps failed: again now
                self._awaiting = [s for s in self._awaiting if s.version > version]
                await self._ack(covered)
            done: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
            done.set_result((version, self.state.checkpoint_uri))
            return done
        published = self.store.get(version)
        if published is None:
            raise RuntimeError(f"version {version} is not held (its publish failed); the next one is saved")
        covered, self._awaiting = self._awaiting, []
        # The checkpoint keeps the float32 master copy: its checksum is the publish's only when
        # the published bytes are that copy (param_dtype float32); otherwise start_save computes it.
        served_is_master = self.replica.learner.param_dtype == "float32"
        meta = CheckpointMeta(version=version, step=self.replica.learner.step_count,
                              params_sha256=published.sha256 if served_is_master else "",
                              trajectory_ids=tuple(t for s in covered for t in s.trajectory_ids))
        self._saving = covered
        try:
            async with self.jax_lock:  # a step donates the arrays: none may run while they are copied
                snapshot = await asyncio.to_thread(self.replica.save_snapshot)
                if snapshot is None:  # several processes: the save starts in step order, here
                    await asyncio.to_thread(self.replica.start_save, meta)
        except BaseException:
            self._put_back(covered)
            self._saving = []
            raise
        self._job_version = version
        self._job = asyncio.create_task(self._finish(version, covered, meta, snapshot), name=f"checkpoint-{version}")
        return self._job

    async def _finish(self, version: int, covered: list[TrainedStep], meta: CheckpointMeta,
                      snapshot: SaveArrays | None) -> tuple[int, str]:
        """Saves `snapshot` (host copies; None: a save already started) beside the next steps and
        waits for it; then the checkpoint's steps are acknowledged."""
        assert self.checkpointer is not None
        uri = self.checkpointer.uri(version)
        try:
            if snapshot is not None:
                try:
                    await asyncio.to_thread(self.replica.save_from, snapshot, meta)
                finally:
                    snapshot = None  # orbax holds what it still needs; the copies go with the write
            await asyncio.to_thread(self.checkpointer.wait)
        except BaseException as e:
            # The job keeps its exception until settled (a retry, 1-30 s on): frames of the failed
            # save must not keep the host copy of the whole state alive that long.
            traceback.clear_frames(e.__traceback__)
            self._put_back(covered)
            self._saving = []
            room = await self._room_error(e)
            # The steps it hands back are bounded in the same breath as the failure is counted
            # (no step may come to do it, and no status read sees the one without the other);
            # a cancelled save (shutdown) is no storage failure.
            past_bound = self._take_past_bound(self._published_through) if isinstance(e, Exception) else []
            self._failed(e, room)
            log.error("checkpoint %d failed (%s: %s); its %d steps stay held, retry in %.0fs", version,
                      type(e).__name__, e, len(covered), self._retry_at - time.monotonic(), exc_info=e,
                      extra={"checkpoint_failures": self.state.checkpoint_failures})
            try:
                await self._ack_past_bound(past_bound)
            except Exception:  # the save's failure is the news; the next step applies the bound again
                log.exception("acknowledging held steps past the hold bound failed")
            raise
        self._saving = []
        if self._failing:
            log.warning("checkpoint saves resumed after %d failures", self._failing)
        self._failing, self._retry_at, self.state.checkpoint_error = 0, 0.0, ""
        try:
            await self.pointer.set_checkpoint(version, uri)
            await self._ack(covered)  # durable now; a failed ack is retried by the next checkpoint
        except BaseException:
            self.state.checkpoint_version, self.state.checkpoint_uri = version, uri  # complete on disk all the same
            log.exception("checkpoint %d is complete but acknowledging its steps failed; the next one does", version)
            raise
        # Reported once its steps are acknowledged: a reader that sees checkpoint v sees its acks
        # (CI-like run: the test saw version 2 with 4 entries still pending).
        self.state.checkpoint_version, self.state.checkpoint_uri = version, uri
        log.info("checkpoint %d complete: %s (%d trajectories acknowledged)", version, uri,
                 sum(len(s.trajectory_ids) for s in covered),
                 extra={"checkpoint_version": version, "checkpoint_uri": uri})
        return version, uri

    def _failed(self, e: BaseException, room: OSError | None = None) -> None:
        self._failing += 1
        self.state.checkpoint_failures += 1
        self.state.checkpoint_error = describe_save_failure(e, room)
        self._retry_at = time.monotonic() + min(RETRY_FIRST_S * 2 ** (self._failing - 1), RETRY_MAX_S)
        self._count_held()

    async def _room_error(self, e: BaseException) -> OSError | None:
        """ENOSPC when the checkpoint disk has no room for a checkpoint (checkpoint.py
        `out_of_space`), looked at when a save failed without saying so. On a worker thread and
        bounded: the loop serves pulls and heartbeats meanwhile, and a stat on a failing network
        volume can hang."""
        if not isinstance(e, Exception) or self.checkpointer is None or _disk_full(e) is not None:
            return None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.checkpointer.out_of_space), ROOM_CHECK_S)
        except Exception:  # a description must never fail the failure's handling
            return None

    async def settle(self) -> None:
        """Waits for the checkpoint in flight; its failure was logged and its steps requeued."""
        job = self._job
        if job is None:
            return
        await asyncio.wait([job])
        if not job.cancelled():
            job.exception()  # retrieved, so asyncio does not report it again
        self._job = None

    @property
    def saving(self) -> bool:
        """A checkpoint save is in flight."""
        return self._job is not None and not self._job.done()

    async def close(self, timeout_s: float) -> None:
        if self._job is not None:
            await asyncio.wait([self._job], timeout=timeout_s)


def checkpoint_owed(held_versions: list[int], *, every: int, undurable_through: int,
                    checkpoint_version: int) -> bool:
    """A checkpoint is owed, whether or not another step comes: a held step's version was due
    (`every`) and no save covers it (the save failed, or was skipped while a failed one backed off
    and then a save of an older version succeeded), or steps were acknowledged without a
    checkpoint while saves failed and none covers them yet (the hold bound can acknowledge every
    step as it publishes, leaving nothing held). Until then a crash loses what the model learned."""
    due = every > 0 and any(v % every == 0 for v in held_versions)  # every 0: saves only on request
    return due or undurable_through > checkpoint_version


def describe_save_failure(e: BaseException, room: OSError | None = None) -> str:
    """A failed save as the status reports it. A full disk is named whenever it is the cause,
    whatever the save raised last (CI saw Orbax's failed cleanup of its partial directory, with no
    ENOSPC in its chain): ENOSPC anywhere in the chain of causes, or `room`, the disk found
    without room for a checkpoint."""
    full = _disk_full(e) or room
    said = f"{type(e).__name__}: {e}"
    if full is None or full is e:
        return said[:ERROR_CHARS]
    return f"{type(full).__name__}: {full}; the save raised {said}"[:ERROR_CHARS]


def _disk_full(e: BaseException | None) -> OSError | None:
    """The ENOSPC error in `e`'s chain of causes, if any."""
    seen: set[int] = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return e
        e = e.__cause__ or e.__context__
    return None
