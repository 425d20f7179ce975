"""The sandbox's own init. Runs *inside* the isolation, on the sandbox interpreter, stdlib only.

The parent starts it as `python3 -I -S -B -c <this file's source>` at the end of an exec'd
chain (never `preexec_fn`: that is unsafe in a threaded gRPC server), so this is the first
code of ours that runs in the new namespaces. It reads a JSON spec from stdin (a 10-digit
length, then the JSON; the bytes after it are the program's stdin), mounts the private
file systems when asked (the unshare case, where it runs as root), forks the program, and
in the child drops to the unprivileged uid, writes the files, sets the rlimits and execs
the interpreter. The parent half waits with a wall-clock timer of its own (so the limit
holds even if the service dies), then kills every process the program left behind and
writes one JSON report to the status fd, which the program never holds.

Keep it compatible with older interpreters (no 3.10+ syntax at run time): the sandbox
interpreter is configurable and is not the service's.
"""

from __future__ import annotations

import ctypes
import json
import os
import resource
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36
PR_SET_NO_NEW_PRIVS = 38
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_REMOUNT, MS_BIND = 1, 2, 4, 32, 4096
SPEC_HEADER_BYTES = 10
_RLIMITS = {"cpu": resource.RLIMIT_CPU, "as": resource.RLIMIT_AS, "fsize": resource.RLIMIT_FSIZE,
            "nproc": resource.RLIMIT_NPROC, "nofile": resource.RLIMIT_NOFILE, "core": resource.RLIMIT_CORE}


class _Stop(Exception):
    """Raised from a signal handler to break out of the wait (wall clock, or the parent asked)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


def _libc() -> ctypes.CDLL:
    return ctypes.CDLL(None, use_errno=True)


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _read_exact(fd: int, n: int) -> bytes:
    # os.read, not a buffered reader: the bytes after the spec are the program's stdin.
    chunks = []
    while n:
        chunk = os.read(fd, n)
        if not chunk:
            raise EOFError("the spec ended early")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_spec(fd: int = 0) -> dict:
    size = int(_read_exact(fd, SPEC_HEADER_BYTES))
    return json.loads(_read_exact(fd, size))


def target_uid(spec: dict) -> int:
    return spec["uid"] if os.geteuid() == 0 else os.geteuid()


def setup_mounts(libc: ctypes.CDLL, spec: dict) -> None:
    """Fresh tmpfs mounts (the private temp dir, empty covers over host dirs), then `/` read-only.

    `unshare --mount` already made propagation private, so none of this reaches the host.
    """
    uid = target_uid(spec)
    for m in spec["tmpfs"]:
        if not os.path.isdir(m["path"]) or os.path.islink(m["path"]):
            continue
        owner = uid if m["owned"] else 0
        opts = f"size={m['bytes']},mode={m['mode']},uid={owner},gid={owner}"
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if m["readonly"] else 0)
        _check(libc.mount(b"tmpfs", m["path"].encode(), b"tmpfs", flags, opts.encode()), "mount " + m["path"])
    if spec["readonly_root"]:
        _check(libc.mount(b"none", b"/", None, MS_REMOUNT | MS_BIND | MS_RDONLY, None), "remount / read-only")


def drop_privileges(uid: int) -> None:
    if os.geteuid() != 0 or uid == 0:
        return  # not root: already as unprivileged as we can make it
    os.setgroups([])
    os.setresgid(uid, uid, uid)  # the uid's own number as gid (65534 is nogroup)
    os.setresuid(uid, uid, uid)


def set_limits(limits: dict) -> None:
    for name, (soft, hard) in limits.items():
        res = _RLIMITS[name]
        cur_hard = resource.getrlimit(res)[1]
        if cur_hard != resource.RLIM_INFINITY:
            hard = min(hard, cur_hard)  # an unprivileged process cannot raise a hard limit
        resource.setrlimit(res, (min(soft, hard), hard))


def write_files(files: dict) -> None:
    for name, text in files.items():
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)


def child(spec: dict, libc: ctypes.CDLL, errpipe_w: int) -> None:
    """Never returns: execs the program or reports why it could not on errpipe_w (close-on-exec)."""
    try:
        os.close(spec["status_fd"])
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):
            signal.signal(sig, signal.SIG_DFL)  # Python ignores these; as subprocess's restore_signals does
        drop_privileges(spec["uid"])
        _check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        os.setpgid(0, 0)  # its own process group: one atomic killpg reaches all but setsid escapees
        os.umask(0o077)
        os.chdir(spec["workdir"])
        write_files(spec["files"])
        set_limits(spec["limits"])
        os.closerange(3, errpipe_w)
        os.closerange(errpipe_w + 1, 1 << 16)
        os.execve(spec["argv"][0], spec["argv"], spec["env"])
    except BaseException as exc:  # noqa: BLE001 - anything here is the sandbox's failure, not the program's
        os.write(errpipe_w, f"{type(exc).__name__}: {exc}".encode()[:4000])
    os._exit(127)


def _proc_table() -> dict:
    """{pid: (ppid, state)} of every process visible in /proc."""
    table = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        fields = stat.rsplit(b")", 1)[1].split()  # comm may hold spaces and parens
        table[int(entry)] = (int(fields[1]), fields[0].decode())
    return table


def _descendants(root: int) -> dict:
    """{pid: state} of every descendant of `root` (one /proc snapshot)."""
    table = _proc_table()
    kids = {}
    for pid, (ppid, _) in table.items():
        kids.setdefault(ppid, []).append(pid)
    found, frontier = {}, [root]
    while frontier:
        for pid in kids.get(frontier.pop(), ()):
            found[pid] = table[pid][1]
            frontier.append(pid)
    return found


def _signal(pids, sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _freeze(root: int, rounds: int = 1000) -> None:
    """SIGSTOPs every descendant until a snapshot shows none running.

    Killing level by level races a fork bomb that calls setsid (each child its own group); a
    stopped process cannot fork, so stopping converges where killing may not.
    """
    for _ in range(rounds):
        running = [pid for pid, state in _descendants(root).items() if state not in ("T", "t", "Z", "X")]
        if not running:
            return
        _signal(running, signal.SIGSTOP)


def kill_all(pgid: int) -> dict:
    """Kills and reaps every descendant; returns {pid: wait status} of those reaped.

    As pid 1 of a pid namespace, kill(-1) reaches all of them at once (atomic against fork).
    Otherwise: the program's process group at once, then freeze what is left (setsid
    escapees), kill it, and reap; as a child subreaper we inherit every orphan, so the
    loop ends only when no descendant is left.
    """
    reaped = {}
    if os.getpid() == 1:
        _signal([-1], signal.SIGKILL)
        while True:
            try:
                pid, status = os.waitpid(-1, 0)
            except ChildProcessError:
                return reaped
            reaped[pid] = status
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -20)  # win the CPU against a bomb (root only)
    except OSError:
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    me = os.getpid()
    while True:
        _freeze(me)
        tree = _descendants(me)
        if not tree:
            return reaped
        _signal(tree, signal.SIGKILL)
        for pid in _descendants(me):  # our children now (orphans re-parent to us), zombies included
            try:
                reaped[pid] = os.waitpid(pid, 0)[1]
            except ChildProcessError:
                pass  # not (yet) our child: the next round


def _raise(reason: str):
    def handler(signum: int, frame: object) -> None:
        raise _Stop(reason)
    return handler


def _record(report: dict, status: int, cpu_s: float) -> None:
    if os.WIFEXITED(status):
        report["exit_code"] = os.WEXITSTATUS(status)
    elif os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    report["cpu_s"] = cpu_s


def supervise(spec: dict, report: dict) -> None:
    libc = _libc()
    if spec["mount"]:
        setup_mounts(libc, spec)
    if os.getpid() != 1:
        _check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
    errpipe_r, errpipe_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        child(spec, libc, errpipe_w)
    try:
        os.close(errpipe_w)
        signal.signal(signal.SIGALRM, _raise("timeout"))
        signal.signal(signal.SIGTERM, _raise("terminated"))  # the parent's "stop" (output flood)
        signal.setitimer(signal.ITIMER_REAL, spec["wall_timeout_s"])
        error = b""
        while True:  # EOF when the exec succeeded (close-on-exec), else the reason
            chunk = os.read(errpipe_r, 4096)
            if not chunk:
                break
            error += chunk
        if error:
            report["error"] = error.decode("utf-8", "replace")
        _, status, usage = os.wait4(pid, 0)
        _record(report, status, usage.ru_utime + usage.ru_stime)
    except _Stop as stop:
        report[stop.reason] = True
    finally:
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM, signal.SIGTERM})
        signal.setitimer(signal.ITIMER_REAL, 0)
        reaped = kill_all(pid)
    if report["exit_code"] is None and report["signal"] is None and pid in reaped:
        _record(report, reaped[pid], report["cpu_s"])


def main() -> None:
    report = {"exit_code": None, "signal": None, "cpu_s": 0.0, "timeout": False, "terminated": False,
              "error": None}
    status_fd = -1
    try:
        spec = read_spec()
        status_fd = spec["status_fd"]
        supervise(spec, report)
    except BaseException as exc:  # noqa: BLE001 - reported, never raised past the init
        report["error"] = report["error"] or f"{type(exc).__name__}: {exc}"
    if status_fd < 0:
        sys.stderr.write(f"sandbox: {report['error']}\n")
        os._exit(70)
    os.write(status_fd, json.dumps(report).encode() + b"\n")
    os._exit(0)


if __name__ == "__main__":
    main()
