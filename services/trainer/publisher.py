"""How the training loop gets a version to the fleet: into the version store (publish.py),
then the weight pointer moved to it.

A step's publish is overlapped with the next step where it can be (the run loop's steps on one
process, when the step's tail may be deferred): the loop copies the weights on the device
(`cut`, a few ms) and goes on; the step's tail serialises the copy, hashes it and moves the
pointer while the next step trains (`publish_cut`), then writes the record and acknowledges
(acks still follow the publish). A step publishes only once the previous step's tail is done,
so versions reach the pointer in order, one copy is held at a time, and at most one step
trains past an unpublished version. A failed or refused overlapped publish is owed (`due`)
like an inline one: the next publish is inline, with no tail in flight, and covers it (a newer
version), re-numbering above a foreign pointer; the re-numbering never races a publish.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from arlo.coord import WeightPointer
from arlo.model.weights import NonFiniteWeights, ServingCopy
from services.trainer.durability import Durability
from services.trainer.lockstep import Replica
from services.trainer.publish import PublishedVersion, VersionStore, hashed_payload
from services.trainer.state import TrainerState
from services.trainer.tail import StepTails

log = logging.getLogger(__name__)

POINTER_TRIES = 3


class PointerConflict(RuntimeError):
    """An overlapped publish found the pointer at a version this trainer did not write."""


class Publisher:
    """Publishes the loop's current version (`state.version`), inline or from a step's tail."""

    def __init__(self, *, store: VersionStore, pointer: WeightPointer, replica: Replica, state: TrainerState,
                 durable: Durability, tails: StepTails, jax_lock: asyncio.Lock, source: str) -> None:
        self.store = store
        self.pointer = pointer
        self.replica = replica
        self.state = state
        self.durable = durable
        self.tails = tails
        self.jax_lock = jax_lock
        self.source = source
        self.due = False
        """The newest version's publish failed or met a foreign pointer: publish before the next step."""

    async def cut(self) -> ServingCopy | None:
        """The current version's serving weights copied on the device, for an overlapped publish
        (raises NonFiniteWeights); None when it must be inline (several processes, or the copy
        failed: the inline publish needs one array's room at a time, not a whole copy)."""
        try:
            async with self.jax_lock:  # the next step donates the arrays copied
                return await asyncio.to_thread(self.replica.serving_copy)
        except NonFiniteWeights:
            raise
        except Exception:
            log.exception("copying version %d's weights failed; publishing it inline", self.state.version)
            return None

    async def publish_or_owe(self) -> bool:
        """Publishes the current version inline; whether it did. A failure leaves it owed."""
        try:
            await self.publish()
            self.due = False  # an overlapped publish owed before is covered by this newer version
            return True
        except NonFiniteWeights:
            raise
        except Exception:
            # The update applied: the step is trained (never retried); its acks wait for a publish.
            self._failed("publishing version %d failed; retrying before the next step", self.state.version)
            return False

    def _failed(self, message: str, *args: Any) -> None:
        self.due = True
        self.state.publish_failures += 1
        log.exception(message, *args, extra={"publish_failures": self.state.publish_failures})

    async def publish_cut(self, cut: ServingCopy, version: int, record: dict[str, Any]) -> bool:
        """A step's overlapped publish, from its tail; whether it published. Fills in the record's
        pointer mark and `publish_overlapped_s`."""
        try:
            await self._publish_version(version, cut)
        except PointerConflict:  # counted and overtaken by the inline retry (`publish`)
            self.due = True
            log.warning("version %d's publish found a weight pointer this trainer did not write; re-publishing "
                        "above it before the step after", version)
            return False
        except Exception:
            self._failed("publishing version %d beside the next step failed; retrying it inline before "
                         "the step after", version)
            return False
        published_at = time.time()
        record["anatomy"]["published_at"] = published_at
        record["timing"]["publish_overlapped_s"] = published_at - record["anatomy"]["cut_at"]
        return True

    async def publish_owed(self) -> None:
        """Publishes the current version, owed by a failed or refused publish; raises while it fails."""
        await self.tails.settle()  # an overlapped publish in flight goes first (and may leave it owed)
        await self.publish()
        self.due = False

    async def _publish_version(self, version: int, cut: ServingCopy) -> None:
        """Publishes `cut` as `version`; raises PointerConflict (nothing re-numbered) when the
        pointer holds a version this trainer did not write."""
        published = await self._stored(version, cut)
        # The tail acknowledges after (`Durability.acknowledge`): an ack that fails is a tail's
        # failure (the loop restarts and re-reads), not a publish's.
        if not await self._point_at(published, acknowledge=False):
            raise PointerConflict(f"the weight pointer holds a version this trainer did not write; version "
                                  f"{version} is re-published above it")

    async def _stored(self, version: int, cut: ServingCopy | None = None) -> PublishedVersion:
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
        return self.store.put(version, data, sha256=digests.sha256, chunk_digests=digests.chunks)

    async def _point_at(self, published: PublishedVersion, *, acknowledge: bool = True) -> bool:
        """Moves the pointer to `published`; False when it holds a version this trainer did not
        write. `acknowledge`: then acknowledge what the publish makes durable."""
        if not await self.pointer.publish(published.version, source=self.source, sha256=published.sha256):
            current = await self.pointer.get()
            if current is not None and (current.version != published.version or current.sha256 != published.sha256):
                return False
            # else ours already (a retried call that had landed)
        if acknowledge:
            await self.durable.published(published.version)
        return True

    async def publish(self) -> None:
        """Publishes the current version (no step in flight); a pointer this trainer did not write
        is reported and overtaken (the version re-numbered above it), so a foreign HSET cannot
        live-lock training."""
        for _ in range(POINTER_TRIES):
            published = await self._stored(self.state.version)
            if await self._point_at(published):
                return
            current = await self.pointer.get()
            if current is None:
                continue  # the pointer went away between the refusal and the read: publish again
            self.state.pointer_conflicts += 1
            log.error("weight pointer holds version %d (source %r, sha256 %.12s) that this trainer did not write "
                      "(its version: %d); publishing above it as version %d", current.version, current.source,
                      current.sha256, published.version, current.version + 1,
                      extra={"pointer_conflicts": self.state.pointer_conflicts, "pointer_version": current.version})
            self.state.version = max(self.state.version, current.version) + 1
            self.store.put(self.state.version, published.data, sha256=published.sha256,
                           chunk_digests={k: v for k, v in published.chunk_digests.items() if isinstance(v, str)})
        raise RuntimeError(f"the weight pointer kept moving ahead of version {self.state.version}")
