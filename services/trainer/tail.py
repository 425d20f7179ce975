"""A step's tail (its publish, record, log line and acknowledgements), run beside the next step.

After an update the loop still owes the step's publish (serialise, hash, move the pointer: 8-14
ms of a 170-200 ms async step at the 596k workload, issue 17), record (metrics stream,
Prometheus, span file), log line and acknowledgements (several Redis round trips, 13 ms of a
311 ms step), during which nothing trained. The run loop defers them: it copies the weights to
publish (publisher.py `cut`), the next step starts at once and the tail runs while the jitted
update holds a worker thread.

What makes that safe: the step's entries are held (`Durability.hold`) before the tail is
deferred, so a producer's retry of them is a repeat, never a second training; tails run one at
a time, in step order, so records and acknowledgements keep their order; a tail whose step
starts a checkpoint, pauses the loop, or comes while checkpoint saves fail is not deferred (a
checkpoint copies the arrays the next step donates; a pause promises a final status; failing
saves bound the held entries step by step: core/holds.py). A deferred tail that fails keeps its
error here; the loop raises it once the step in flight has published, and its restart
re-reads what is pending (acknowledgements left undone are retried by the next publish or
checkpoint, as after an inline failure).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from arlo.background import MustRestart

log = logging.getLogger(__name__)


class StepTails:
    def __init__(self) -> None:
        self._last: asyncio.Task[None] | None = None
        self.error: Exception | MustRestart | None = None
        """The first deferred tail's failure not yet raised by the loop (a MustRestart wins: the
        run was taken over, a fenced publish or acknowledgement refused)."""

    def defer(self, tail: Coroutine[Any, Any, None], *, on_done: Callable[[float], None]) -> None:
        """Runs `tail` after the tails deferred before it; `on_done(seconds)` with its own time."""
        self._last = asyncio.create_task(self._run(self._last, tail, on_done), name="trainer-step-tail")

    async def _run(self, before: asyncio.Task[None] | None, tail: Coroutine[Any, Any, None],
                   on_done: Callable[[float], None]) -> None:
        if before is not None:
            try:
                await asyncio.wait([before])  # in step order; its failure is already in `error`
            except asyncio.CancelledError:
                tail.close()  # never started: nothing of it ran
                raise
        started = time.perf_counter()
        try:
            await tail
        except Exception as e:
            log.exception("a step's tail (record, acknowledgements) failed; the loop restarts after the step in flight")
            if self.error is None:
                self.error = e
        except MustRestart as e:  # a BaseException: never left in a task nobody reads
            self.error = e
        finally:
            on_done(time.perf_counter() - started)

    async def settle(self, timeout_s: float | None = None) -> None:
        """Returns once every deferred tail is done (or `timeout_s` passed); never raises their errors."""
        if self._last is not None:
            await asyncio.wait([self._last], timeout=timeout_s)

    def take_error(self) -> Exception | MustRestart | None:
        error, self.error = self.error, None
        return error
