"""Inference replicas for the rollout: one channel per replica, one replica per episode.

The engine keeps an episode's KV prefix between turns (sessions), but only on the replica that
served its last turn; round-robin would spread an episode's turns over replicas and prefill
the whole conversation again on each. So the rollout resolves the inference target (a
headless Service: every ready pod) and sends all of an episode's requests to one replica,
chosen by rendezvous hashing of the session id: stable while the replica set is, spread
evenly, and when a replica leaves only its own episodes move (and only lose their cache:
a moved request is still served correctly).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import grpc

from services.rollout.env_affinity import REFRESH_S, ResolvedTarget


def rendezvous(key: str, addresses: list[str]) -> str:
    """The address with the highest hash of (key, address): the same key, the same address."""
    return max(addresses, key=lambda a: hashlib.blake2b(f"{key}|{a}".encode(), digest_size=8).digest())


class ReplicaSet:
    def __init__(self, target: str, channel_factory: Callable[[str], grpc.aio.Channel], *,
                 refresh_s: float = REFRESH_S) -> None:
        self.target = target
        self._resolved = ResolvedTarget(target, role="inference", refresh_s=refresh_s)
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
