"""How the trainer gets a version to the fleet: into the version store (publish.py), then the
weight pointer moved to it.

A step's publish is overlapped with the next step where it can be (loop.py): the weights are
copied on the device (`cut`, a few ms), and serialising, hashing and moving the pointer run in
the step's tail beside the next step. Versions reach the pointer in order (one tail at a time),
one copy is held at a time, and at most one step trains past an unpublished version.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from arlo.config.trainer import WeightPublishConfig
from arlo.coord import WeightPointer, WeightPointerState
from arlo.model.weights import NonFiniteWeights, ServingCopy
from services.trainer.core.records import Decision
from services.trainer.core.trainer import TrainerCore
from services.trainer.lockstep import Replica
from services.trainer.publish import PublishedVersion, VersionEncoder, VersionStore, hashed_payload
from services.trainer.tail import StepTails

log = logging.getLogger(__name__)

POINTER_TRIES = 3


class Publisher:
    """Moves versions to the fleet: the store (serialised and hashed), then the weight pointer.
    What a refusal or failure means (re-numbering, owing a publish) is the core's."""

    def __init__(self, *, store: VersionStore, pointer: WeightPointer, replica: Replica, jax_lock: asyncio.Lock,
                 source: str, core: TrainerCore, tails: StepTails,
                 perform: Callable[[Sequence[Decision]], Awaitable[None]],
                 weights: WeightPublishConfig | None = None) -> None:
        """`perform`: the driver's (loop.py): what a publish lets the core acknowledge. `weights`:
        deltas and shared storage (trainer.weights)."""
        self.core, self.tails, self.perform = core, tails, perform
        self.store = store
        self.pointer = pointer
        self.replica = replica
        self.jax_lock = jax_lock
        self.source = source
        self.encoder = VersionEncoder(store, weights or WeightPublishConfig())

    async def cut(self, version: int) -> ServingCopy | None:
        """The current weights copied on the device, for an overlapped publish (raises
        NonFiniteWeights); None when it must be inline (several processes, or the copy failed:
        the inline publish needs one array's room at a time, not a whole copy)."""
        try:
            async with self.jax_lock:  # the next step donates the arrays copied
                return await asyncio.to_thread(self.replica.serving_copy)
        except NonFiniteWeights:
            raise
        except Exception:
            log.exception("copying version %d's weights failed; publishing it inline", version)
            return None

    async def stored(self, version: int, cut: ServingCopy | None = None) -> PublishedVersion:
        """`version` in the store: serialised from `cut`, or from the learner (no step in flight)."""
        published = self.store.get(version)
        if published is not None:
            return published
        if cut is not None:
            data = await asyncio.to_thread(cut.to_bytes)
        else:
            async with self.jax_lock:
                data = await asyncio.to_thread(self.replica.state_bytes)
        # Hashed off the event loop (a second or more at 0.5B, with pulls to serve meanwhile), the
        # chunks a pull sends with it, beside the whole.
        digests = await asyncio.to_thread(hashed_payload, data)
        await self._check_fence(version)
        return await self.encoder.put(version, data, sha256=digests.sha256, chunk_digests=digests.chunks)

    async def _check_fence(self, version: int) -> None:
        """Before a write to shared storage, which no Redis script fences: a trainer that lost the
        run while paused would replace the successor's file of the same version (LeaseLost stops it)."""
        if self.encoder.files is not None:
            await self.pointer.check_fence(f"writing version {version} to {self.encoder.storage}")

    async def renumbered(self, published: PublishedVersion, version: int) -> None:
        """The same weights stored again under `version` (re-numbered above a foreign pointer), full."""
        await self._check_fence(version)
        await self.encoder.put(version, published.data, sha256=published.sha256, full=True,
                               chunk_digests={k: v for k, v in published.chunk_digests.items() if isinstance(v, str)})

    def figures(self, version: int) -> dict[str, Any]:
        """What `version`'s publish sent, for its step record (empty when no longer held)."""
        published = self.store.get(version)
        if published is None:
            return {}
        return {"publish_kind": published.kind, "publish_bytes": published.published_bytes,
                "publish_full_bytes": len(published.data), "changed_fraction": published.changed_fraction}

    async def point_at(self, published: PublishedVersion) -> WeightPointerState | None:
        """Moves the pointer to `published`; None when it did, else the pointer it found (a version
        this trainer did not write)."""
        if await self.pointer.publish(published.version, source=self.source, sha256=published.sha256,
                                      payload=published.kind, full_version=published.full_version,
                                      base_version=published.version - 1 if published.kind == "delta" else 0,
                                      storage=self.encoder.storage,
                                      scope="adapters" if self.replica.learner.frozen is not None else "model"):
            return None
        current = await self.pointer.get()
        if current is not None and (current.version != published.version or current.sha256 != published.sha256):
            return current
        return None  # ours already (a retried call that had landed), or the pointer went away: ours next

    async def publish(self) -> None:
        """Publishes the current version (no step in flight); a pointer this trainer did not write
        is reported and overtaken (the version re-numbered above it)."""
        for _ in range(POINTER_TRIES):
            published = await self.stored(self.core.state.version)
            current = await self.point_at(published)
            if current is None:
                await self.perform(self.core.published(published.version))
                return
            version = self.core.pointer_conflict(current.version)
            log.error("weight pointer holds version %d (source %r, sha256 %.12s) that this trainer did not write "
                      "(its version: %d); publishing above it as version %d", current.version, current.source,
                      current.sha256, published.version, version,
                      extra={"pointer_conflicts": self.core.state.pointer_conflicts, "pointer_version": current.version})
            await self.renumbered(published, version)
        raise RuntimeError(f"the weight pointer kept moving ahead of version {self.core.state.version}")

    async def publish_or_owe(self) -> bool:
        """Publishes the current version inline; whether it did. A failure leaves it owed."""
        try:
            await self.publish()
            return True
        except NonFiniteWeights:
            raise
        except Exception:
            # The update applied: the step is trained (never retried); its acks wait for a publish.
            self.core.publish_failed()
            log.exception("publishing version %d failed; retrying before the next step", self.core.state.version,
                          extra={"publish_failures": self.core.state.publish_failures})
            return False

    async def publish_owed(self) -> None:
        """Publishes the current version, owed by a failed or refused publish; raises while it fails."""
        await self.tails.settle()  # an overlapped publish in flight goes first (and may leave it owed)
        await self.publish()

    async def publish_cut(self, cut: ServingCopy, version: int, record: dict[str, Any]) -> bool:
        """A step's overlapped publish, from its tail; whether it published. Fills in the record's
        pointer mark and `publish_overlapped_s`."""
        try:
            published = await self.stored(version, cut)
            current = await self.point_at(published)
        except Exception:
            self.core.publish_failed()
            log.exception("publishing version %d beside the next step failed; retrying it inline before the "
                          "step after", version, extra={"publish_failures": self.core.state.publish_failures})
            return False
        if current is not None:  # counted and overtaken by the inline retry (`publish`)
            self.core.owes_publish = True
            log.warning("version %d's publish found a weight pointer this trainer did not write; re-publishing "
                        "above it before the step after", version)
            return False
        published_at = time.time()
        record["anatomy"]["published_at"] = published_at
        record["timing"]["publish_overlapped_s"] = published_at - record["anatomy"]["cut_at"]
        return True
