"""Background loops of a service: restarted with backoff when they fail, cancelled on shutdown."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)


async def keep_running(name: str, body: Callable[[], Awaitable[None]], *, max_backoff_s: float = 10.0,
                       restarts: dict[str, int] | None = None) -> None:
    """Runs `body` until cancelled; an exception is logged with its traceback, counted in
    `restarts[name]`, and `body` restarts after a backoff.

    A Redis or peer outage must not kill a service's main loop; the failure shows in the log
    and in the heartbeat (services report `loop_restarts`), and work resumes when the dependency
    is back. What the body held when it raised is its own to put back (the trainer's step does).
    """
    backoff = 0.5
    while True:
        try:
            await body()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            if restarts is not None:
                restarts[name] = restarts.get(name, 0) + 1
            log.exception("%s failed; restarting in %.1fs", name, backoff,
                          extra={"loop": name, "loop_restarts": restarts.get(name, 0) if restarts else 0})
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, max_backoff_s)


class TaskGroup:
    """Named background tasks that are all cancelled (and awaited) together."""

    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []
        self.restarts: dict[str, int] = {}
        """Restarts after an exception, by task name."""

    def spawn(self, name: str, body: Callable[[], Awaitable[None]]) -> None:
        self._tasks.append(asyncio.create_task(keep_running(name, body, restarts=self.restarts), name=name))

    async def cancel_all(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()
