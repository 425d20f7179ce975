"""Weight versions in shared storage: the trainer writes each version once, every replica reads it.

    {dir}/{version:012d}.full    a full payload, in its envelope (arlo/model/weight_delta.py)
    {dir}/{version:012d}.delta   the elements changed since version - 1

A file is written under a temporary name, flushed to disk and renamed into place, so a reader
sees a whole file or none: a writer killed mid-write leaves only a `.tmp` file, which the next
writer's prune removes. The envelope's body sha256 still guards against a file damaged at rest.

A temporary name carries its writer (host and pid namespace, pid, a random tag): two trainers
of a run can write the same version at once for a moment (one that lost the run while paused,
and its successor), and containers share pids (each trainer is often pid 1). Prune removes only
its own, those of a writer of this host and namespace whose process is gone, and any older than
STALE_TMP_S.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

from arlo.model.weight_delta import KINDS, PayloadKind
from arlo.process_namespace import pid_gone, process_namespace

TMP_SUFFIX = ".tmp"
STALE_TMP_S = 3600.0
"""A temporary file older than this is a dead writer's, whoever wrote it (a version takes seconds)."""


def _writer_tag() -> str:
    """host-namespace_pid_tag: the pid compares only within one boot and pid namespace (two
    containers can share a hostname: host networking, a fixed --hostname)."""
    host = re.sub(r"[^A-Za-z0-9-]", "-", socket.gethostname()) or "host"
    namespace = hashlib.sha256(process_namespace().encode()).hexdigest()[:8]
    return f"{host}-{namespace}_{os.getpid()}_{uuid.uuid4().hex[:8]}"


def _gone(tag: str, own: str) -> bool:
    """Whether the writer a temporary file names is provably not writing it any more."""
    if tag == own:
        return True  # ours, and this writer writes one file at a time: a leftover of a failed write
    parts = tag.split("_")
    if len(parts) == 1 and tag.isdigit():  # an older arlo's name: the pid alone, on this host
        return int(tag) != os.getpid()
    if len(parts) != 3 or not parts[1].isdigit():
        return False
    return parts[0] == own.split("_")[0] and pid_gone(int(parts[1]))  # pids compare within one host and namespace


def storage_dir(uri: str) -> Path:
    """The directory a `file:///dir` URI names; ValueError for any other form."""
    parsed = urlparse(uri)
    if parsed.scheme != "file" or parsed.netloc not in ("", "localhost") or not parsed.path.startswith("/"):
        raise ValueError(f"weight storage {uri!r}: expected file:///absolute/dir")
    return Path(parsed.path)


def version_path(root: Path, version: int, kind: PayloadKind) -> Path:
    return root / f"{version:012d}.{kind}"


def read_version(uri: str, version: int, kind: PayloadKind) -> bytearray:
    """The envelope of `version` as `kind`, read into one buffer (no second copy of a full
    payload); FileNotFoundError when it is not (or no longer) there. Blocking."""
    with open(version_path(storage_dir(uri), version, kind), "rb") as f:
        buf = bytearray(os.fstat(f.fileno()).st_size)
        got = f.readinto(buf)
    if got != len(buf):
        raise OSError(f"version {version} ({kind}): read {got} of {len(buf)} bytes")
    return buf


class VersionFiles:
    """The trainer's side: one atomic write per version, and pruning what no replica needs."""

    def __init__(self, uri: str) -> None:
        self.uri = uri
        self.root = storage_dir(uri)
        self.root.mkdir(parents=True, exist_ok=True)
        self.bytes_written = 0
        self.tag = _writer_tag()

    def write(self, version: int, kind: PayloadKind, *parts: bytes | memoryview) -> Path:
        """Writes the envelope (its parts one after the other: `envelope_parts`) whole or not at
        all. Blocking: run it in a worker thread."""
        final = version_path(self.root, version, kind)
        tmp = final.with_name(f"{final.name}.{self.tag}{TMP_SUFFIX}")
        with open(tmp, "wb") as f:
            for part in parts:
                f.write(part)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, final)
        with contextlib.suppress(OSError):  # the rename made durable where the platform allows it
            fd = os.open(self.root, os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self.bytes_written += sum(len(p) for p in parts)
        return final

    def prune(self, keep_from: int) -> None:
        """Removes the versions older than `keep_from` and dead writers' leftover temporary files
        (the module's docstring). Called with the full version before the newest full: a replica
        one chain behind still finds its way, one further behind starts from the newest full."""
        for path in self.root.iterdir():
            name = path.name
            if name.endswith(TMP_SUFFIX):
                with contextlib.suppress(OSError):  # gone meanwhile: its writer renamed or removed it
                    if _gone(name.split(".")[-2], self.tag) or time.time() - path.stat().st_mtime > STALE_TMP_S:
                        path.unlink(missing_ok=True)
                continue
            stem, _, kind = name.partition(".")
            if kind in KINDS and stem.isdigit() and int(stem) < keep_from:
                path.unlink(missing_ok=True)
