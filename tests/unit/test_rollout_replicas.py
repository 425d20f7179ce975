"""Inference replica choice for the rollout: one replica per session, spread, stable when the set
changes for everyone but the leaving replica's sessions."""

from __future__ import annotations

from collections import Counter

import grpc

from arlo.rpc.replicas import ReplicaSet, rendezvous

ADDRESSES = [f"10.0.0.{i}:50051" for i in range(1, 5)]


def test_sessions_spread_and_stay_put() -> None:
    keys = [f"episode-{i}" for i in range(4000)]
    placed = {k: rendezvous(k, ADDRESSES) for k in keys}
    counts = Counter(placed.values())
    assert set(counts) == set(ADDRESSES) and min(counts.values()) > 0.2 * len(keys)
    assert all(rendezvous(k, list(reversed(ADDRESSES))) == a for k, a in placed.items())  # order-free
    # A replica leaves: only its own sessions move.
    remaining = ADDRESSES[:-1]
    moved = [k for k in keys if rendezvous(k, remaining) != placed[k]]
    assert moved and all(placed[k] == ADDRESSES[-1] for k in moved)


async def test_a_session_always_gets_its_replicas_channel() -> None:
    made: list[str] = []

    def factory(address: str) -> grpc.aio.Channel:
        made.append(address)
        return grpc.aio.insecure_channel(address)

    replicas = ReplicaSet("ipv4:127.0.0.1:1,127.0.0.1:2", factory, service="inference")
    try:
        first = {k: await replicas.channel(k) for k in ("a", "b", "c", "d", "e", "f")}
        for _ in range(3):
            assert [await replicas.channel(k) for k in first] == list(first.values())
        assert sorted(set(made)) == ["127.0.0.1:1", "127.0.0.1:2"] and len(made) == 2  # one channel per replica
    finally:
        await replicas.aclose()
