"""Checkpoint saves and the restore, as the driver (loop.py) runs them: no decisions here.

Which steps a checkpoint covers, when one is due and what a failure lets go are the core's
(core/holds.py). Saves are written in the background: a step waits only for the arrays' copy to
host, and for the previous save when the next one is due before it finished.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import traceback

from services.trainer.checkpoint import Checkpointer, CheckpointMeta, Restored, SaveArrays
from services.trainer.lockstep import Replica

log = logging.getLogger(__name__)

ROOM_CHECK_S = 5.0
"""How long a failed save's look at the disk's free space may take (a network volume can hang)."""
ERROR_CHARS = 500
"""The status's checkpoint_error is cut to this length."""


class Saves:
    def __init__(self, *, replica: Replica, checkpointer: Checkpointer, jax_lock: asyncio.Lock) -> None:
        self.replica, self.checkpointer, self.jax_lock = replica, checkpointer, jax_lock

    async def restore(self) -> Restored | None:
        """The newest complete, intact checkpoint, loaded into the learner (None: none)."""
        async with self.jax_lock:
            return await asyncio.to_thread(self.replica.restore_newest)

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
