"""Checkpoint saves and the restore, as the driver (loop.py) runs them.

Which steps a checkpoint covers, when one is due and what a failure lets go are the core's
(core/holds.py); this starts, writes and finishes the save it asks for, and hands the core's
acknowledgements back to the driver to perform. Saves are written in the background: a step
waits only for the arrays' copy to host, and for the previous save when the next one is due
before it finished. A failed save is retried with backoff on the loop's clock.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import time
import traceback
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from arlo.background import MustRestart
from arlo.coord import WeightPointer
from arlo.coord.lease import LeaseLost
from services.trainer.checkpoint import Checkpointer, CheckpointMeta, NonFiniteState, Restored, SaveArrays
from services.trainer.core.lineage import writers_after_restore
from services.trainer.core.records import Acknowledge, Checkpoint, Decision
from services.trainer.core.trainer import TrainerCore
from services.trainer.learner import Learner
from services.trainer.lockstep import NOTHING_RECORDED, RecordedCheckpoint, Replica
from services.trainer.publish import VersionStore

log = logging.getLogger(__name__)

ROOM_CHECK_S = 5.0
"""How long a failed save's look at the disk's free space may take (a network volume can hang)."""
ERROR_CHARS = 500
"""The status's checkpoint_error is cut to this length."""


class Saves:
    """One checkpoint job at a time. `perform`: the driver's (loop.py), which carries out the
    acknowledgements a save makes possible (the driver alone talks to the stream)."""

    def __init__(self, *, replica: Replica, checkpointer: Checkpointer, jax_lock: asyncio.Lock, core: TrainerCore,
                 learner: Learner, store: VersionStore, pointer: WeightPointer,
                 perform: Callable[[Sequence[Decision]], Awaitable[None]]) -> None:
        self.replica, self.checkpointer, self.jax_lock = replica, checkpointer, jax_lock
        self.core, self.learner, self.store, self.pointer, self.perform = core, learner, store, pointer, perform
        self.job: asyncio.Task[tuple[int, str]] | None = None
        self.job_version = 0
        self.writers: tuple[str, ...] = ()
        """Named in every checkpoint this trainer writes (core/lineage.py); set by `restore`."""

    @property
    def saving(self) -> bool:
        """A checkpoint save is in flight."""
        return self.job is not None and not self.job.done()

    async def try_start(self, why: str) -> None:
        """Starts a save of the current version; a failure to start is logged and retried later."""
        try:
            await self.begin(why)
        except Exception as e:
            self.core.holds.save_failed(None, await self.describe(e), time.monotonic())
            log.exception("could not start checkpoint %d; its steps stay held", self.core.state.version)

    async def begin(self, why: str) -> asyncio.Future[tuple[int, str]]:
        """Starts a checkpoint of the current version (step lock held); the future completes with it."""
        version = self.core.state.version
        if self.job is not None and not self.job.done() and self.job_version == version:
            return self.job
        await self.settle()  # one save at a time: wait for the previous one to finish
        if version < 1:
            raise ValueError("nothing to checkpoint yet: no version has been published")
        if version != self.core.state.checkpoint_version and self.store.get(version) is None:
            raise RuntimeError(f"version {version} is not held (its publish failed); the next one is saved")
        checkpoint = self.core.holds.begin(version, why)
        if version == self.core.state.checkpoint_version:
            if checkpoint.covers:  # complete on disk, but recording it or acknowledging its steps failed: again now
                try:
                    await self.pointer.set_checkpoint(version, self.core.state.checkpoint_uri)
                except BaseException:
                    self.core.holds.put_back(checkpoint.covers)
                    raise
                await self.perform([Acknowledge(checkpoint.covers)])
            done: asyncio.Future[tuple[int, str]] = asyncio.get_running_loop().create_future()
            done.set_result((version, self.core.state.checkpoint_uri))
            return done
        published = self.store.get(version)
        assert published is not None
        try:  # a trainer that lost the run while paused writes no files (LeaseLost stops it)
            await self.pointer.check_fence(f"writing checkpoint {version}")
        except BaseException as e:
            self.core.holds.not_started(checkpoint)
            self._damaged(version, e)
            raise
        # The checkpoint keeps the float32 master copy: its checksum is the publish's only when
        # the published bytes are that copy (param_dtype float32); otherwise start_save computes it.
        meta = CheckpointMeta(version=version, step=self.learner.step_count,
                              params_sha256=published.sha256 if self.learner.param_dtype == "float32" else "",
                              trajectory_ids=tuple(t for s in checkpoint.covers for t in s.trajectory_ids),
                              writers=self.writers)
        try:
            snapshot = await self.start(meta)
        except BaseException as e:
            self.core.holds.not_started(checkpoint)
            self._damaged(version, e)
            raise
        self.job_version = version
        self.job = asyncio.create_task(self._finish(checkpoint, meta, snapshot),
                                             name=f"checkpoint-{version}")
        return self.job

    async def _finish(self, checkpoint: Checkpoint, meta: CheckpointMeta, snapshot: Any) -> tuple[int, str]:
        """Writes the save beside the next steps; then its steps are acknowledged."""
        version, failing = checkpoint.version, self.core.holds.failing
        try:
            uri = await self.write(meta, snapshot)
        except BaseException as e:
            snapshot = None
            self._damaged(version, e)
            error = await self.describe(e)
            # The steps it hands back are bounded in the same breath as the failure is counted;
            # a cancelled save (shutdown) is no storage failure.
            decisions = self.core.holds.save_failed(checkpoint, error, time.monotonic(),
                                                    storage=isinstance(e, Exception))
            log.error("checkpoint %d failed (%s: %s); its %d steps stay held, retry in %.0fs", version,
                      type(e).__name__, e, len(checkpoint.covers), self.core.holds.retry_at - time.monotonic(),
                      exc_info=e, extra={"checkpoint_failures": self.core.state.checkpoint_failures})
            try:
                await self.perform(decisions)
            except Exception:  # the save's failure is the news; the next step applies the bound again
                log.exception("acknowledging held steps past the hold bound failed")
            raise
        if failing:
            log.warning("checkpoint saves resumed after %d failures", failing)
        acknowledge = self.core.holds.saved(checkpoint)
        try:
            try:
                await self.pointer.set_checkpoint(version, uri)
            except BaseException as e:
                # Held again: acknowledged once a record succeeds (the next save, owed at once), or
                # re-delivered after a restart; dropped here they pinned the backlog until then.
                self.core.holds.put_back(checkpoint.covers)
                if isinstance(e, LeaseLost):
                    await self._set_aside_refused(version, e)
                raise
            await self.perform([acknowledge])  # durable now; a failed ack is retried by the next checkpoint
        except BaseException as e:
            self._damaged(version, e)
            self.core.holds.checkpointed(version, uri)  # complete on disk all the same
            log.exception("checkpoint %d is complete but recording it or acknowledging its steps failed; the next "
                          "save does", version)
            raise
        # Reported once its steps are acknowledged: a reader that sees checkpoint v sees its acks.
        self.core.holds.checkpointed(version, uri)
        log.info("checkpoint %d complete: %s (%d trajectories acknowledged; saved for %s)", version, uri,
                 sum(len(s.trajectory_ids) for s in checkpoint.covers), checkpoint.why,
                 extra={"checkpoint_version": version, "checkpoint_uri": uri})
        return version, uri

    async def _set_aside_refused(self, version: int, e: LeaseLost) -> None:
        """Taken over during the write: the files are a second lineage's, which the next restart
        would restore as the newest, so they are set aside before the process stops. Kept where
        the successor recorded this very version (it restored them: its lineage now)."""
        try:
            current = await self.pointer.get()
            if current is None or current.checkpoint_version != version:
                where = await asyncio.to_thread(self.checkpointer.set_aside, version, "fenced")
                log.error("checkpoint %d set aside in %s: %s", version, where, e)
        except Exception:  # Redis or the disk: left in place, logged for an operator
            log.exception("could not set aside checkpoint %d, written after the run was taken over", version)

    def _damaged(self, version: int, e: BaseException) -> None:
        """A save refused because the state holds NaN or inf (no retry can succeed: the state is
        damaged), or a fenced record refused (the run was taken over): the driver stops for a
        restart from the newest good checkpoint. Said to the core, since this job's own error is
        only logged."""
        if isinstance(e, NonFiniteState):
            self.core.state_damaged(f"trainer state damaged: checkpoint {version} not saved: {e}")
        elif isinstance(e, MustRestart):
            self.core.state_damaged(str(e))

    async def settle(self) -> None:
        """Waits for the checkpoint in flight; its failure was logged and its steps held again."""
        job = self.job
        if job is None:
            return
        await asyncio.wait([job])
        if not job.cancelled():
            job.exception()  # retrieved, so asyncio does not report it again
        self.job = None


    async def restore(self, token: str) -> Restored | None:
        """The run's newest complete, intact checkpoint, loaded into the learner (None: none).
        Newer ones another trainer wrote after it lost the run are set aside first (the pointer's
        record says whose are the run's). `token`: this trainer's lease token, named with the
        restored checkpoint's writers in every checkpoint it writes."""
        current = await self.pointer.get()
        recorded = (RecordedCheckpoint(current.checkpoint_version, current.checkpoint_writer) if current
                    else NOTHING_RECORDED)
        async with self.jax_lock:
            restored = await asyncio.to_thread(self.replica.restore_newest, recorded)
        self.writers = writers_after_restore(restored.meta.writers if restored else (), token)
        return restored

    async def start(self, meta: CheckpointMeta) -> SaveArrays | None:
        """Copies the state to host for `meta`'s save (None: several processes, the save already
        started in step order). Under the JAX lock: a step donates the arrays copied."""
        async with self.jax_lock:
            snapshot = await asyncio.to_thread(self.replica.save_snapshot)
            if snapshot is None:
                await asyncio.to_thread(self.replica.start_save, meta)
        return snapshot

    async def write(self, meta: CheckpointMeta, snapshot: SaveArrays | None) -> str:
        """Writes `snapshot` (host copies) beside the next steps and waits until it is complete;
        returns its uri. A failure raises with its frames cleared: the host copy of the whole
        state must not live on in a traceback until the retry."""
        try:
            if snapshot is not None:
                try:
                    await asyncio.to_thread(self.replica.save_from, snapshot, meta)
                finally:
                    snapshot = None  # orbax holds what it still needs; the copies go with the write
            await asyncio.to_thread(self.checkpointer.wait)
        except BaseException as e:
            traceback.clear_frames(e.__traceback__)
            raise
        return self.checkpointer.uri(meta.version)

    async def describe(self, e: BaseException) -> str:
        return describe_save_failure(e, await self._room_error(e))

    async def _room_error(self, e: BaseException) -> OSError | None:
        """ENOSPC when the checkpoint disk has no room for a checkpoint (checkpoint.py
        `out_of_space`), looked at when a save failed without saying so. On a worker thread and
        bounded: the loop serves pulls and heartbeats meanwhile, and a stat on a failing network
        volume can hang."""
        if not isinstance(e, Exception) or _disk_full(e) is not None:
            return None
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.checkpointer.out_of_space), ROOM_CHECK_S)
        except Exception:  # a description must never fail the failure's handling
            return None


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
