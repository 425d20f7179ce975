"""One control group per sandboxed call: memory and process count bound over the whole tree.

RLIMIT_AS is per process and RLIMIT_NPROC per uid, so eight forked children each held their own
256 MiB (issue 16: 1.6 GiB under a "256 MiB" limit). A cgroup charges every process of the call
together: `memory_mb` is the total, `max_processes` the total count. cgroup v2 (memory.max,
pids.max under /sys/fs/cgroup/arlo-sandbox) or v1 (memory/ and pids/ hierarchies) where this
process may create groups (root, or a delegated subtree); elsewhere `open_group` returns None
and the run keeps the rlimits alone, the weaker bound (max_processes x memory_mb in total),
logged once.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger("arlo.sandbox")

ROOT = Path("/sys/fs/cgroup")
PARENT = "arlo-sandbox"
_MIB = 1 << 20
CHAIN_TASKS = 4
"""Tasks of the chain itself in the group (unshare or setpriv/bwrap and their pid 1, the trampoline):
the program's allowance comes on top, as RLIMIT_NPROC's does."""


@dataclass(frozen=True, slots=True)
class Layout:
    version: int
    memory: Path
    """Where this call's memory group is created (its parent)."""
    pids: Path


def _v2() -> Layout | None:
    controllers = ROOT / "cgroup.controllers"
    if not controllers.is_file() or not {"memory", "pids"} <= set(controllers.read_text().split()):
        return None
    base = ROOT / PARENT
    base.mkdir(exist_ok=True)
    (ROOT / "cgroup.subtree_control").write_text("+memory +pids")
    (base / "cgroup.subtree_control").write_text("+memory +pids")
    return Layout(2, base, base)


def _v1() -> Layout | None:
    memory, pids = ROOT / "memory", ROOT / "pids"
    if not (memory / "cgroup.procs").is_file() or not (pids / "cgroup.procs").is_file():
        return None
    for hierarchy in (memory, pids):
        (hierarchy / PARENT).mkdir(exist_ok=True)
    return Layout(1, memory / PARENT, pids / PARENT)


@functools.cache
def layout() -> Layout | None:
    """The cgroup hierarchy usable here, probed once; None: rlimits only."""
    for probe in (_v2, _v1):
        try:
            found = probe()
        except OSError as exc:
            found = None
            logger.debug("sandbox: cgroup v%s not usable: %s", 2 if probe is _v2 else 1, exc)
        if found is not None:
            return found
    logger.warning("sandbox: no writable cgroup hierarchy; memory_mb and max_processes bound each process "
                   "(RLIMIT_AS) and the uid (RLIMIT_NPROC), not the tool call's processes together")
    return None


class CallGroup:
    """The cgroup(s) of one call: adopt the chain's tree before it runs code, kill and remove after."""

    def __init__(self, lay: Layout, memory_mb: int, max_processes: int) -> None:
        self.layout = lay
        name = f"call-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.memory, self.pids = lay.memory / name, lay.pids / name
        self.dirs = [self.memory] if self.memory == self.pids else [self.memory, self.pids]
        for d in self.dirs:
            d.mkdir()
        limit = memory_mb * _MIB
        if lay.version == 2:
            (self.memory / "memory.max").write_text(str(limit))
            if (self.memory / "memory.swap.max").exists():
                (self.memory / "memory.swap.max").write_text("0")
        else:
            (self.memory / "memory.limit_in_bytes").write_text(str(limit))
            memsw = self.memory / "memory.memsw.limit_in_bytes"
            if memsw.exists():
                memsw.write_text(str(limit))  # no swap beyond the limit
        (self.pids / "pids.max").write_text(str(max_processes + CHAIN_TASKS))

    def adopt(self, root_pid: int) -> None:
        """Moves `root_pid` and every descendant in; later forks of any of them are born inside.
        The chain is still waiting for its spec on stdin, so it runs nothing meanwhile; a scan that
        finds no one outside closes the race with a fork between two moves."""
        for _ in range(20):
            outside = [p for p in (root_pid, *_descendants(root_pid)) if p not in self.tasks()]
            if not outside:
                return
            for pid in outside:
                for d in self.dirs:
                    try:
                        (d / "cgroup.procs").write_text(str(pid))
                    except ProcessLookupError:
                        pass

    def tasks(self) -> set[int]:
        try:
            return {int(x) for x in (self.pids / "cgroup.procs").read_text().split()}
        except OSError:
            return set()

    def oom_killed(self) -> bool:
        """True when the group's memory limit was hit (a process was OOM-killed or refused memory)."""
        try:
            if self.layout.version == 2:
                events = dict(line.split() for line in (self.memory / "memory.events").read_text().splitlines())
                return int(events.get("oom_kill", 0)) > 0 or int(events.get("max", 0)) > 0
            control = dict(line.split() for line in (self.memory / "memory.oom_control").read_text().splitlines())
            if "oom_kill" in control:
                return int(control["oom_kill"]) > 0
            return int((self.memory / "memory.failcnt").read_text()) > 0
        except (OSError, ValueError):
            return False

    def close(self) -> None:
        """Kills whatever of the call is left (setsid daemons too) and removes the group."""
        for _ in range(50):
            left = self.tasks()
            if not left:
                break
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.02)
        for d in self.dirs:
            for _ in range(50):
                try:
                    d.rmdir()
                    break
                except FileNotFoundError:
                    break
                except OSError:
                    time.sleep(0.02)  # the killed tasks are still exiting
            else:
                logger.warning("sandbox: could not remove cgroup %s", d)


def open_group(memory_mb: int, max_processes: int) -> CallGroup | None:
    lay = layout()
    if lay is None:
        return None
    try:
        return CallGroup(lay, memory_mb, max_processes)
    except OSError as exc:
        logger.warning("sandbox: could not create the call's cgroup (%s); rlimits only", exc)
        return None


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        children.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(entry))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out
