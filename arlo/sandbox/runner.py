"""`Sandbox`: untrusted Python in a fresh, limited, isolated process per run, without Docker.

The isolation is chosen once per process (per interpreter and uid) by running a tiny
program through each candidate chain; what is used is logged, and a fallback to limits
only ("none") is a warning, once.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from arlo.sandbox import isolation as iso_mod
from arlo.sandbox.isolation import Isolation
from arlo.sandbox.result import SandboxError, SandboxResult
from arlo.sandbox.run import PROGRAM, Limits, execute, run_uid

if TYPE_CHECKING:
    from arlo.config import SandboxConfig

logger = logging.getLogger("arlo.sandbox")

_PROBE_CODE = ("import json, os\n"
               "with open('/proc/net/dev') as f:\n"
               "    ifaces = [line.split(':')[0].strip() for line in f.readlines()[2:]]\n"
               "print(json.dumps({'uid': os.getuid(), 'ifaces': ifaces}))\n")
_PROBE_LIMITS = Limits(wall_timeout_s=20.0)
# Deliberately per process: a probe starts subprocesses, and its verdict does not change while
# we run. The lock makes concurrent first Sandboxes share one probe (and one warning).
_resolved: dict[tuple[str, str, int], Isolation] = {}
_resolve_lock = threading.Lock()


def _probe(iso: Isolation, python: str, uid: int) -> str | None:
    """None when `iso` works here: the program ran, as the expected uid, and (namespaced) saw only lo."""
    result = execute(iso, dataclasses.replace(_PROBE_LIMITS, uid=uid), python=python, code=_PROBE_CODE)
    if not result.ok:
        return " ".join(f"{result.status}: {result.stderr or result.stdout}".split())[-400:]
    seen = json.loads(result.stdout)
    want_uid = run_uid(uid)
    if seen["uid"] != want_uid:
        return f"the program ran as uid {seen['uid']}, not {want_uid}"
    if iso.pid_namespace and seen["ifaces"] != ["lo"]:
        return f"the network is not isolated (interfaces {seen['ifaces']})"
    return None


def resolve_isolation(requested: str, python: str, uid: int) -> Isolation:
    """The isolation to use, probed once per process. Raises SandboxError when nothing works."""
    key = (requested, python, uid)
    with _resolve_lock:
        if key not in _resolved:
            _resolved[key] = _choose(requested, python, uid)
        return _resolved[key]


def _choose(requested: str, python: str, uid: int) -> Isolation:
    try:
        iso, refused = iso_mod.choose(requested, lambda candidate: _probe(candidate, python, uid))
    except RuntimeError as exc:
        hint = f"; the interpreter must be executable by uid {uid}" if python in str(exc) else ""
        raise SandboxError(f"sandbox isolation {requested!r} does not work here ({exc}){hint}") from None
    who = f"uid {uid}" if os.geteuid() == 0 else f"the service's own uid {os.geteuid()} (not root: no uid drop)"
    if iso.kind == "none" and requested == "auto":
        logger.warning("sandbox: namespaces are refused here (%s); untrusted code runs with rlimits only, "
                       "as %s, with the host's network and file system",
                       "; ".join(f"{k}: {v}" for k, v in refused.items()), who)
    else:
        logger.info("sandbox: isolation %s (python %s, %s)", iso.kind, python, who)
    return iso


class Sandbox:
    """Runs Python programs under SandboxConfig's limits; thread-safe, one process per run."""

    def __init__(self, cfg: SandboxConfig, *, python: str = "/usr/bin/python3") -> None:
        self._limits = Limits.of(cfg)
        self._python = python
        self._iso = resolve_isolation(cfg.isolation, python, cfg.uid)
        self.isolation: str = self._iso.kind
        """What is actually used: "bwrap" | "unshare" | "none"."""

    def run_python(self, code: str, *, stdin: str = "", files: Mapping[str, str] | None = None,
                   args: Sequence[str] = ()) -> SandboxResult:
        """Runs `code` as main.py in a fresh private temp dir (its cwd), `files` written beside it.

        Blocks until the program ends or a limit ends it; never raises for what the program does.
        """
        files = dict(files or {})
        for name in files:
            _check_name(name)
        for arg in args:
            if "\0" in arg:
                raise ValueError("args may not contain NUL characters")
        return execute(self._iso, self._limits, python=self._python, code=code, stdin=stdin, files=files,
                       args=tuple(args))


def _check_name(name: str) -> None:
    if not name or "/" in name or "\0" in name or name in (".", ".."):
        raise ValueError(f"file name {name!r}: must be a plain name (no '/', not '.' or '..')")
    if name == PROGRAM:
        raise ValueError(f"file name {name!r} is the program's own; pick another")
