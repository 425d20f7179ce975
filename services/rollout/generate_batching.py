"""Concurrent Generate calls to one inference replica leave together as one GenerateBatch.

Why (bench/step_anatomy.py, 596k workload, synchronous, 2 cores): a rollout burst sends its 32
Generate calls within ~7 ms, but one call each, the server took them in one by one (~0.7 ms of
handling each, on a core the engine was already using) while the engine ran the first arrivals.
A burst then paid 4-5 prefills and 11-12 decode chunks where one admission pays 1 and 8
(services/inference/engine.py, timed with arrivals 0.5-1 ms apart: +30-50 ms per burst).

A call waits until no other call has joined its batch for `window_s` (and at most
`MAX_WINDOWS` windows after the batch's first call), then the batch leaves: a lone call as a
plain Generate, several as one GenerateBatch. Results stream back as each request finishes, so
no call waits for a slower one of its batch, and each has its own status. A caller that goes
away is dropped before its batch leaves; once every caller of a sent batch has gone, the call
is cancelled (the server frees the requests' slots).

The batch call runs in an empty context: traced, it is a root span of its own (it belongs to
no single episode), and each request's episode span still times its wait.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from arlo.proto.v1 import inference_pb2, inference_pb2_grpc
from services.rollout.types import BackendError

MAX_BATCH_REQUESTS = 256
"""GenerateBatch's bound (inference.proto)."""
MAX_WINDOWS = 8
"""A batch leaves at most this many windows after its first call, however many keep joining."""
_STATUS = {code.value[0]: code for code in grpc.StatusCode}

Translate = Callable[[grpc.StatusCode, str], BackendError]


@dataclass(eq=False)
class _Batch:
    requests: list[inference_pb2.GenerateRequest] = field(default_factory=list)
    results: list[asyncio.Future[inference_pb2.GenerateResponse]] = field(default_factory=list)
    first_at: float = 0.0
    call: asyncio.Task[None] | None = None


class GenerateBatcher:
    """Generate over one channel, coalescing the calls that arrive together (see the module doc)."""

    def __init__(self, stub: inference_pb2_grpc.InferenceStub, *, window_s: float, timeout_s: float,
                 translate: Translate) -> None:
        """`translate`: a failed call's status -> the error each of its callers raises."""
        if window_s <= 0:
            raise ValueError(f"window_s: must be > 0, got {window_s}")
        self.stub = stub
        self.window_s = window_s
        self.timeout_s = timeout_s
        self.translate = translate
        self._open: _Batch | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sent: set[asyncio.Task[None]] = set()
        self.calls = {"Generate": 0, "GenerateBatch": 0, "batched_requests": 0}
        """Calls sent by method, and the requests those GenerateBatches carried."""

    async def generate(self, request: inference_pb2.GenerateRequest) -> inference_pb2.GenerateResponse:
        loop = asyncio.get_running_loop()
        batch = self._open
        if batch is None:
            batch = self._open = _Batch(first_at=loop.time())
        result: asyncio.Future[inference_pb2.GenerateResponse] = loop.create_future()
        batch.requests.append(request)
        batch.results.append(result)
        result.add_done_callback(lambda f: f.cancelled() and self._caller_gone(batch))
        if self._timer is not None:
            self._timer.cancel()
        if len(batch.requests) >= MAX_BATCH_REQUESTS:
            self._flush()
        else:  # the window restarts with each arrival, up to MAX_WINDOWS after the first
            due = min(loop.time() + self.window_s, batch.first_at + MAX_WINDOWS * self.window_s)
            self._timer = loop.call_at(due, self._flush)
        return await result

    def _flush(self) -> None:
        batch, self._open, self._timer = self._open, None, None
        if batch is None:
            return
        live = [(r, f) for r, f in zip(batch.requests, batch.results, strict=True) if not f.done()]
        if not live:
            return
        batch.requests, batch.results = [r for r, _ in live], [f for _, f in live]
        # An empty context: the call is no single episode's (its span would nest under the first's).
        batch.call = asyncio.get_running_loop().create_task(self._send(batch), context=contextvars.Context())
        self._sent.add(batch.call)
        batch.call.add_done_callback(self._sent.discard)

    def _caller_gone(self, batch: _Batch) -> None:
        if batch.call is not None and not batch.call.done() and all(f.done() for f in batch.results):
            batch.call.cancel()

    async def _send(self, batch: _Batch) -> None:
        try:
            if len(batch.requests) == 1:
                self.calls["Generate"] += 1
                reply = await self.stub.Generate(batch.requests[0], timeout=self.timeout_s)
                _settle(batch.results[0], reply)
                return
            self.calls["GenerateBatch"] += 1
            self.calls["batched_requests"] += len(batch.requests)
            call = self.stub.GenerateBatch(inference_pb2.GenerateBatchRequest(requests=batch.requests),
                                           timeout=self.timeout_s)
            async for item in call:
                if item.index >= len(batch.results):
                    continue  # a server that numbers past the batch: its callers fail below
                if item.code == grpc.StatusCode.OK.value[0]:
                    _settle(batch.results[item.index], item.response)
                else:
                    code = _STATUS.get(item.code, grpc.StatusCode.UNKNOWN)
                    _settle(batch.results[item.index], self.translate(code, item.message))
            for result in batch.results:
                if not result.done():
                    _settle(result, self.translate(grpc.StatusCode.INTERNAL,
                                                   "the GenerateBatch ended without this request's result"))
        except grpc.aio.AioRpcError as e:
            for result in batch.results:
                if not result.done():
                    _settle(result, self.translate(e.code(), e.details() or ""))
        except asyncio.CancelledError:
            for result in batch.results:
                result.cancel()
            raise


def _settle(result: asyncio.Future[inference_pb2.GenerateResponse],
            outcome: inference_pb2.GenerateResponse | BaseException) -> None:
    if result.done():
        return
    if isinstance(outcome, BaseException):
        result.set_exception(outcome)
    else:
        result.set_result(outcome)
