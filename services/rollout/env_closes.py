"""Closes of env_gateway sessions, sent off the episode's path.

Why (bench/step_anatomy.py, 596k workload, synchronous): a burst's 32 episodes end together,
and their 32 awaited Close calls put ~25 ms on the step's critical path, between the last Step
and the Score. Closing is a courtesy (the gateway expires idle sessions), so nothing needs its
answer: a close is handed over here and the episode goes on. Closes to one replica that arrive
within `CLOSE_WINDOW_S` of each other leave as one CloseBatch (services/rollout/coalescing.py);
a replica that answers CloseBatch with UNIMPLEMENTED (a gateway from before it, a proxy) gets
one Close each for the next `REPROBE_S`, then is offered CloseBatch again: a gateway upgraded in
place behind the same address batches again without a rollout restart. A failed close is logged
at debug level.

While closes to a replica are owed, its channel must stay open (`owed`): the env client keeps a
replica that left the address list until they are sent. `drain` sends every close still owed
at once and waits for them, within a bound, before the client closes its channels.

Traced, a CloseBatch is a `rollout.close_batch` root span linked to the episodes it closed; a
lone Close stays its episode's child.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from arlo.proto.v1 import env_pb2, env_pb2_grpc
from services.rollout.coalescing import Coalescer, Settle, each_alone

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger(__name__)

MAX_BATCH_CLOSES = 256
"""The gateway's CloseBatch bound (env.proto)."""
CLOSE_WINDOW_S = 0.002
"""Closes to one replica that arrive within this of each other leave as one CloseBatch. Nobody
waits for a close, so the window costs no episode anything."""
REPROBE_S = 60.0
"""How long a replica that refused CloseBatch (UNIMPLEMENTED) gets lone Closes before it is
offered a CloseBatch again: one refused call a minute, off every episode's path, against a
gateway that stays unbatched for the rest of the run once it is upgraded."""


class SessionCloses:
    """The closes owed to the gateway replicas, sent in the background (see the module doc)."""

    def __init__(self, channel_of: Callable[[str], grpc.aio.Channel | None], *, timeout_s: float, coalesce: bool,
                 calls: Counter[str], on_sent: Callable[[str], None], tracer: Tracer | None = None,
                 reprobe_s: float = REPROBE_S) -> None:
        self._channel_of = channel_of
        """The open channel to a replica, or None once the client has dropped it."""
        self.timeout_s = timeout_s
        self.coalesce = coalesce
        self.tracer = tracer
        self._calls = calls
        self._on_sent = on_sent
        """Called with the replica's address after each close ends, sent or not."""
        self._owed: Counter[str] = Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._coalescers: dict[str, Coalescer[str, None]] = {}
        self.reprobe_s = reprobe_s
        self._without_batch: dict[str, float] = {}
        """Replicas that refused CloseBatch, with when (loop time) to offer it again."""

    def owed(self, address: str) -> int:
        """Closes handed over for `address` and not yet ended."""
        return self._owed[address]

    def send(self, address: str, session_id: str) -> None:
        self._owed[address] += 1
        task = asyncio.get_running_loop().create_task(self._close(address, session_id))
        self._tasks.add(task)  # held until done: a task nobody references may be collected
        task.add_done_callback(self._tasks.discard)

    async def drain(self, timeout_s: float) -> None:
        """Sends every close owed now (open batches leave at once, and closes handed over
        meanwhile too) and waits up to `timeout_s` for them; cancels what is left after that."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while self._tasks and (left := deadline - loop.time()) > 0:
            for coalescer in list(self._coalescers.values()):
                coalescer.flush()
            await asyncio.wait(set(self._tasks), timeout=min(left, 0.05))
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _close(self, address: str, session_id: str) -> None:
        try:
            if not self.coalesce or not self._may_batch(address):
                await self._close_one(address, session_id)
            else:
                coalescer = self._coalescers.get(address)
                if coalescer is None:
                    coalescer = self._coalescers[address] = Coalescer(
                        functools.partial(self._close_one, address), functools.partial(self._close_many, address),
                        window_s=CLOSE_WINDOW_S, max_batch=MAX_BATCH_CLOSES, tracer=self.tracer,
                        span_name="rollout.close_batch")
                await coalescer.call(session_id)
        except Exception as e:  # a courtesy: the gateway expires the session anyway
            log.debug("closing env_gateway session %s on %s failed: %r", session_id, address, e)
        finally:
            self._owed[address] -= 1
            if self._owed[address] <= 0:
                del self._owed[address]
                self._coalescers.pop(address, None)  # none of its batches is open: all were owed
            self._on_sent(address)

    def _may_batch(self, address: str) -> bool:
        reprobe_at = self._without_batch.get(address)
        if reprobe_at is None:
            return True
        if asyncio.get_running_loop().time() < reprobe_at:
            return False
        del self._without_batch[address]
        return True

    async def _close_one(self, address: str, session_id: str) -> None:
        channel = self._channel_of(address)
        if channel is not None:  # None: the client is closed
            self._calls["Close"] += 1
            await env_pb2_grpc.EnvironmentStub(channel).Close(env_pb2.CloseRequest(session_id=session_id),
                                                              timeout=self.timeout_s)

    async def _close_many(self, address: str, session_ids: list[str], settle: Settle) -> None:
        channel = self._channel_of(address)
        if channel is not None:
            self._calls["CloseBatch"] += 1
            self._calls["batched_closes"] += len(session_ids)
            try:
                await env_pb2_grpc.EnvironmentStub(channel).CloseBatch(
                    env_pb2.CloseBatchRequest(session_ids=session_ids), timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                if e.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                self._without_batch[address] = asyncio.get_running_loop().time() + self.reprobe_s
                await each_alone(functools.partial(self._close_one, address), session_ids, settle)
                return
        for i in range(len(session_ids)):
            settle(i, None)  # a session the gateway could not close expires there: nothing to do
