"""A circuit breaker for one remote backend. Pure (the clock is injected), so its states are
tested without a network.

closed: calls go through; `failures` consecutive failures open it.
open: calls fail fast for `reset_s`, so a dead backend costs callers microseconds, not timeouts.
half-open: after `reset_s`, one probe call goes through; success closes, failure re-opens.
"""

from __future__ import annotations

import time
from collections.abc import Callable

CLOSED, OPEN, HALF_OPEN = "closed", "open", "half_open"


class CircuitBreaker:
    def __init__(self, *, failures: int, reset_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        if failures < 1 or reset_s <= 0:
            raise ValueError("failures must be >= 1 and reset_s > 0")
        self.failures = failures
        self.reset_s = reset_s
        self._clock = clock
        self._state = CLOSED
        self._consecutive = 0
        self._opened_at = 0.0
        self._last_error = ""
        self._probing = False

    @property
    def state(self) -> str:
        return self._state

    def rejection(self) -> str | None:
        """Why a call must fail fast now, or None. Does not change state (see `allow`)."""
        if self._state == CLOSED:
            return None
        wait = self._opened_at + self.reset_s - self._clock()
        if self._state == OPEN and wait <= 0:
            return None
        retry = f"next try in {wait:.1f}s" if self._state == OPEN else "a probe call is in flight"
        return (f"circuit breaker open after {self._consecutive} consecutive failures "
                f"(last: {self._last_error}); {retry}")

    def allow(self) -> str | None:
        """Like `rejection`, but claims the half-open probe: the caller must then report
        `success`, `failure` or `abandon`."""
        reason = self.rejection()
        if reason is None and self._state == OPEN:
            self._state, self._probing = HALF_OPEN, True
        return reason

    def success(self) -> None:
        self._state, self._consecutive, self._probing = CLOSED, 0, False

    def failure(self, error: str) -> None:
        self._consecutive += 1
        self._last_error = error
        if self._state == HALF_OPEN or self._consecutive >= self.failures:
            self._state, self._opened_at, self._probing = OPEN, self._clock(), False

    def abandon(self) -> None:
        """The call ended without a verdict (the caller went away): let the next call probe."""
        if self._state == HALF_OPEN and self._probing:
            self._state, self._opened_at, self._probing = OPEN, self._clock() - self.reset_s, False
