"""Running blocking verifier calls with a deadline, on daemon threads.

A Python thread cannot be killed, so a verifier past its deadline keeps running; what we
control is that (a) the caller gets TIMEOUT at the deadline, (b) the stuck thread is a
daemon thread, so it never blocks process exit (ThreadPoolExecutor and asyncio's default
executor join their threads at exit: one stuck verifier would hang SIGTERM forever), and
(c) stuck threads are counted and capped. Verifiers that can hang for real (code
execution) belong in a subprocess sandbox; this guards the in-process ones.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")


class DeadlineExceeded(TimeoutError):
    """The call ran past its deadline (distinct from a TimeoutError the call itself raised)."""


class RunnerSaturated(RuntimeError):
    """Too many earlier calls are still stuck past their deadlines."""


class _Job:
    __slots__ = ("abandoned", "finished")

    def __init__(self) -> None:
        self.abandoned = False
        self.finished = False


def _settle(future: asyncio.Future[Any], ok: bool, value: Any) -> None:
    if future.done():  # the waiter timed out or was cancelled
        return
    if ok:
        future.set_result(value)
    else:
        future.set_exception(value)


class DeadlineRunner:
    """At most `max_concurrency` calls run at once; each deadline starts when its call starts,
    so a large batch queued behind others does not time out for waiting."""

    def __init__(self, *, max_concurrency: int = 8, max_stuck: int = 64) -> None:
        if max_concurrency < 1 or max_stuck < 1:
            raise ValueError("max_concurrency and max_stuck must be >= 1")
        self._slots = asyncio.Semaphore(max_concurrency)
        self._max_stuck = max_stuck
        self._stuck = 0
        self._lock = threading.Lock()

    @property
    def stuck(self) -> int:
        """Threads still running a call whose caller gave up (deadline or cancellation)."""
        with self._lock:
            return self._stuck

    async def run(self, fn: Callable[[], T], timeout_s: float) -> T:
        """fn()'s result; raises DeadlineExceeded past `timeout_s`, RunnerSaturated, or fn's exception."""
        async with self._slots:
            if self.stuck >= self._max_stuck:
                raise RunnerSaturated(f"{self._max_stuck} earlier verifier calls are still running past their "
                                      "deadlines; refusing new work until they finish")
            loop = asyncio.get_running_loop()
            future: asyncio.Future[T] = loop.create_future()
            job = _Job()
            thread = threading.Thread(target=self._work, args=(fn, loop, future, job), name="verifier", daemon=True)
            thread.start()
            try:
                return await asyncio.wait_for(future, timeout_s)
            except BaseException as e:
                with self._lock:
                    if not job.finished:
                        job.abandoned = True
                        self._stuck += 1
                if isinstance(e, TimeoutError) and future.cancelled():
                    raise DeadlineExceeded(f"call ran past its deadline of {timeout_s:g}s") from None
                raise

    def _work(self, fn: Callable[[], Any], loop: asyncio.AbstractEventLoop,
              future: asyncio.Future[Any], job: _Job) -> None:
        try:
            ok, value = True, fn()
        except Exception as e:
            ok, value = False, e
        except BaseException as e:  # SystemExit & co. must not escape into the event loop
            ok, value = False, RuntimeError(f"verifier raised {type(e).__name__}: {e}")
        with self._lock:
            job.finished = True
            if job.abandoned:
                self._stuck -= 1
                return
        try:
            loop.call_soon_threadsafe(_settle, future, ok, value)
        except RuntimeError:  # the loop closed while we ran
            pass
