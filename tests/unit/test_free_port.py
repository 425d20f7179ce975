"""`free_port` hands out ports for servers that bind them later: never one the kernel may give an
outgoing connection meanwhile (its ephemeral range), never the same one twice, each bindable."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from arlo.app.redis_server import free_port

RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


@pytest.mark.skipif(not RANGE.is_file(), reason="the kernel's ephemeral range is not readable here")
def test_ports_are_below_the_ephemeral_range_distinct_and_bindable() -> None:
    low = int(RANGE.read_text().split()[0])
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    assert all(p < low for p in ports), (low, sorted(ports)[-5:])
    for port in ports[:10]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))

