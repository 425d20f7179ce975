"""A report file the user names (`--json PATH`): checked before a run spends anything, written whole.

What the path names is what gets written: a symlink is written through (its target gets the
report, the link stays), a device or a pipe (`/dev/stdout`, a shell's `>(...)`) is written in
place, and a regular file is replaced atomically (a temporary file in the same folder, then a
rename), keeping its permission bits. An attack on the first version of this (a rename over the
path) replaced a symlink with a file and, as root, `/dev/null` with a regular file.
"""

from __future__ import annotations

import os
import stat
import tempfile
import uuid
from pathlib import Path

PARTIAL_PREFIX, PARTIAL_SUFFIX = ".arlo-", ".partial"
"""The temporary file's name: short, so a target name of up to NAME_MAX bytes still has one."""


def _in_place(path: str) -> bool:
    """The path (links followed) names something that is neither a regular file nor a folder."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def report_path_problem(path: str, flag: str = "--json") -> str | None:
    """Why `path` could not take the report at the end of a run (None: it can).

    It probes what the write will do: a temporary file is created and removed in the target's
    folder, so a name too long, a read-only or pseudo filesystem (/proc, /sys), or a folder
    without write permission are found before the run, not after it."""
    if path.endswith(os.sep):
        return f"{flag} {path} names a folder (it ends with {os.sep})"
    if os.path.isdir(path):
        return f"{flag} {path} is a folder"
    if _in_place(path):
        return None if os.access(path, os.W_OK) else f"{flag} {path} is not writable"
    target = Path(os.path.realpath(path))
    if not target.parent.is_dir():
        return f"{flag} {path}: no folder {target.parent}"
    if os.path.exists(target) and not os.access(target, os.W_OK):
        return f"{flag} {path} is not writable"
    existed = os.path.exists(target)  # (never raises: a name too long is found by the probe below)
    try:
        fd, probe = tempfile.mkstemp(dir=target.parent, prefix=PARTIAL_PREFIX, suffix=PARTIAL_SUFFIX)
        os.close(fd)
        os.unlink(probe)
        if not existed:  # the name itself: too long for the filesystem, refused by its rules
            open(target, "x").close()
            target.unlink()
    except OSError as e:
        return f"{flag} {path} cannot be written: {e.strerror or e}"
    return None


def write_report(path: str, text: str) -> None:
    """Writes `text` to what `path` names (see the module's docstring); OSError when it cannot."""
    if _in_place(path):
        with open(path, "w") as out:
            out.write(text)
        return
    target = Path(os.path.realpath(path))
    mode = stat.S_IMODE(target.stat().st_mode) if target.exists() else None
    partial = target.parent / f"{PARTIAL_PREFIX}{uuid.uuid4().hex[:16]}{PARTIAL_SUFFIX}"
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # a new file's mode: 0o666 less the umask
    try:
        with os.fdopen(fd, "w") as out:
            out.write(text)
            out.flush()
            os.fsync(out.fileno())
        if mode is not None:  # the file it replaces keeps its permission bits
            os.chmod(partial, mode)
        os.replace(partial, target)  # whole or absent, even if the process dies while writing
    except BaseException:
        Path(partial).unlink(missing_ok=True)
        raise
