"""Opening a file a user named: only a regular file, refused before it is opened otherwise.

Opening a named pipe (FIFO) for reading blocks until something writes to it: one under a dataset
root hung that Reset, and every dataset Reset queued behind it, for minutes. A character device
(/dev/zero, a tty) reads for ever or has side effects on open. So the path is stat'ed first and
anything but a regular file is a ValueError saying what it is; the open itself is non-blocking and
checked again on the open descriptor, so a file swapped for a pipe in between is refused too.
"""

from __future__ import annotations

import fcntl
import os
import stat
from pathlib import Path
from typing import BinaryIO

_KINDS = ((stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"), (stat.S_ISDIR, "a directory"))


def kind(mode: int) -> str:
    """What a non-regular file is, in words."""
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def check_regular(path: str | Path, st: os.stat_result | None = None) -> os.stat_result:
    """`path`'s stat (following symlinks); ValueError unless it is a regular file. OSError when it
    cannot be stat'ed (missing, no permission)."""
    st = os.stat(path) if st is None else st
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{str(path)!r} is {kind(st.st_mode)}, not a regular file: only regular files are read")
    return st


def open_regular(path: str | Path) -> BinaryIO:
    """`path` opened for binary reading when it is a regular file (ValueError before any open
    otherwise; OSError when it cannot be opened)."""
    check_regular(path)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    try:
        check_regular(path, os.fstat(fd))  # swapped for a pipe since the stat: refused, never read
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular_text(path: str | Path, *, errors: str = "strict", max_bytes: int | None = None) -> str:
    """The UTF-8 text of the regular file at `path` (see open_regular); ValueError past `max_bytes`."""
    with open_regular(path) as f:
        if max_bytes is not None and os.fstat(f.fileno()).st_size > max_bytes:
            raise ValueError(f"{str(path)!r} is larger than {max_bytes} bytes")
        return f.read().decode("utf-8", errors=errors)
