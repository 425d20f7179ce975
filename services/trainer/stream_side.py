"""The trainer's side of the trajectory stream: the one module that calls it.

What it does to entries is decided by the core (services/trainer/core/); `StreamSide` reads,
performs those decisions (acknowledge, dead-letter, count stale, tell the in-flight set) and
reports each one done to the core once it is durable. The driver (loop.py) and the rooms it
hands `perform` to (saves.py, publisher.py) never call the stream themselves.

Reads, one of which may run while a step trains (`StreamReader`): a step spends most of its
time in the jitted update, on a worker thread; the event loop is idle then. Reading
(XREADGROUP, decode) and grouping the next batch's trajectories in that window takes the
intake off the step's critical path (issue 17: it was 7 ms of a 270 ms step at the 596k
workload). A read started during a step is never cancelled when the step ends first: the
entries Redis delivered to it are in this consumer's pending list, and dropping the reply
would leave them there unheld until the next restart re-read them. The loop takes its reply
with its next read instead.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

from redis.exceptions import RedisError

from arlo.coord import TrajectoryStream
from arlo.coord.stream import StreamEntry
from services.trainer.core.records import Ack, Acknowledge, CountStale, DeadLetter, Decision, StartCheckpoint
from services.trainer.core.trainer import TrainerCore

log = logging.getLogger(__name__)

READ_COUNT = 256


@dataclass(frozen=True, slots=True)
class Read:
    entries: list[StreamEntry]
    returned_at: float
    """perf_counter() when the read returned."""
    background: bool = False
    """Started during a step: it may have waited for data before the loop asked for it."""


class StreamReader:
    def __init__(self, stream: TrajectoryStream, *, block_ms: int, count: int = READ_COUNT) -> None:
        self.stream, self.block_ms, self.count = stream, block_ms, count
        self._in_flight: asyncio.Task[Read] | None = None

    async def _read(self, block_ms: int, *, background: bool = False) -> Read:
        entries = await self.stream.read(count=self.count, block_ms=block_ms)
        return Read(entries, time.perf_counter(), background)

    async def read(self, *, block: bool) -> Read:
        """The background read's reply if one is in flight (it may still wait up to `block_ms`
        for data), else a read now that waits for data only when `block`."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            return await task
        return await self._read(self.block_ms if block else 0)

    def background(self) -> asyncio.Task[Read]:
        """The read in flight, started now (waiting up to `block_ms` for data) if none is."""
        if self._in_flight is None:
            self._in_flight = asyncio.create_task(self._read(self.block_ms, background=True),
                                                  name="trainer-stream-read")
        return self._in_flight

    def take(self) -> Read:
        """The finished background read's reply (raises its error); the next read starts afresh."""
        task, self._in_flight = self._in_flight, None
        assert task is not None and task.done()
        return task.result()

    async def close(self) -> None:
        """Abandons a read in flight (the loop is stopping or restarting): what Redis delivered to
        it is in this consumer's pending list, and the next `run` re-reads it first."""
        task, self._in_flight = self._in_flight, None
        if task is not None:
            task.cancel()
            await asyncio.wait([task])  # our own cancellation still propagates; the task's error does not
            if not task.cancelled():
                task.exception()  # retrieved, so asyncio does not report it


class StreamSide:
    """`start_checkpoint`: the driver's (a StartCheckpoint decision starts a save)."""

    def __init__(self, stream: TrajectoryStream, core: TrainerCore, *, block_ms: int,
                 start_checkpoint: Callable[[str], Awaitable[None]]) -> None:
        self.stream, self.core, self.start_checkpoint = stream, core, start_checkpoint
        self.reader = StreamReader(stream, block_ms=block_ms)

    @property
    def dead_letters(self) -> str:
        return self.stream.keys.traj_dead

    async def ensure_group(self) -> None:
        await self.stream.ensure_group()

    async def restored(self, trajectory_ids: Sequence[str]) -> None:
        """A checkpoint was restored: what it trained is marked trained (the process may have
        died between the checkpoint completing and its acknowledgements)."""
        await self.stream.mark_trained(trajectory_ids)

    async def own_pending(self, after: str) -> tuple[list[StreamEntry], str | None]:
        """Entries this consumer was given and never acknowledged (a previous process died), a page at a time."""
        return await self.stream.read_own_pending(READ_COUNT, after)

    async def claim_stale(self, min_idle_ms: int) -> list[StreamEntry]:
        """Entries a dead consumer of another name left pending."""
        return await self.stream.claim_stale(min_idle_ms)

    async def backlog(self) -> int:
        return await self.stream.backlog()

    def decode_drops(self) -> dict[str, int]:
        """What the stream itself dropped while decoding (beside the core's own reasons)."""
        return {"stream_malformed": self.stream.malformed, "stream_duplicates": self.stream.duplicates}

    async def admit(self, entries: Sequence[Any], *, version: int, read_at: float = 0.0) -> None:
        """Read entries -> the core: repeats acknowledged, the rest checked against `seen:`, admitted."""
        screened = self.core.book.screen(entries)
        if screened.repeats is not None:
            await self.perform([screened.repeats])
        fresh = await self.stream.filter_unseen(screened.candidates)
        await self.perform(self.core.book.admit(fresh, version=version, read_at=read_at, now=time.time()))

    async def perform(self, decisions: Sequence[Decision]) -> None:
        """Carries out the core's decisions in order; each is reported done once durable."""
        for d in decisions:
            if isinstance(d, Ack):
                if d.entry_ids:
                    await self.stream.ack(list(d.entry_ids))
            elif isinstance(d, DeadLetter):
                if d.items:
                    await self.stream.dead_letter(list(d.items))
            elif isinstance(d, CountStale):
                await self.stream.count_stale(d.n)
            elif isinstance(d, Acknowledge):
                await self._acknowledge(d)
            elif isinstance(d, StartCheckpoint):
                await self.start_checkpoint(d.why)
            self.core.done(d)

    async def _acknowledge(self, d: Acknowledge) -> None:
        try:
            await self.stream.mark_trained([t for s in d.steps for t in s.trajectory_ids])
            await self.stream.ack([e for s in d.steps for e in s.entry_ids])
        except BaseException:
            self.core.holds.put_back(d.steps)  # still unacknowledged: the next decision tries again
            raise
        if d.undurable:
            state = self.core.state
            log.error("checkpoint saves keep failing (%s); %d trajectories acknowledged WITHOUT a checkpoint so "
                      "producers are not stalled by the held backlog (bound %d entries); a crash now loses them",
                      state.checkpoint_error, sum(len(s.trajectory_ids) for s in d.steps),
                      self.core.holds.policy.hold_bound, extra={"acked_undurable": state.acked_undurable})

    async def settle_in_flight(self, floor: int) -> set[str] | None:
        """Tells the in-flight set which groups arrived whole here and how old a batch may take
        (arlo/coord/records.py `settle_in_flight`); the ids still in flight on `floor`, None if Redis failed."""
        arrived = self.core.book.take_arrived()
        try:
            return await self.stream.settle_in_flight(arrived=arrived, floor=floor)
        except (RedisError, OSError) as e:  # not knowing costs at most the groups it would wait for
            self.core.book.untold(arrived)
            log.warning("groups in flight unknown (%s)", e)
            return None
