"""Episode affinity over env_gateway replicas: every call of an episode reaches the replica that
created its session; concurrent Steps to one replica travel together as one StepBatch.

A gateway session (Reset, then Step after Step, then Close) lives in the memory of one
replica; round-robin over replicas would send most Steps to a replica that never heard of it
(NOT_FOUND). So this client resolves the gateway's headless Service to its pod addresses
(arlo/rpc/replicas.py), keeps one channel per replica, starts each episode (Reset) on the
replica with the fewest of this client's open sessions, and remembers which replica owns each
session id.

Replicas come and go (HPA, rolling updates): the address list is re-resolved every
`refresh_s`, new episodes start only on listed replicas, and a replica that refuses a Reset
(UNAVAILABLE) is skipped for that Reset. An episode whose replica died mid-way fails its Step
with UNAVAILABLE (a RetryableError), which the rollout worker answers by restarting the
episode, and the restart lands on a live replica.

Step coalescing (`max_in_flight`): a Step goes out alone while fewer than `max_in_flight` calls
are in flight to its replica, so a lone episode pays no added latency; Steps that arrive
while the replica is busy wait for the next free call and leave together as one StepBatch.
Many concurrent episodes then cost a few calls per round instead of one each (bench/env.py
`--episodes` measures both ways). 0 turns coalescing off (one Step call per step).

Close does not wait for the gateway: the session is forgotten here at once and its Close sent
in the background (services/rollout/env_closes.py), those that arrive together as one
CloseBatch (one Close each with `max_in_flight` 0); `aclose` sends those still owed before the
channels close.

Traced (`tracer`), a StepBatch carries several episodes' steps, so it belongs to none of their
traces: it runs as a `rollout.step_batch` root span linked to each of those episodes' spans.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import random
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import grpc

from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc.replicas import REFRESH_S, ResolvedTarget
from arlo.tracing import current_span_context, span
from services.rollout.clients import backend_error, reset_result, step_result, translated
from services.rollout.env_closes import SessionCloses
from services.rollout.types import ResetResult, StepResult

if TYPE_CHECKING:
    from opentelemetry.trace import SpanContext, Tracer

log = logging.getLogger(__name__)

DOWN_S = 5.0
"""A replica that refused a Reset (UNAVAILABLE) gets no new episode for this long, unless all did."""
MAX_TRACKED_SESSIONS = 100_000
"""Bounds the session -> replica map when episodes end without Close (the gateway expires those)."""
MAX_BATCH_STEPS = 256
"""The gateway's StepBatch bound (env.proto)."""
CLOSE_DRAIN_S = 2.0
"""`aclose` waits this long at most for the closes still owed."""
_STATUS = {code.value[0]: code for code in grpc.StatusCode}


@dataclass(frozen=True, slots=True)
class _Waiting:
    request: env_pb2.StepRequest
    result: asyncio.Future[StepResult]
    caller: SpanContext | None = None
    """The waiting episode's span (traced only): the batch that carries the step links to it."""


@dataclass(eq=False)
class _Lane:
    """The Steps bound for one replica: how many calls are in flight, and who waits for the next."""

    in_flight: int = 0
    waiting: list[_Waiting] = field(default_factory=list)


class AffinityEnvironmentClient:
    """The agent loop's Environment over several env_gateway replicas, one replica per episode."""

    def __init__(self, target: str, channel_factory: Callable[[str], grpc.aio.Channel], *, timeout_s: float,
                 refresh_s: float = REFRESH_S, max_tracked: int = MAX_TRACKED_SESSIONS, max_in_flight: int = 1,
                 tracer: Tracer | None = None) -> None:
        if max_in_flight < 0:
            raise ValueError(f"max_in_flight: must be >= 0 (0: no coalescing), got {max_in_flight}")
        self.target = target
        self.timeout_s = timeout_s
        self.max_in_flight = max_in_flight
        self.tracer = tracer
        self._factory = channel_factory
        self._resolved = ResolvedTarget(target, service="env_gateway", refresh_s=refresh_s)
        self._max_tracked = max_tracked
        self._addresses: list[str] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._owner: OrderedDict[str, str] = OrderedDict()  # session id -> address, oldest first
        self._open: Counter[str] = Counter()  # this client's open sessions per address
        self._rng = random.Random()
        self._closing: set[asyncio.Task[None]] = set()
        self._down_until: dict[str, float] = {}
        self._lanes: dict[str, _Lane] = {}
        self._batches: set[asyncio.Task[None]] = set()
        self.calls: Counter[str] = Counter()
        """RPCs sent, by method ("Step", "StepBatch", "Close", "CloseBatch"), and the steps and
        closes sent inside batches ("batched_steps", "batched_closes")."""
        self._closes = SessionCloses(lambda address: self._channels.get(address), timeout_s=timeout_s,
                                     coalesce=max_in_flight > 0, calls=self.calls,
                                     on_sent=lambda _: self._drop_unlisted(), tracer=tracer)

    def replica_of(self, session_id: str) -> str | None:
        return self._owner.get(session_id)

    @translated("env_gateway")
    async def reset(self, env_name: str, config_json: str, seed: int) -> ResetResult:
        request = env_pb2.ResetRequest(env_name=env_name, config_json=config_json, seed=seed)
        now = time.monotonic()
        candidates = sorted(await self._replicas(),
                            key=lambda a: (self._down_until.get(a, 0.0) > now, self._open[a], self._rng.random()))
        for i, address in enumerate(candidates):
            self._open[address] += 1  # counted from now: concurrent Resets spread too
            try:
                reply = await self._stub(address).Reset(request, timeout=self.timeout_s)
            except grpc.aio.AioRpcError as e:
                self._release(address)
                if e.code() != grpc.StatusCode.UNAVAILABLE or i == len(candidates) - 1:
                    raise
                log.warning("env_gateway replica %s unavailable for Reset; trying another", address)
                self._down_until[address] = time.monotonic() + DOWN_S
                continue
            self._track(reply.session_id, address)
            return reset_result(reply)
        raise AssertionError("unreachable: _replicas() is never empty")

    @translated("env_gateway")
    async def step(self, session_id: str, action: str) -> StepResult:
        address = self._owner.get(session_id)
        if address is None:
            # Not started here (or forgotten): any replica answers NOT_FOUND unless it owns it.
            replicas = await self._replicas()
            address = replicas[hash(session_id) % len(replicas)]
        else:
            self._owner.move_to_end(session_id)
        request = env_pb2.StepRequest(session_id=session_id, action=action)
        lane = self._lanes.setdefault(address, _Lane())
        if self.max_in_flight and lane.in_flight >= self.max_in_flight:
            waiter: asyncio.Future[StepResult] = asyncio.get_running_loop().create_future()
            lane.waiting.append(_Waiting(request, waiter, current_span_context(self.tracer)))
            return await waiter
        lane.in_flight += 1
        try:
            self.calls["Step"] += 1
            return step_result(await self._stub(address).Step(request, timeout=self.timeout_s))
        finally:
            lane.in_flight -= 1
            self._pump(address, lane)

    def _pump(self, address: str, lane: _Lane) -> None:
        """Sends the waiting Steps (one StepBatch of up to MAX_BATCH_STEPS) while a call is free."""
        while lane.waiting and lane.in_flight < max(self.max_in_flight, 1):
            batch = [w for w in lane.waiting[:MAX_BATCH_STEPS] if not w.result.done()]  # done: caller gave up
            del lane.waiting[:MAX_BATCH_STEPS]
            if not batch:
                continue
            lane.in_flight += 1
            # A context of its own: run from whichever episode's call just ended, the batch would
            # otherwise count as that episode's (its trace, its request id).
            task = asyncio.get_running_loop().create_task(self._send_batch(address, lane, batch),
                                                          context=contextvars.Context())
            self._batches.add(task)  # held until done: a task nobody references may be collected
            task.add_done_callback(self._batches.discard)

    async def _send_batch(self, address: str, lane: _Lane, batch: list[_Waiting]) -> None:
        try:
            self.calls["StepBatch"] += 1
            self.calls["batched_steps"] += len(batch)
            links = [w.caller for w in batch if w.caller is not None]
            with span(self.tracer, "rollout.step_batch", {"arlo.steps": len(batch)}, links=links):
                reply = await self._stub(address).StepBatch(env_pb2.StepBatchRequest(steps=[w.request for w in batch]),
                                                            timeout=self.timeout_s)
            for waiter, result in zip((w.result for w in batch), reply.results, strict=True):
                if waiter.done():
                    continue
                if result.code:
                    waiter.set_exception(backend_error("env_gateway", _STATUS.get(result.code, grpc.StatusCode.UNKNOWN),
                                                       result.message))
                else:
                    waiter.set_result(step_result(result.response))
        except asyncio.CancelledError:  # aclose: the episodes waiting on it end too
            for w in batch:
                w.result.cancel()
            raise
        except Exception as e:  # the whole call failed (or a reply of the wrong length): every step did
            error = backend_error("env_gateway", e.code(), e.details() or "") \
                if isinstance(e, grpc.aio.AioRpcError) else e
            for w in batch:
                if not w.result.done():
                    w.result.set_exception(error)
        finally:
            lane.in_flight -= 1
            self._pump(address, lane)

    async def close(self, session_id: str) -> None:
        """Ends the session without waiting for the gateway's answer (services/rollout/env_closes.py)."""
        address = self._forget(session_id)
        if address is not None:
            self._closes.send(address, session_id)

    async def aclose(self) -> None:
        """Sends the closes still owed (for up to CLOSE_DRAIN_S: the gateway expires the rest),
        then cancels the Steps in flight and closes the channels."""
        await self._closes.drain(CLOSE_DRAIN_S)
        for task in list(self._batches):
            task.cancel()
        await asyncio.gather(*self._batches, return_exceptions=True)
        channels, self._channels = list(self._channels.values()), {}
        await asyncio.gather(*(c.close() for c in channels), return_exceptions=True)

    async def _replicas(self) -> list[str]:
        found = await self._resolved.addresses()
        if found is not self._addresses:  # a new list: close channels of replicas that left
            self._addresses = found
            self._drop_unlisted()
        return self._addresses

    def _stub(self, address: str) -> env_pb2_grpc.EnvironmentStub:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._factory(address)
        return env_pb2_grpc.EnvironmentStub(channel)

    def _track(self, session_id: str, address: str) -> None:
        self._owner[session_id] = address  # its count was taken when its Reset started
        while len(self._owner) > self._max_tracked:
            self._forget(next(iter(self._owner)))

    def _forget(self, session_id: str) -> str | None:
        address = self._owner.pop(session_id, None)
        if address is not None:
            self._release(address)
        return address

    def _release(self, address: str) -> None:
        self._open[address] -= 1
        if self._open[address] <= 0:
            del self._open[address]

    def _drop_unlisted(self) -> None:
        """Closes channels to replicas no longer listed once none of their sessions is open or owes a close."""
        for address in [a for a in self._channels
                        if a not in self._addresses and not self._open[a] and not self._closes.owed(a)]:
            lane = self._lanes.get(address)
            if lane is not None and not lane.in_flight and not lane.waiting:
                del self._lanes[address]
            task = asyncio.get_running_loop().create_task(self._channels.pop(address).close())
            self._closing.add(task)  # held until done: a task nobody references may be collected
            task.add_done_callback(self._closing.discard)
