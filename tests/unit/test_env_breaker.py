"""The remote backends' circuit breaker, on a fake clock."""

from __future__ import annotations

import pytest

from services.env_gateway.breaker import CLOSED, HALF_OPEN, OPEN, CircuitBreaker


def breaker() -> tuple[CircuitBreaker, list[float]]:
    now = [0.0]
    return CircuitBreaker(failures=3, reset_s=10.0, clock=lambda: now[0]), now


def test_opens_after_consecutive_failures_only() -> None:
    b, _ = breaker()
    b.failure("UNAVAILABLE: down")
    b.failure("UNAVAILABLE: down")
    b.success()  # a success in between resets the count
    b.failure("x")
    b.failure("x")
    assert b.state == CLOSED and b.allow() is None
    b.failure("UNAVAILABLE: refused")
    assert b.state == OPEN
    reason = b.allow()
    assert reason is not None
    assert "circuit breaker open after 3 consecutive failures (last: UNAVAILABLE: refused)" in reason
    assert "next try in 10.0s" in reason


def test_half_open_lets_one_probe_through() -> None:
    b, now = breaker()
    for _ in range(3):
        b.failure("down")
    now[0] = 9.9
    assert b.allow() is not None
    now[0] = 10.0
    assert b.rejection() is None and b.state == OPEN  # peeking claims nothing
    assert b.allow() is None and b.state == HALF_OPEN
    assert "a probe call is in flight" in (b.allow() or "")
    b.success()
    assert b.state == CLOSED and b.allow() is None


def test_failed_probe_reopens_for_another_period() -> None:
    b, now = breaker()
    for _ in range(3):
        b.failure("down")
    now[0] = 10.0
    assert b.allow() is None
    b.failure("still down")
    assert b.state == OPEN and "still down" in (b.allow() or "")
    now[0] = 19.9
    assert b.allow() is not None
    now[0] = 20.0
    assert b.allow() is None


def test_abandoned_probe_lets_the_next_call_probe() -> None:
    b, now = breaker()
    for _ in range(3):
        b.failure("down")
    now[0] = 10.0
    assert b.allow() is None
    b.abandon()
    assert b.state == OPEN and b.allow() is None and b.state == HALF_OPEN


def test_bad_settings() -> None:
    with pytest.raises(ValueError):
        CircuitBreaker(failures=0, reset_s=1)
