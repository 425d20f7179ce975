"""Running blocking verifier calls with a deadline, on daemon threads.

A Python thread cannot be killed, so a verifier past its deadline keeps running; what we
control is that (a) the caller gets TIMEOUT at the deadline, (b) the stuck thread is a
daemon thread, so it never blocks process exit (ThreadPoolExecutor and asyncio's default
executor join their threads at exit: one stuck verifier would hang SIGTERM forever), and
(c) stuck threads are counted and capped. Verifiers that can hang for real (code
execution) belong in a subprocess sandbox; this guards the in-process ones.

The daemon threads are kept and reused: a worker that finishes a call waits for the next. A
thread started per call cost ~115 us a call (32 trivial calls: 3.8 ms, against 1.1 ms through
reused threads, on the 2-core dev machine), and a ScoreBatch of 32 items sits on the critical
path of a step. A worker stuck past a deadline is not waited for: the next call starts another.
"""

from __future__ import annotations

import asyncio
import queue
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
        self._jobs: queue.SimpleQueue[tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any], _Job]]
        self._jobs = queue.SimpleQueue()
        self._idle = 0  # workers done with their last call and not yet promised another (under _lock)
        self.threads = 0
        """Worker threads started. They never exit: the count stays at its highest, at most
        max_concurrency + max_stuck."""

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
            self._dispatch((fn, loop, future, job))
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

    def _dispatch(self, item: tuple[Callable[[], Any], asyncio.AbstractEventLoop, asyncio.Future[Any], _Job]) -> None:
        """Queues a call for an idle worker, or starts one. Each queued call is matched by one
        worker that will take a call: an idle one promised here, or the new one."""
        with self._lock:
            start = self._idle == 0
            if start:
                self.threads += 1
            else:
                self._idle -= 1
        if start:
            try:  # started before the call is queued: a failed start leaves no call without its worker
                threading.Thread(target=self._serve, name="verifier", daemon=True).start()
            except BaseException:
                with self._lock:
                    self.threads -= 1
                raise
        self._jobs.put(item)

    def _serve(self) -> None:
        while True:
            fn, loop, future, job = self._jobs.get()
            # A call whose caller gave up before it started is not run (it was counted stuck).
            ok, value = (False, None) if job.abandoned else _call(fn)
            with self._lock:
                job.finished = True
                # Idle before the caller hears back: its slot then goes to a call this worker can take.
                self._idle += 1
                if job.abandoned:
                    self._stuck -= 1
                    continue
            try:
                loop.call_soon_threadsafe(_settle, future, ok, value)
            except RuntimeError:  # the loop closed while we ran
                pass
            finally:
                del fn, loop, future, job, value  # an idle worker holds nothing of its last call


def _call(fn: Callable[[], Any]) -> tuple[bool, Any]:
    try:
        return True, fn()
    except Exception as e:
        return False, e
    except BaseException as e:  # SystemExit & co. must not escape into the event loop
        return False, RuntimeError(f"verifier raised {type(e).__name__}: {e}")
