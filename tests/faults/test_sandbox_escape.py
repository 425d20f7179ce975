"""The escape suite: each attack on the sandbox is contained *and* reported with a clear status,
and the next normal run still works (the service stays healthy).

Runs once per isolation available here ("bwrap", "unshare", "none"); an isolation that does
not work on this machine is skipped with the probe's reason. The sandbox uid is one of our
own (not 65534), so "no process of the uid is left" cannot be confused by anyone else's runs.
"""

from __future__ import annotations

import os
import resource
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest

from arlo.config import SandboxConfig
from arlo.sandbox import Sandbox, SandboxError, SandboxResult

UID = 62000 + os.getpid() % 3000
WALL_S = 2.0
MARGIN_S = 2.0
"""Slack over the wall timeout: interpreter start-up, the kill, and a busy two-core machine."""


def _config(isolation: str, **overrides: object) -> SandboxConfig:
    fields: dict[str, object] = dict(cpu_seconds=1, memory_mb=256, file_size_mb=4, max_processes=16,
                                     wall_timeout_s=WALL_S, isolation=isolation, uid=UID, max_output_bytes=4096)
    fields.update(overrides)
    return SandboxConfig(**fields)  # type: ignore[arg-type]


def _sandbox(isolation: str, **overrides: object) -> Sandbox:
    try:
        return Sandbox(_config(isolation, **overrides))
    except SandboxError as exc:
        pytest.skip(f"{isolation} isolation is not available here: {exc}")


@pytest.fixture(params=["bwrap", "unshare", "none"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return _sandbox(request.param)


def processes_of(uid: int) -> list[int]:
    """Pids of every process (zombies too) whose real uid is `uid`, by a /proc scan."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
        if int(uid_line.split()[1]) == uid:
            found.append(int(entry))
    return found


def sandbox_dirs() -> set[str]:
    return {name for name in os.listdir(tempfile.gettempdir()) if name.startswith("arlo-sandbox-")}


@pytest.fixture(autouse=True)
def nothing_left_behind() -> Iterator[None]:
    """Every test: no process of the sandbox uid and no temp dir outlives the run."""
    dirs_before = sandbox_dirs()
    yield
    assert processes_of(UID) == []
    assert sandbox_dirs() - dirs_before == set()


def assert_healthy(sandbox: Sandbox) -> None:
    result = sandbox.run_python("import sys; print(6 * 7, sys.stdin.read())", stdin="fine")
    assert result.status == "ok", result
    assert result.stdout == "42 fine\n"


def _connect_code(addresses: list[tuple[str, int]]) -> str:
    return ("import socket\n"
            f"for address in {addresses!r}:\n"
            "    s = socket.socket(); s.settimeout(1.0)\n"
            "    try:\n"
            "        s.connect(address); print('connected', address)\n"
            "    except OSError as exc:\n"
            "        print('refused', address, exc.errno)\n")


def test_network_is_unreachable(sandbox: Sandbox, redis_url: str) -> None:
    if sandbox.isolation == "none":
        pytest.skip("isolation none has no network namespace (the start-up warning says so)")
    host, port = urlparse(redis_url).hostname or "127.0.0.1", urlparse(redis_url).port or 6379
    socket.create_connection((host, port), timeout=2).close()  # Redis answers the host...
    result = sandbox.run_python(_connect_code([(host, port), ("1.1.1.1", 53), ("8.8.8.8", 443)]))
    assert result.status == "ok", result
    assert "connected" not in result.stdout  # ...but not the sandbox
    assert result.stdout.count("refused") == 3
    assert_healthy(sandbox)


def test_fork_bomb_is_bounded(sandbox: Sandbox) -> None:
    code = ("import os\n"
            "while True:\n"
            "    try:\n"
            "        if os.fork() == 0:\n"
            "            os.setsid()\n"  # each child its own session: no single group to kill
            "    except OSError:\n"
            "        pass\n")
    start = time.monotonic()
    result = sandbox.run_python(code)
    assert result.status in ("timeout", "cpu_limit"), result
    assert time.monotonic() - start < WALL_S + MARGIN_S
    assert processes_of(UID) == []
    subprocess.run(["true"], check=True)  # the host can still start processes
    assert_healthy(sandbox)


def test_memory_bomb(sandbox: Sandbox) -> None:
    result = sandbox.run_python("x = bytearray(1 << 30)\nprint('allocated')")
    assert result.status == "memory_limit", result
    assert "MemoryError" in result.stderr
    patient = _sandbox(sandbox.isolation, wall_timeout_s=20.0)  # a busy machine must not turn it into a timeout
    growing = patient.run_python("x = []\nwhile True:\n    x.append(bytearray(1 << 20))\n")
    # memory_limit normally; page faults under memory pressure can use up the 1 s of CPU first.
    assert growing.status in ("memory_limit", "cpu_limit"), growing
    assert_healthy(sandbox)


def test_infinite_loop_hits_the_cpu_limit(sandbox: Sandbox) -> None:
    patient = _sandbox(sandbox.isolation, wall_timeout_s=20.0)  # CPU, not wall clock, must end it
    result = patient.run_python("while True:\n    pass\n")
    assert result.status == "cpu_limit", result
    assert result.signal == signal.SIGXCPU
    assert_healthy(patient)


def test_sleep_forever_times_out(sandbox: Sandbox) -> None:
    start = time.monotonic()
    result = sandbox.run_python("import time\ntime.sleep(3600)\n")
    elapsed = time.monotonic() - start
    assert result.status == "timeout", result
    assert WALL_S <= elapsed < WALL_S + MARGIN_S
    assert result.exit_code is None and result.signal == signal.SIGKILL
    assert_healthy(sandbox)


def test_disk_filling_hits_the_file_size_limit(sandbox: Sandbox) -> None:
    result = sandbox.run_python("with open('big', 'wb') as f:\n"
                                "    while True:\n"
                                "        f.write(b'x' * (1 << 20))\n")
    assert result.status == "error", result
    assert "File too large" in result.stderr  # EFBIG from RLIMIT_FSIZE
    if sandbox.isolation != "none":  # many files: the private tmpfs is full long before the disk
        many = sandbox.run_python("i = 0\nwhile True:\n"
                                  "    open(f'f{i}', 'wb').write(b'x' * (3 << 20)); i += 1\n")
        assert many.status == "error", many
        assert "No space left on device" in many.stderr
    assert_healthy(sandbox)


def test_host_secrets_stay_secret(sandbox: Sandbox, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    vault = tmp_path / "vault"
    vault.mkdir(mode=0o700)
    secret = vault / "secret"
    secret.write_text("hunter2-secret")
    secret.chmod(0o600)
    monkeypatch.setenv("ARLO_TOKEN", "token-that-must-not-leak")
    leaked = os.open(secret, os.O_RDONLY)  # an inheritable fd in the parent must not reach the child
    os.set_inheritable(leaked, True)
    try:
        code = ("import os\n"
                f"for path in [{str(secret)!r}, '/root/.bashrc', '/proc/{os.getpid()}/environ']:\n"
                "    try:\n"
                "        print('READ', path, open(path).read())\n"
                "    except OSError as exc:\n"
                "        print('denied', path, type(exc).__name__)\n"
                "print('environ', sorted(os.environ))\n"
                "fds = []\n"
                "for fd in range(3, 1024):\n"
                "    try:\n"
                "        os.fstat(fd); fds.append(fd)\n"
                "    except OSError:\n"
                "        pass\n"
                "print('fds', fds)\n")
        result = sandbox.run_python(code)
    finally:
        os.close(leaked)
    assert result.status == "ok", result
    assert "READ" not in result.stdout and "hunter2" not in result.stdout
    assert result.stdout.count("denied") == 3
    assert "ARLO_TOKEN" not in result.stdout and "token-that-must-not-leak" not in result.stdout
    assert "fds []" in result.stdout
    assert_healthy(sandbox)


def test_background_process_dies_with_the_run(sandbox: Sandbox) -> None:
    code = ("import os, sys, time\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    if os.fork() == 0:\n"  # the classic double fork: a daemon, re-parented away
            "        os.close(1); os.close(2)\n"
            "        time.sleep(600)\n"
            "    os._exit(0)\n"
            "time.sleep(0.2)\n"
            "print('left a daemon')\n")
    start = time.monotonic()
    result = sandbox.run_python(code)
    assert result.status == "ok", result
    assert result.stdout == "left a daemon\n"
    assert time.monotonic() - start < WALL_S  # the run ends with its main process, not at the timeout
    assert processes_of(UID) == []
    assert_healthy(sandbox)


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_output_flood_is_cut_and_stopped(sandbox: Sandbox, stream: str) -> None:
    rss_before = _rss_mb()
    start = time.monotonic()
    result = sandbox.run_python(f"import sys\nwhile True:\n    sys.{stream}.write('x' * 65536)\n")
    assert result.status == "output_limit", result
    assert result.truncated
    assert len(getattr(result, stream).encode()) == 4096
    assert time.monotonic() - start < WALL_S  # stopped at the cap, not at the timeout
    assert _rss_mb() - rss_before < 64  # the flood was never buffered
    assert_healthy(sandbox)


def test_results_are_typed(sandbox: Sandbox) -> None:
    result = sandbox.run_python("print('hi')")
    assert isinstance(result, SandboxResult) and result.ok and result.wall_s > 0


FORKING_HOG = """
import os, sys, time
kids = []
for _ in range(8):
    pid = os.fork()
    if pid == 0:
        block = bytearray(100 << 20)
        block[::4096] = b"x" * len(block[::4096])  # touch every page: resident, not just reserved
        time.sleep(3)
        os._exit(0)
    kids.append(pid)
held = sum(os.waitstatus_to_exitcode(os.waitpid(p, 0)[1]) == 0 for p in kids)
print("held", held)
sys.exit(0 if held == len(kids) else 1)
"""


def test_forked_processes_share_one_memory_limit(sandbox: Sandbox) -> None:
    """Issue 16: 8 forked processes held 1.6 GiB under a 256 MiB per-process limit. Each child
    here stays under the per-process limit (100 MiB); together they would hold 800 MiB."""
    from arlo.sandbox import cgroup

    if cgroup.layout() is None:
        pytest.skip("no writable cgroup hierarchy here: the per-process rlimits are the (weaker) bound")
    patient = _sandbox(sandbox.isolation, wall_timeout_s=20.0, cpu_seconds=10)
    result = patient.run_python(FORKING_HOG)
    assert result.status == "memory_limit", result
    held = int(result.stdout.split()[-1])
    assert held <= 2, result  # 256 MiB in all: at most two 100 MiB children at once
    assert "together reached memory_mb (256 MiB)" in result.stderr
    assert processes_of(UID) == []
    assert_healthy(patient)
