"""Background loops of a service: restarted with backoff when they fail, cancelled on shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


class MustRestart(BaseException):
    """The process's in-memory state can no longer be trusted (the trainer's weights went
    non-finite, or another trainer took its run): restarting the loop in place would carry the
    damage on. The process stops and its restart (the supervisor's, Kubernetes') recovers from
    durable state: the newest good checkpoint and the stream's unacknowledged entries.
    A BaseException, like CancelledError: no `except Exception` retry on the way may swallow it."""


async def keep_running(name: str, body: Callable[[], Awaitable[None]], *, max_backoff_s: float = 10.0,
                       restarts: dict[str, int] | None = None,
                       on_fatal: Callable[[MustRestart], None] | None = None) -> None:
    """Runs `body` until cancelled; an exception is logged with its traceback, counted in
    `restarts[name]`, and `body` restarts after a backoff.

    A Redis or peer outage must not kill a service's main loop; the failure shows in the log
    and in the heartbeat (services report `loop_restarts`), and work resumes when the dependency
    is back. What the body held when it raised is its own to put back (the trainer's step does).
    A `MustRestart` is not restarted: it is logged and handed to `on_fatal` (which stops the process).
    """
    backoff = FIRST_BACKOFF_S
    while True:
        started = asyncio.get_running_loop().time()
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except MustRestart as e:
            log.critical("%s cannot go on in this process: %s; stopping for a restart from durable state", name, e,
                         extra={"loop": name, "must_restart": str(e)})
            if on_fatal is not None:
                on_fatal(e)
            return
        except Exception:
            backoff = restart_delay(backoff, asyncio.get_running_loop().time() - started, max_backoff_s)
            if restarts is not None:
                restarts[name] = restarts.get(name, 0) + 1
            log.exception("%s failed; restarting in %.1fs", name, backoff,
                          extra={"loop": name, "loop_restarts": restarts.get(name, 0) if restarts else 0})
            await asyncio.sleep(backoff)
            backoff *= 2


FIRST_BACKOFF_S = 0.5


def restart_delay(backoff: float, ran_s: float, max_backoff_s: float) -> float:
    """The wait before restarting a body that failed after running `ran_s`: doubling (`backoff`
    is the doubled previous wait) up to `max_backoff_s`, and back to the first after a run longer
    than 2 x `max_backoff_s` (an isolated failure, not a run of them: it doubled for the life of
    the process, and a lease's renewal loop let the lease lapse that way)."""
    if ran_s > 2 * max_backoff_s:
        backoff = FIRST_BACKOFF_S
    return min(backoff, max_backoff_s)


class TaskGroup:
    """Named background tasks that are all cancelled (and awaited) together."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []
        self.restarts: dict[str, int] = {}
        """Restarts after an exception, by task name."""
        self.fatal: MustRestart | None = None
        """The first task that stopped with MustRestart: the service must exit and be restarted."""
        self.on_fatal: Callable[[MustRestart], None] | None = None
        """Called once with it (the service's main stops its server, then exits non-zero)."""

    def spawn(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        self._tasks.append(asyncio.create_task(
            keep_running(name, body, restarts=self.restarts, on_fatal=self._fatal), name=name))

    def _fatal(self, error: MustRestart) -> None:
        if self.fatal is None:
            self.fatal = error
            if self.on_fatal is not None:
                self.on_fatal(error)

    async def cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
