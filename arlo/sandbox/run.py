"""One sandboxed run: a fresh process, started, fed, capped, classified.

A run is an exec'd chain (see isolation.py) ending in the trampoline (trampoline.py), which
applies the limits and starts the program; here we only feed stdin, read the capped
outputs, and turn what happened into a `SandboxResult`. Nothing runs between fork and exec
in this (threaded) process: `subprocess` with `start_new_session` does that part in C.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from arlo.sandbox import cgroup
from arlo.sandbox import isolation as iso_mod
from arlo.sandbox.isolation import Isolation
from arlo.sandbox.pipes import Captured, pump
from arlo.sandbox.result import RunFacts, SandboxResult, classify

if TYPE_CHECKING:
    from arlo.config import SandboxConfig

logger = logging.getLogger("arlo.sandbox")

PROGRAM = "main.py"
"""The program's file name in the private temp dir (`files` may not use it)."""
_GRACE_S = 1.5
"""The parent's backstop fires this long after the wall timeout (the trampoline's own timer
normally ends the run first)."""
_CHAIN_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "LANG": "C.UTF-8"}
"""The whole environment of the chain: nothing of the service's (tokens, URLs) is passed on."""
_NOFILE = 256


@dataclass(frozen=True, kw_only=True, slots=True)
class Limits:
    """The parts of SandboxConfig a run needs (the probe uses its own)."""

    cpu_seconds: int = 5
    memory_mb: int = 512
    file_size_mb: int = 16
    max_processes: int = 32
    wall_timeout_s: float = 10.0
    uid: int = 65534
    max_output_bytes: int = 65536

    @classmethod
    def of(cls, cfg: SandboxConfig) -> Limits:
        return cls(cpu_seconds=cfg.cpu_seconds, memory_mb=cfg.memory_mb, file_size_mb=cfg.file_size_mb,
                   max_processes=cfg.max_processes, wall_timeout_s=cfg.wall_timeout_s, uid=cfg.uid,
                   max_output_bytes=cfg.max_output_bytes)

    def rlimits(self, *, tasks_now: int = 0) -> dict[str, tuple[int, int]]:
        """`tasks_now`: tasks the run's uid has already (RLIMIT_NPROC counts them all)."""
        mib = 1 << 20
        nproc = self.max_processes + tasks_now
        return {
            # The hard limit one second later: SIGXCPU first (a clear cause), SIGKILL if it is caught.
            "cpu": (self.cpu_seconds, self.cpu_seconds + 1),
            "as": (self.memory_mb * mib, self.memory_mb * mib),
            "fsize": (self.file_size_mb * mib, self.file_size_mb * mib),
            "nproc": (nproc, nproc),
            "nofile": (_NOFILE, _NOFILE),
            "core": (0, 0),
        }


@functools.cache
def trampoline_source() -> str:
    return (Path(__file__).parent / "trampoline.py").read_text()


def _spec(iso: Isolation, lim: Limits, *, python: str, workdir: str, status_fd: int, code: str,
          files: Mapping[str, str], args: Sequence[str]) -> dict[str, Any]:
    tmpdir = iso_mod.WORKDIR_IN_NAMESPACE if iso.pid_namespace else workdir
    return {
        "status_fd": status_fd, "uid": lim.uid, "workdir": workdir, "wall_timeout_s": lim.wall_timeout_s,
        "mount": iso.kind == "unshare", "readonly_root": True,
        "tmpfs": iso_mod.tmpfs_plan(lim.file_size_mb, python),
        "files": {PROGRAM: code, **files}, "limits": lim.rlimits(tasks_now=tasks_of(run_uid(lim.uid))),
        # -E/-s: no PYTHON* variables, no user site; the script's dir (the temp dir) stays on sys.path.
        "argv": [python, "-E", "-s", "-B", "-X", "utf8", PROGRAM, *args],
        "env": {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": workdir, "TMPDIR": tmpdir, "LANG": "C.UTF-8"},
    }


def run_uid(uid: int) -> int:
    """The real uid the program runs as: the configured one when we are root, else ours."""
    return uid if os.geteuid() == 0 else os.geteuid()


def tasks_of(uid: int) -> int:
    """Tasks (threads included) whose real uid is `uid`, host-wide: what RLIMIT_NPROC counts.

    Counted here, not in the sandbox, whose pid namespace hides the other runs. The limit is
    then max_processes *more* than this, so concurrent runs (and, when we cannot drop to
    another uid, the service's own threads) do not use up a program's allowance.
    """
    uid_line, total = f"\nUid:\t{uid}\t", 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as f:
                status = f.read()
        except OSError:
            continue  # exited meanwhile
        if uid_line in status:
            threads = status.partition("\nThreads:\t")[2].partition("\n")[0]
            total += int(threads) if threads.isdigit() else 1
    return total


def _host_workdir(uid: int) -> str:
    """The private temp dir of a run without a mount namespace, owned by the uid that runs in it."""
    path = tempfile.mkdtemp(prefix="arlo-sandbox-")
    if os.geteuid() == 0 and uid != 0:
        os.chown(path, uid, uid)
    return path


def _remove(path: str) -> None:
    def make_writable(func: Any, p: str, exc: Any) -> None:
        # Only matters when not root: the program may have left a dir without write/search bits.
        os.chmod(os.path.dirname(p), 0o700)
        if os.path.isdir(p) and not os.path.islink(p):
            os.chmod(p, 0o700)
        func(p)
    try:
        shutil.rmtree(path, onerror=make_writable)
    except OSError as exc:  # never mask the run's result; say so, loudly
        logger.warning("sandbox: could not remove the temp dir %s: %s", path, exc)


def _read_report(fd: int) -> dict[str, Any] | None:
    os.set_blocking(fd, False)
    data = b""
    try:
        while chunk := os.read(fd, 65536):
            data += chunk
    except BlockingIOError:
        pass
    try:
        report = json.loads(data)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _stopper(proc: subprocess.Popen[bytes], iso: Isolation) -> Callable[[], None]:
    def stop() -> None:
        try:
            if iso.pid_namespace:
                os.killpg(proc.pid, signal.SIGKILL)  # kills the chain, and with it the whole pid namespace
            else:
                # The trampoline kills its tree (setsid daemons too) and reports; SIGKILL would
                # orphan them.
                os.kill(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    return stop


def _kill_chain(proc: subprocess.Popen[bytes]) -> None:
    """Last resort, when the chain did not end after a stop."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def execute(iso: Isolation, lim: Limits, *, python: str, code: str, stdin: str = "",
            files: Mapping[str, str] | None = None, args: Sequence[str] = ()) -> SandboxResult:
    """One run, start to finish; never raises for anything the program does."""
    host_dir = None if iso.pid_namespace else _host_workdir(lim.uid)
    try:
        return _run(iso, lim, python=python, workdir=host_dir or iso_mod.WORKDIR_IN_NAMESPACE, code=code,
                    stdin=stdin, files=files or {}, args=args)
    finally:
        if host_dir is not None:
            _remove(host_dir)


def _run(iso: Isolation, lim: Limits, *, python: str, workdir: str, code: str, stdin: str,
         files: Mapping[str, str], args: Sequence[str]) -> SandboxResult:
    status_r, status_w = os.pipe()
    (in_r, in_w), (out_r, out_w), (err_r, err_w) = os.pipe(), os.pipe(), os.pipe()
    spec = _spec(iso, lim, python=python, workdir=workdir, status_fd=status_w, code=code, files=files, args=args)
    spec_bytes = json.dumps(spec).encode()
    argv = iso_mod.chain(iso, uid=lim.uid, plan=spec["tmpfs"], python=python, trampoline=trampoline_source())
    start = time.monotonic()
    try:
        proc = subprocess.Popen(argv, stdin=in_r, stdout=out_w, stderr=err_w, pass_fds=(status_w,),
                                close_fds=True, start_new_session=True, env=_CHAIN_ENV, cwd="/")
    except OSError as exc:
        for fd in (in_r, in_w, out_r, out_w, err_r, err_w, status_r, status_w):
            os.close(fd)
        return _failed(f"could not start the sandbox ({argv[0]}): {exc}", time.monotonic() - start)
    for fd in (in_r, out_w, err_w, status_w):  # the child's ends: EOF reaches us only once these are closed
        os.close(fd)
    # Before the spec goes in (the chain runs nothing until then): the call's processes together
    # are bounded by memory_mb and max_processes, not each one (cgroup.py).
    group = cgroup.open_group(lim.memory_mb, lim.max_processes)
    if group is not None:
        group.adopt(proc.pid)
    try:
        captured = pump(stdin_fd=in_w, stdout_fd=out_r, stderr_fd=err_r,
                        payload=b"%010d" % len(spec_bytes) + spec_bytes + stdin.encode(),
                        cap=lim.max_output_bytes, deadline=start + lim.wall_timeout_s + _GRACE_S,
                        stop=_stopper(proc, iso))
    finally:
        try:
            proc.wait(timeout=_GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_chain(proc)
        report = _read_report(status_r)
        os.close(status_r)
        oom = group is not None and group.oom_killed()
        if group is not None:
            group.close()
    return _result(captured, report, lim, wall_s=time.monotonic() - start, returncode=proc.returncode, oom=oom)


def _result(captured: Captured, report: dict[str, Any] | None, lim: Limits, *, wall_s: float,
            returncode: int, oom: bool = False) -> SandboxResult:
    stdout = captured.stdout.decode("utf-8", "replace")
    stderr = captured.stderr.decode("utf-8", "replace")
    status, exit_code, sig = classify(RunFacts(report=report, flooded=captured.flooded,
                                               backstop=captured.backstop, cpu_seconds=lim.cpu_seconds,
                                               stderr=stderr, group_oom=oom))
    if oom:
        stderr = (f"{stderr}\n[sandbox] the call's processes together reached memory_mb "
                  f"({lim.memory_mb} MiB)").lstrip("\n")
    if status == "sandbox_error":
        why = (report or {}).get("error") or f"the sandbox chain exited with {returncode}"
        stderr = f"{stderr}\n[sandbox] {why}".lstrip("\n")
    return SandboxResult(status=status, exit_code=exit_code, signal=sig, stdout=stdout, stderr=stderr,
                         wall_s=wall_s, truncated=captured.flooded)


def _failed(why: str, wall_s: float) -> SandboxResult:
    return SandboxResult(status="sandbox_error", exit_code=None, signal=None, stdout="",
                         stderr=f"[sandbox] {why}", wall_s=wall_s, truncated=False)
