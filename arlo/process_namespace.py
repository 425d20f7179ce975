"""Which boot and pid namespace this process runs in (a pid names the same process only within one),
and whether a pid of it is gone."""

from __future__ import annotations

import os
from pathlib import Path


def process_namespace() -> str:
    """This boot and pid namespace ('' where unknown): pids compare only within one. Two containers
    with one hostname (host networking, a fixed --hostname) have pids the other cannot see."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}/{os.readlink('/proc/self/ns/pid')}"
    except OSError:
        return ""


def pid_gone(pid: int) -> bool:
    """Whether no process of this pid namespace has `pid` (one of another user's is alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False
