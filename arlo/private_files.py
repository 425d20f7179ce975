"""Files that hold secrets (the auth token, a config whose redis.url may carry a password).

Written 0600 from the moment they exist: created with O_CREAT|O_EXCL and mode 0600 under a
temporary name, filled, then renamed over the target, so no reader ever sees a readable
partial file (write-then-chmod left a window a watching local user hit 3 times in 5). Their
directory is made 0700, so the sandbox and other users cannot even list it.
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

FILE_MODE = 0o600
DIR_MODE = 0o700


def arlo_home() -> Path:
    """arlo's own state directory, $ARLO_HOME (default ./.arlo): the token, the resolved config,
    the logs and local checkpoints. Made 0700 by `arlo up`; the gateway never serves files from it."""
    return Path(os.environ.get("ARLO_HOME", ".arlo")).resolve()


def private_dir(path: str | Path) -> Path:
    """Creates `path` (and parents) if needed and makes it 0700."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True, mode=DIR_MODE)
    os.chmod(path, DIR_MODE)  # mkdir's mode is cut by the umask, and an existing dir keeps its own
    return path


def write_private(path: str | Path, data: str | bytes) -> Path:
    """Atomically replaces `path` with `data`, readable and writable by the owner only."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), FILE_MODE)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path
