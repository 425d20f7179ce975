"""The isolation kinds and the exec'd chain each one starts.

- "bwrap": bubblewrap, started already as the unprivileged uid (setpriv drops it first when
  we are root), so its user namespace maps that uid and nothing of root's. New net, pid, ipc,
  uts, user and cgroup namespaces; `/` read-only; fresh tmpfs for /tmp and over HIDDEN_DIRS.
- "unshare": util-linux `unshare` as root: new net, pid (with its own /proc), mount, ipc and
  uts namespaces; the trampoline, pid 1 there, mounts the tmpfs, makes `/` read-only and
  drops to the uid itself. Killing the chain's process group ends the whole namespace.
- "none": the trampoline alone (a child subreaper): rlimits and the uid drop (when root),
  but the host's network and file system: configured explicitly, or "auto" where namespaces
  are refused (with a warning).

Every kind ends in the trampoline (`trampoline.py`), which sets the rlimits and starts the
program, so the limits are the same everywhere.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, get_args

from arlo.choices import Isolation as IsolationChoice

KINDS = tuple(k for k in get_args(IsolationChoice) if k != "auto")
"""The concrete kinds, best first (the config's choices less "auto")."""
WORKDIR_IN_NAMESPACE = "/tmp"
HIDDEN_DIRS = ("/root", "/home", "/run", "/var/tmp", "/mnt", "/media", "/srv")
"""Covered by an empty read-only tmpfs inside the namespaces: secrets live in places like these
(/run/secrets, a home's dotfiles), and /run holds sockets (docker.sock)."""
TMP_SIZE_FACTOR = 4
"""The private /tmp is a tmpfs of this many times file_size_mb: one file hits RLIMIT_FSIZE (EFBIG)
before the tmpfs is full, and the total a run can write is bounded."""
_MIB = 1 << 20
_TOOL_PATH = "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin"


@dataclass(frozen=True, kw_only=True, slots=True)
class Isolation:
    kind: str
    """"bwrap" | "unshare" | "none"."""
    tools: tuple[str, ...] = ()
    """Absolute paths of the wrappers the chain starts with (resolved once, at the probe)."""

    @property
    def pid_namespace(self) -> bool:
        """SIGKILL to the chain's process group ends every process of the run."""
        return self.kind != "none"


def find_tools(kind: str) -> tuple[str, ...] | None:
    """The wrappers `kind` needs, or None when one is not installed."""
    names = {"bwrap": ("bwrap", "setpriv"), "unshare": ("unshare",), "none": ()}[kind]
    paths = tuple(shutil.which(name, path=_TOOL_PATH) or "" for name in names)
    if not all(paths):
        return None
    return paths


def candidates(requested: str) -> tuple[str, ...]:
    """The kinds to try, best first; "auto" ends with "none" (the caller warns when it gets there)."""
    if requested == "auto":
        return KINDS if find_tools("bwrap") else ("unshare", "none")
    if requested not in KINDS:
        raise ValueError(f"isolation must be one of auto, {', '.join(KINDS)}; got {requested!r}")
    return (requested,)


def tmpfs_plan(file_size_mb: int, python: str) -> list[dict[str, Any]]:
    """The fresh file systems of a namespaced run (the trampoline or bwrap mounts them)."""
    interpreter = os.path.realpath(python)
    plan: list[dict[str, Any]] = [
        {"path": "/tmp", "bytes": TMP_SIZE_FACTOR * file_size_mb * _MIB, "mode": "0700", "owned": True,
         "readonly": False},
        {"path": "/dev/shm", "bytes": file_size_mb * _MIB, "mode": "1777", "owned": False, "readonly": False},
    ]
    for path in HIDDEN_DIRS:
        if interpreter.startswith(path + "/"):
            continue  # never hide the interpreter itself (a python under /home, say)
        plan.append({"path": path, "bytes": 4096, "mode": "0755", "owned": False, "readonly": True})
    return plan


def _bwrap_args(bwrap: str, plan: list[dict[str, Any]]) -> list[str]:
    args = [bwrap, "--unshare-all", "--die-with-parent", "--new-session", "--cap-drop", "ALL",
            "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc"]
    for m in plan:
        if not os.path.isdir(m["path"]) or os.path.islink(m["path"]):
            continue
        args += ["--perms", m["mode"], "--size", str(m["bytes"]), "--tmpfs", m["path"]]
        if m["readonly"]:
            args += ["--remount-ro", m["path"]]
    return args


def chain(iso: Isolation, *, uid: int, plan: list[dict[str, Any]], python: str, trampoline: str) -> list[str]:
    """argv of the exec'd chain that ends in the trampoline."""
    tail = [python, "-I", "-S", "-B", "-c", trampoline]
    if iso.kind == "unshare":
        (unshare,) = iso.tools
        return [unshare, "--net", "--pid", "--fork", "--kill-child", "--mount", "--mount-proc", "--ipc",
                "--uts", "--", *tail]
    if iso.kind == "bwrap":
        bwrap, setpriv = iso.tools
        drop = [setpriv, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "--"] if os.geteuid() == 0 else []
        return [*drop, *_bwrap_args(bwrap, plan), "--", *tail]
    return tail


def choose(requested: str, probe: Callable[[Isolation], str | None]) -> tuple[Isolation, dict[str, str]]:
    """The first candidate whose probe passes, and why the ones before it failed.

    Raises RuntimeError when none passes (an explicit kind that is refused here fails loudly).
    """
    refused: dict[str, str] = {}
    for kind in candidates(requested):
        tools = find_tools(kind)
        if tools is None:
            refused[kind] = "not installed"
            continue
        iso = Isolation(kind=kind, tools=tools)
        reason = probe(iso)
        if reason is None:
            return iso, refused
        refused[kind] = reason
    raise RuntimeError("; ".join(f"{kind}: {why}" for kind, why in refused.items()))
