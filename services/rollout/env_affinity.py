"""Episode affinity over env_gateway replicas: every call of an episode reaches the replica that
created its session.

A gateway session (Reset, then Step after Step, then Close) lives in the memory of one
replica; round-robin over replicas would send most Steps to a replica that never heard of it
(NOT_FOUND). So this client resolves the gateway's headless Service to its pod addresses,
keeps one channel per replica, starts each episode (Reset) on the replica with the fewest of
this client's open sessions, and remembers which replica owns each session id.

Replicas come and go (HPA, rolling updates): the address list is re-resolved every
`refresh_s`, new episodes start only on listed replicas, and a replica that refuses a Reset
(UNAVAILABLE) is skipped for that Reset. An episode whose replica died mid-way fails its Step
with UNAVAILABLE, which the rollout worker answers by restarting the episode (RETRYABLE), and
the restart lands on a live replica.
"""

from __future__ import annotations

import asyncio
import logging
import random
import socket
import time
from collections import Counter, OrderedDict
from collections.abc import Callable

import grpc

from arlo.proto.v1 import env_pb2, env_pb2_grpc

log = logging.getLogger(__name__)

REFRESH_S = 30.0
DOWN_S = 5.0
"""A replica that refused a Reset (UNAVAILABLE) gets no new episode for this long, unless all did."""
MAX_TRACKED_SESSIONS = 100_000
"""Bounds the session -> replica map when episodes end without Close (the gateway expires those)."""


def parse_target(target: str) -> tuple[str, int] | list[str]:
    """(host, port) to resolve, or a fixed list of "ip:port" (gRPC's `ipv4:a:p,b:q` form)."""
    if target.startswith(("ipv4:", "ipv6:")):
        return [a.strip() for a in target.split(":", 1)[1].split(",") if a.strip()]
    rest = target.removeprefix("dns:")
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[-1]  # dns://authority/host:port or dns:///host:port
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"env_gateway address {target!r}: expected host:port, dns:///host:port or ipv4:a:p,b:q")
    return host.strip("[]"), int(port)


async def resolve(target: str) -> list[str]:
    """The replicas' "ip:port" addresses, sorted (a headless Service resolves to every ready pod)."""
    parsed = parse_target(target)
    if isinstance(parsed, list):
        return sorted(parsed)
    host, port = parsed
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for *_, (ip, *_rest) in infos})


class ResolvedTarget:
    """A target's replica addresses, re-resolved every `refresh_s`. A failed re-resolve keeps the
    last good list (a DNS hiccup must not stop the run); with no list yet it is UNAVAILABLE."""

    def __init__(self, target: str, *, role: str, refresh_s: float = REFRESH_S) -> None:
        parse_target(target)  # a bad address fails at start, not at the first episode
        self.target = target
        self.role = role
        self.refresh_s = refresh_s
        self.current: list[str] = []
        self._resolved_at = -float("inf")

    async def addresses(self) -> list[str]:
        """The current list; the same list object until a re-resolve finds a different one."""
        if time.monotonic() - self._resolved_at < self.refresh_s and self.current:
            return self.current
        try:
            found = await resolve(self.target)
        except OSError as e:
            if not self.current:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"cannot resolve {self.role} address {self.target!r}: {e}") from e
            log.warning("re-resolving %s failed (%s); keeping %d replicas", self.target, e, len(self.current))
            found = self.current
        if found != self.current:
            log.info("%s replicas: %s", self.role, ", ".join(found))
            self.current = found
        self._resolved_at = time.monotonic()
        return self.current


class AffinityEnvironmentClient:
    """The agent loop's Environment over several env_gateway replicas, one replica per episode."""

    def __init__(self, target: str, channel_factory: Callable[[str], grpc.aio.Channel], *, timeout_s: float,
                 refresh_s: float = REFRESH_S, max_tracked: int = MAX_TRACKED_SESSIONS) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self._factory = channel_factory
        self._resolved = ResolvedTarget(target, role="env_gateway", refresh_s=refresh_s)
        self._max_tracked = max_tracked
        self._addresses: list[str] = []
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._owner: OrderedDict[str, str] = OrderedDict()  # session id -> address, oldest first
        self._open: Counter[str] = Counter()  # this client's open sessions per address
        self._rng = random.Random()
        self._closing: set[asyncio.Task[None]] = set()
        self._down_until: dict[str, float] = {}

    def replica_of(self, session_id: str) -> str | None:
        return self._owner.get(session_id)

    async def reset(self, env_name: str, config_json: str, seed: int) -> env_pb2.ResetResponse:
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
            return reply
        raise AssertionError("unreachable: _replicas() is never empty")

    async def step(self, session_id: str, action: str) -> env_pb2.StepResponse:
        address = self._owner.get(session_id)
        if address is None:
            # Not started here (or forgotten): any replica answers NOT_FOUND unless it owns it.
            replicas = await self._replicas()
            address = replicas[hash(session_id) % len(replicas)]
        else:
            self._owner.move_to_end(session_id)
        request = env_pb2.StepRequest(session_id=session_id, action=action)
        return await self._stub(address).Step(request, timeout=self.timeout_s)

    async def close(self, session_id: str) -> None:
        address = self._forget(session_id)
        if address is None:
            return
        try:
            await self._stub(address).Close(env_pb2.CloseRequest(session_id=session_id), timeout=self.timeout_s)
        except grpc.aio.AioRpcError:
            pass  # the gateway expires idle sessions anyway; closing is a courtesy
        self._drop_unlisted()

    async def aclose(self) -> None:
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
        """Closes channels to replicas no longer listed once none of their sessions is open."""
        for address in [a for a in self._channels if a not in self._addresses and not self._open[a]]:
            task = asyncio.get_running_loop().create_task(self._channels.pop(address).close())
            self._closing.add(task)  # held until done: a task nobody references may be collected
            task.add_done_callback(self._closing.discard)
