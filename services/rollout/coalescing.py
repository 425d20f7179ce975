"""Calls that arrive together leave together: the rollout's Generate and Score calls to one
server are coalesced into one GenerateBatch / ScoreBatch.

Why (bench/step_anatomy.py, 596k workload, synchronous, 2 cores): a rollout burst sends its 32
Generate calls within ~2 ms, and its 32 episodes end within a few ms of each other. One call
each, the inference server took the Generates in one by one (~0.7 ms of handling each, on a
core the engine was already using) while the engine ran the first arrivals: the burst paid
4-5 prefills and 11-12 decode chunks where one admission pays 1 and 8. Every call also costs
the rollout's single event loop its share of a millisecond, on the step's critical path.

A call waits until no other call has joined its batch for `window_s` (and at most
`MAX_WINDOWS` windows after the batch's first call), then the batch leaves: a lone call as the
plain RPC, several as one batch call. Each caller gets its own result or error. A caller that
goes away is dropped before its batch leaves; once every caller of a sent batch has gone, the
call is cancelled (inference then frees the requests' slots). A caller that leaves a batch
others still wait on does not free its request early: it runs to its end (a lone call's
request is freed at the next chunk).

The batch call runs in an empty context, so it belongs to no single episode. Traced
(`tracer`), it runs inside a root span of its own (`span_name`: rollout.generate_batch,
rollout.score_batch) linked to the span of each caller it carried, as a StepBatch is.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Generic, TypeVar

from arlo.tracing import current_span_context, span

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext, Tracer

Req = TypeVar("Req")
Res = TypeVar("Res")

MAX_WINDOWS = 8
"""A batch leaves at most this many windows after its first call, however many keep joining."""

Settle = Callable[[int, "Res | BaseException"], None]
"""settle(i, outcome): the result (or error) of the batch's i-th request."""
SendOne = Callable[[Req], Awaitable[Res]]
SendMany = Callable[[list[Req], Settle], Awaitable[None]]
"""Sends a batch and settles each request as its outcome is known; an exception it raises
fails every request it left unsettled."""


@dataclass(eq=False)
class _Batch(Generic[Req, Res]):
    first_at: float
    requests: list[Req] = field(default_factory=list)
    results: list[asyncio.Future[Res]] = field(default_factory=list)
    callers: list[SpanContext | None] = field(default_factory=list)
    contexts: list[contextvars.Context] = field(default_factory=list)
    call: asyncio.Task[None] | None = None


class Coalescer(Generic[Req, Res]):
    """One server's calls of one kind, coalesced (see the module doc)."""

    def __init__(self, send_one: SendOne[Req, Res], send_many: SendMany[Req], *, window_s: float,
                 max_batch: int, tracer: Tracer | None = None, span_name: str = "rollout.batch") -> None:
        if window_s <= 0 or max_batch < 1:
            raise ValueError(f"window_s must be > 0 and max_batch >= 1, got {window_s} and {max_batch}")
        self.send_one, self.send_many = send_one, send_many
        self.tracer, self.span_name = tracer, span_name
        self.window_s, self.max_batch = window_s, max_batch
        self._open: _Batch[Req, Res] | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sent: set[asyncio.Task[None]] = set()
        self.calls = {"single": 0, "batch": 0, "batched_requests": 0}
        """Calls sent, plain and batched, and the requests the batches carried."""

    async def call(self, request: Req) -> Res:
        loop = asyncio.get_running_loop()
        batch = self._open
        if batch is None:
            batch = self._open = _Batch(first_at=loop.time())
        result: asyncio.Future[Res] = loop.create_future()
        batch.requests.append(request)
        batch.results.append(result)
        batch.callers.append(current_span_context(self.tracer))
        batch.contexts.append(contextvars.copy_context())
        result.add_done_callback(lambda f: f.cancelled() and self._caller_gone(batch))
        if self._timer is not None:
            self._timer.cancel()
        if len(batch.requests) >= self.max_batch:
            self._flush()
        else:  # the window restarts with each arrival, up to MAX_WINDOWS after the first
            due = min(loop.time() + self.window_s, batch.first_at + MAX_WINDOWS * self.window_s)
            self._timer = loop.call_at(due, self._flush)
        return await result

    def flush(self) -> None:
        """Sends the open batch now, without waiting out its window."""
        if self._timer is not None:
            self._timer.cancel()
        self._flush()

    async def aclose(self) -> None:
        """Cancels the open batch and those in flight (their callers see CancelledError)."""
        batch, self._open = self._open, None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        for result in batch.results if batch is not None else ():
            result.cancel()
        for task in list(self._sent):
            task.cancel()
        await asyncio.gather(*self._sent, return_exceptions=True)

    def _flush(self) -> None:
        batch, self._open, self._timer = self._open, None, None
        if batch is None:
            return
        live = [entry for entry in zip(batch.requests, batch.results, batch.callers, batch.contexts, strict=True)
                if not entry[1].done()]
        if not live:
            return
        batch.requests, batch.results, batch.callers, batch.contexts = (list(c) for c in zip(*live, strict=True))
        # A batch runs in an empty context: it is no single caller's (its span would nest under the
        # first's). A lone call runs in its own caller's (trace, request id).
        context = batch.contexts[0] if len(batch.requests) == 1 else contextvars.Context()
        batch.call = asyncio.get_running_loop().create_task(self._send(batch), context=context)
        self._sent.add(batch.call)
        batch.call.add_done_callback(self._sent.discard)
        # A call cancelled before it ever ran (aclose) never reaches _send's handlers: its callers
        # must not wait forever.
        batch.call.add_done_callback(lambda _: [f.cancel() for f in batch.results if not f.done()])

    def _caller_gone(self, batch: _Batch[Req, Res]) -> None:
        if batch.call is not None and not batch.call.done() and all(f.done() for f in batch.results):
            batch.call.cancel()

    async def _send(self, batch: _Batch[Req, Res]) -> None:
        def settle(i: int, outcome: Res | BaseException) -> None:
            if 0 <= i < len(batch.results):
                _settle(batch.results[i], outcome)

        try:
            if len(batch.requests) == 1:
                self.calls["single"] += 1
                settle(0, await self.send_one(batch.requests[0]))
            else:
                self.calls["batch"] += 1
                self.calls["batched_requests"] += len(batch.requests)
                links = [c for c in batch.callers if c is not None]
                with span(self.tracer, self.span_name, {"arlo.requests": len(batch.requests)}, links=links):
                    await self.send_many(batch.requests, settle)
        except asyncio.CancelledError:
            for result in batch.results:
                result.cancel()
            raise
        except Exception as e:  # the whole call failed: every request it left unsettled did
            for i in range(len(batch.results)):
                settle(i, e)
        for i, result in enumerate(batch.results):
            if not result.done():
                settle(i, RuntimeError(f"the batch call ended without the result of request {i}"))


async def each_alone(send_one: SendOne[Req, Res], requests: list[Req], settle: Settle,
                     skip: set[int] = frozenset()) -> None:
    """Sends the requests not in `skip` one call each, concurrently, and settles each: what a
    batch call the server refused as a whole (an older server, a message past its limit) falls back to."""
    todo = [i for i in range(len(requests)) if i not in skip]
    outcomes = await asyncio.gather(*(send_one(requests[i]) for i in todo), return_exceptions=True)
    for i, outcome in zip(todo, outcomes, strict=True):
        settle(i, outcome)


def _settle(result: asyncio.Future[Res], outcome: Res | BaseException) -> None:
    if result.done():
        return
    if isinstance(outcome, BaseException):
        result.set_exception(outcome)
    else:
        result.set_result(outcome)
