"""What one sandboxed run produced, and how the raw facts map onto a status."""

from __future__ import annotations

import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

_SIGKILL, _SIGXCPU = int(signal.SIGKILL), int(signal.SIGXCPU)  # plain ints in results, not enum members
STATUSES = ("ok", "error", "timeout", "cpu_limit", "memory_limit", "output_limit", "killed", "sandbox_error")

# What an allocation failure under RLIMIT_AS looks like on stderr: Python's MemoryError, and C
# code that reports ENOMEM or aborts.
_MEMORY_MARKERS = ("MemoryError", "Cannot allocate memory", "out of memory", "std::bad_alloc")


class SandboxError(RuntimeError):
    """The sandbox itself cannot run code here (not the program's fault)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class SandboxResult:
    status: str
    """One of STATUSES: "ok" (exit 0), "error" (nonzero exit), "timeout" (wall clock),
    "cpu_limit", "memory_limit", "output_limit" (output flood, killed), "killed" (another
    signal), "sandbox_error" (the sandbox failed; stderr says why)."""
    exit_code: int | None
    signal: int | None
    stdout: str
    """UTF-8 (undecodable bytes replaced), cut to max_output_bytes."""
    stderr: str
    wall_s: float
    truncated: bool
    """Output was cut (the program wrote more than max_output_bytes to stdout or stderr)."""

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass(frozen=True, kw_only=True, slots=True)
class RunFacts:
    """What the parent observed of one run, before classification."""

    report: Mapping[str, Any] | None
    """The trampoline's JSON report; None when it never wrote one."""
    flooded: bool
    """Output passed the cap and the run was stopped."""
    backstop: bool
    """The parent's own deadline (wall timeout plus a grace) fired: the trampoline did not end it."""
    cpu_seconds: int
    stderr: str
    group_oom: bool = False
    """The call's cgroup hit its memory limit (all its processes together; cgroup.py)."""


def _memory_failure(stderr: str) -> bool:
    tail = stderr[-2000:]
    return any(marker in tail for marker in _MEMORY_MARKERS)


def classify(facts: RunFacts) -> tuple[str, int | None, int | None]:
    """(status, exit_code, signal) of a run; the most specific cause wins."""
    report = facts.report
    if facts.flooded:
        return "output_limit", None, _SIGKILL
    if facts.backstop or (report is not None and report.get("timeout")):
        return "timeout", None, _SIGKILL
    if report is None:
        return "sandbox_error", None, None
    if report.get("error"):
        return "sandbox_error", None, None
    code, sig = report.get("exit_code"), report.get("signal")
    if sig is not None:
        if sig == _SIGXCPU or (sig == _SIGKILL and report.get("cpu_s", 0.0) >= facts.cpu_seconds):
            return "cpu_limit", None, sig
        if facts.group_oom or _memory_failure(facts.stderr):  # OOM-killed, or an abort() after a failed allocation
            return "memory_limit", None, sig
        return "killed", None, sig
    if code == 0:
        return "ok", 0, None
    if code is None:
        return "sandbox_error", None, None
    return ("memory_limit" if facts.group_oom or _memory_failure(facts.stderr) else "error"), code, None
