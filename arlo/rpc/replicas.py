"""Replica resolution for clients that must pick the replica themselves.

Some calls only make sense on one replica: an env_gateway session lives in the memory of the
replica that made it, and an inference replica keeps an episode's KV prefix between turns.
So these clients resolve the target (a headless Service: every ready pod) to addresses,
re-resolve every `refresh_s`, and choose among them: least-loaded placement per episode
(rollout/env_affinity.py) or rendezvous hashing of a key (`ReplicaSet`). Every message names
the service being resolved.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import socket
import time
from collections.abc import Callable

import grpc

log = logging.getLogger(__name__)

REFRESH_S = 30.0


def parse_target(target: str, service: str) -> tuple[str, int] | list[str]:
    """(host, port) to resolve, or a fixed list of "ip:port" (gRPC's `ipv4:a:p,b:q` form)."""
    if target.startswith(("ipv4:", "ipv6:")):
        return [a.strip() for a in target.split(":", 1)[1].split(",") if a.strip()]
    rest = target.removeprefix("dns:")
    if rest.startswith("//"):
        rest = rest[2:].split("/", 1)[-1]  # dns://authority/host:port or dns:///host:port
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"{service} address {target!r}: expected host:port, dns:///host:port or ipv4:a:p,b:q")
    return host.strip("[]"), int(port)


async def resolve(target: str, service: str = "service") -> list[str]:
    """The replicas' "ip:port" addresses, sorted (a headless Service resolves to every ready pod)."""
    parsed = parse_target(target, service)
    if isinstance(parsed, list):
        return sorted(parsed)
    host, port = parsed
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}" for *_, (ip, *_rest) in infos})


class ResolvedTarget:
    """A target's replica addresses, re-resolved every `refresh_s`. A failed re-resolve keeps the
    last good list (a DNS hiccup must not stop the run); with no list yet it is UNAVAILABLE."""

    def __init__(self, target: str, *, service: str, refresh_s: float = REFRESH_S) -> None:
        parse_target(target, service)  # a bad address fails at start, not at the first call
        self.target = target
        self.service = service
        self.refresh_s = refresh_s
        self.current: list[str] = []
        self._resolved_at = -float("inf")

    async def addresses(self) -> list[str]:
        """The current list; the same list object until a re-resolve finds a different one."""
        if time.monotonic() - self._resolved_at < self.refresh_s and self.current:
            return self.current
        try:
            found = await resolve(self.target, self.service)
        except OSError as e:
            if not self.current:
                raise grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                           f"cannot resolve {self.service} address {self.target!r}: {e}") from e
            log.warning("re-resolving %s address %s failed (%s); keeping %d replicas", self.service, self.target, e,
                        len(self.current))
            found = self.current
        if found != self.current:
            log.info("%s replicas: %s", self.service, ", ".join(found))
            self.current = found
        self._resolved_at = time.monotonic()
        return self.current


def rendezvous(key: str, addresses: list[str]) -> str:
    """The address with the highest hash of (key, address): the same key, the same address.

    Stable while the replica set is, spread evenly, and when a replica leaves only its own keys
    move (for inference they only lose their cache: a moved request is still served correctly).
    """
    return max(addresses, key=lambda a: hashlib.blake2b(f"{key}|{a}".encode(), digest_size=8).digest())


class ReplicaSet:
    """One channel per replica of `target`, one replica per key (rendezvous hashing)."""

    def __init__(self, target: str, channel_factory: Callable[[str], grpc.aio.Channel], *, service: str,
                 refresh_s: float = REFRESH_S) -> None:
        self.target = target
        self._resolved = ResolvedTarget(target, service=service, refresh_s=refresh_s)
        self._factory = channel_factory
        self._channels: dict[str, grpc.aio.Channel] = {}

    async def channel(self, key: str = "") -> grpc.aio.Channel:
        """The channel of `key`'s replica (any replica for an empty key)."""
        addresses = await self.addresses()
        return self._channel(rendezvous(key, addresses) if key else addresses[0])

    async def all_channels(self) -> list[grpc.aio.Channel]:
        """One channel per replica the target resolves to now."""
        return [self._channel(address) for address in await self.addresses()]

    def _channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            channel = self._channels[address] = self._factory(address)
        return channel

    async def addresses(self) -> list[str]:
        return await self._resolved.addresses()

    async def aclose(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()
