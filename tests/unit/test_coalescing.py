"""The rollout's call coalescer, with plain coroutines for the calls (the gRPC sides are covered
by tests/contract/test_inference_batch.py and test_reward.py)."""

from __future__ import annotations

import asyncio

import pytest

from services.rollout.coalescing import MAX_WINDOWS, Coalescer

WINDOW = 0.05


class Server:
    """Records what was sent; answers each request with its double, or fails as told."""

    def __init__(self, *, fail_many: Exception | None = None, skip: int | None = None) -> None:
        self.sent: list[list[int]] = []
        self.fail_many, self.skip = fail_many, skip
        self.release = asyncio.Event()
        self.release.set()

    async def one(self, request: int) -> int:
        self.sent.append([request])
        await self.release.wait()
        return 2 * request

    async def many(self, requests: list[int], settle) -> None:
        self.sent.append(list(requests))
        await self.release.wait()
        if self.fail_many is not None:
            settle(0, 2 * requests[0])
            raise self.fail_many
        for i, r in enumerate(requests):
            if i != self.skip:
                settle(i, 2 * r)


async def test_calls_that_arrive_together_leave_together_and_a_lone_call_goes_plain() -> None:
    server = Server()
    c = Coalescer(server.one, server.many, window_s=WINDOW, max_batch=16)
    assert await asyncio.gather(*(c.call(i) for i in range(5))) == [0, 2, 4, 6, 8]
    assert await c.call(7) == 14
    assert server.sent == [[0, 1, 2, 3, 4], [7]]
    assert c.calls == {"single": 1, "batch": 1, "batched_requests": 5}


async def trickle(c: Coalescer, n: int, gap_s: float) -> list[int]:
    calls = []
    for i in range(n):
        calls.append(asyncio.ensure_future(c.call(i)))
        await asyncio.sleep(gap_s)
    return await asyncio.gather(*calls)


async def test_the_window_restarts_with_each_arrival() -> None:
    server = Server()
    # A wide window: a loaded machine may oversleep a gap, but not by a second.
    c = Coalescer(server.one, server.many, window_s=1.0, max_batch=1000)
    await trickle(c, 4, 0.02)
    assert server.sent == [[0, 1, 2, 3]]


async def test_a_batch_leaves_at_most_max_windows_after_its_first_call() -> None:
    server = Server()
    window = 0.05
    c = Coalescer(server.one, server.many, window_s=window, max_batch=1000)
    n = 4 * MAX_WINDOWS + 4  # a quarter window apart (or more, under load): past MAX_WINDOWS windows
    await trickle(c, n, window / 4)
    assert len(server.sent) >= 2 and sorted(r for b in server.sent for r in b) == list(range(n))


async def test_aclose_cancels_the_open_batch_and_those_in_flight() -> None:
    server = Server()
    server.release.clear()
    c = Coalescer(server.one, server.many, window_s=WINDOW, max_batch=16)
    sent = [asyncio.ensure_future(c.call(i)) for i in range(2)]
    while not server.sent:
        await asyncio.sleep(0.01)
    waiting = asyncio.ensure_future(c.call(9))  # in the open batch, not sent yet
    await asyncio.sleep(0)
    await asyncio.wait_for(c.aclose(), 5)
    outcomes = await asyncio.wait_for(asyncio.gather(*sent, waiting, return_exceptions=True), 5)
    assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
    await asyncio.sleep(2 * WINDOW)
    assert server.sent == [[0, 1]]  # the open batch never left


async def test_a_lone_call_runs_in_its_own_callers_context() -> None:
    import contextvars

    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    seen = []

    async def one(request: int) -> int:
        seen.append(who.get())
        return request

    async def many(requests, settle) -> None:
        seen.append(who.get())
        for i, r in enumerate(requests):
            settle(i, r)

    c = Coalescer(one, many, window_s=WINDOW, max_batch=16)

    async def caller(name: str, request: int) -> int:
        who.set(name)
        return await c.call(request)

    first = asyncio.ensure_future(caller("a", 1))
    await asyncio.sleep(0)
    second = asyncio.ensure_future(caller("b", 2))  # the last arrival schedules the flush
    await asyncio.sleep(0)
    second.cancel()
    assert await first == 1
    await asyncio.gather(*(caller(n, i) for i, n in enumerate("cd")))
    assert seen == ["a", "nobody"]  # the lone call as its caller; a batch as no one


async def test_a_full_batch_leaves_without_waiting() -> None:
    server = Server()
    c = Coalescer(server.one, server.many, window_s=10.0, max_batch=3)
    assert await asyncio.wait_for(asyncio.gather(*(c.call(i) for i in range(3))), 5) == [0, 2, 4]


async def test_a_caller_gone_before_the_batch_leaves_is_not_sent() -> None:
    server = Server()
    c = Coalescer(server.one, server.many, window_s=WINDOW, max_batch=16)
    calls = [asyncio.ensure_future(c.call(i)) for i in range(3)]
    await asyncio.sleep(0)
    calls[1].cancel()
    assert await asyncio.gather(calls[0], calls[2]) == [0, 4]
    assert server.sent == [[0, 2]]


async def test_the_batch_call_is_cancelled_once_all_its_callers_are_gone() -> None:
    server = Server()
    server.release.clear()  # the batch hangs until cancelled
    c = Coalescer(server.one, server.many, window_s=WINDOW, max_batch=16)
    calls = [asyncio.ensure_future(c.call(i)) for i in range(2)]
    while not server.sent:
        await asyncio.sleep(0.01)
    (sent,) = c._sent
    calls[0].cancel()
    await asyncio.sleep(0.01)
    assert not sent.done()  # one caller still waits
    calls[1].cancel()
    await asyncio.gather(*calls, return_exceptions=True)
    await asyncio.sleep(0)
    assert sent.cancelled()


async def test_a_failed_batch_fails_only_what_it_left_unsettled_and_a_missing_result_is_an_error() -> None:
    broken = Server(fail_many=ConnectionError("gone"))
    failing = Coalescer(broken.one, broken.many, window_s=WINDOW, max_batch=16)
    outcomes = await asyncio.gather(*(failing.call(i) for i in (1, 2, 3)), return_exceptions=True)
    assert outcomes[0] == 2 and all(isinstance(o, ConnectionError) for o in outcomes[1:])
    skipping = Server(skip=1)
    c = Coalescer(skipping.one, skipping.many, window_s=WINDOW, max_batch=16)
    outcomes = await asyncio.gather(*(c.call(i) for i in (1, 2, 3)), return_exceptions=True)
    assert outcomes[0] == 2 and outcomes[2] == 6
    assert isinstance(outcomes[1], RuntimeError) and "without the result of request 1" in str(outcomes[1])


def test_bad_settings_are_refused() -> None:
    server = Server.__new__(Server)
    with pytest.raises(ValueError, match="window_s"):
        Coalescer(server.one, server.many, window_s=0, max_batch=1)
    with pytest.raises(ValueError, match="max_batch"):
        Coalescer(server.one, server.many, window_s=1, max_batch=0)
