"""Untrusted code, run without Docker: a fresh process per run under rlimits, as an
unprivileged uid, in new namespaces (no network, own pids, private /tmp) where permitted."""

from arlo.sandbox.result import STATUSES, SandboxError, SandboxResult
from arlo.sandbox.runner import Sandbox

__all__ = ["STATUSES", "Sandbox", "SandboxError", "SandboxResult"]
