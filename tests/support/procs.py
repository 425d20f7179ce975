"""The live processes, read from /proc (Linux): for tests that check what a command leaves behind."""

from __future__ import annotations

from pathlib import Path


def processes() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, command line) of every live process (zombies excluded)."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] != "Z":
            out[int(entry.name)] = (int(fields[1]), cmdline)
    return out


def children_of(parent: int) -> list[int]:
    """The live processes whose parent is `parent`."""
    return [pid for pid, (ppid, _) in processes().items() if ppid == parent]


def gone(pids: list[int]) -> bool:
    """None of `pids` is alive (a zombie counts as gone: it only waits to be reaped)."""
    alive = processes()
    return not any(p in alive for p in pids)
