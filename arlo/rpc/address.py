"""What a service tells others to dial: one rule for every service that advertises itself."""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping

ADVERTISE_ENV = "ARLO_ADVERTISE_HOST"
"""Host others reach this process at (a pod IP on k8s, set from the downward API)."""

_WILDCARDS = ("0.0.0.0", "::", "")


def advertise_host(bind_host: str, env: Mapping[str, str] = os.environ) -> str:
    """$ARLO_ADVERTISE_HOST, else the bind host; a wildcard bind ("0.0.0.0", "::") is no address
    anyone can dial, so it becomes this machine's host name."""
    host = env.get(ADVERTISE_ENV) or bind_host
    return socket.gethostname() if host in _WILDCARDS else host
