"""The training loop's reads of new stream entries, one of which may run while a step trains.

A step spends most of its time in the jitted update, on a worker thread; the event loop is idle
then. Reading (XREADGROUP, decode) and grouping the next batch's trajectories in that window
takes the intake off the step's critical path (issue 17: it was 7 ms of a 270 ms step at the
596k workload). A read started during a step is never cancelled when the step ends first: the
entries Redis delivered to it are in this consumer's pending list, and dropping the reply
would leave them there unheld until the next restart re-read them. The loop takes its reply
with its next read instead.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from arlo.coord import TrajectoryStream
from arlo.coord.stream import StreamEntry

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
