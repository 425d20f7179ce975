"""Hardening of the process that hosts sandboxes (env_gateway, reward)."""

from __future__ import annotations

import ctypes
import logging

log = logging.getLogger(__name__)

PR_SET_DUMPABLE = 4


def make_undumpable() -> bool:
    """Marks this process non-dumpable: /proc/<pid>/environ and /mem become root-only.

    Where namespaces are refused (a restricted pod) sandboxed code runs as our own uid and
    could otherwise read ARLO_TOKEN from /proc/<gateway pid>/environ. Returns False (and
    logs) where prctl is unavailable (not Linux).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
            log.warning("prctl(PR_SET_DUMPABLE, 0) failed: errno %d", ctypes.get_errno())
            return False
        return True
    except (OSError, AttributeError) as e:
        log.warning("cannot mark the process non-dumpable: %s", e)
        return False
