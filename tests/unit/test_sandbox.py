"""Sandbox basics on real subprocesses: results, stdin/files/args, the limits of SandboxConfig,
the isolation probe, and the limits-only ("none") path, including a refused-namespaces start."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from arlo.config import SandboxConfig
from arlo.sandbox import STATUSES, Sandbox, SandboxError
from arlo.sandbox.isolation import Isolation, candidates, chain, tmpfs_plan
from arlo.sandbox.result import RunFacts, classify

UID = 59000 + os.getpid() % 3000
ROOT = Path(__file__).resolve().parents[2]


def _config(isolation: str = "auto", **overrides: object) -> SandboxConfig:
    fields: dict[str, object] = dict(cpu_seconds=1, memory_mb=256, file_size_mb=2, max_processes=16,
                                     wall_timeout_s=3.0, isolation=isolation, uid=UID, max_output_bytes=2048)
    fields.update(overrides)
    return SandboxConfig(**fields)  # type: ignore[arg-type]


@pytest.fixture(params=["auto", "none"])
def sandbox(request: pytest.FixtureRequest) -> Sandbox:
    return Sandbox(_config(request.param))


def _namespaces_work() -> bool:
    unshare = shutil.which("unshare")
    return unshare is not None and subprocess.run([unshare, "--net", "--pid", "--fork", "--mount", "true"],
                                                  capture_output=True).returncode == 0


def test_ok_and_error(sandbox: Sandbox) -> None:
    ok = sandbox.run_python("print('hello')")
    assert (ok.status, ok.exit_code, ok.signal, ok.stdout, ok.stderr, ok.truncated) == ("ok", 0, None, "hello\n",
                                                                                         "", False)
    assert ok.ok and 0 < ok.wall_s < 3
    error = sandbox.run_python("raise ValueError('boom')")
    assert (error.status, error.exit_code, error.ok) == ("error", 1, False)
    assert "ValueError: boom" in error.stderr


@pytest.mark.parametrize("code", [0, 3, 255])
def test_exit_codes(sandbox: Sandbox, code: int) -> None:
    result = sandbox.run_python(f"import sys; print('out'); print('err', file=sys.stderr); sys.exit({code})")
    assert result.exit_code == code
    assert result.status == ("ok" if code == 0 else "error")
    assert (result.stdout, result.stderr) == ("out\n", "err\n")


def test_signal_is_reported(sandbox: Sandbox) -> None:
    result = sandbox.run_python("import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert (result.status, result.exit_code, result.signal) == ("killed", None, 15)


def test_stdin_files_args_and_cwd(sandbox: Sandbox) -> None:
    big = "y" * 300_000  # more than a pipe holds: stdin is fed while the program runs
    code = ("import os, sys\n"
            "import helper\n"  # the temp dir is on sys.path, as a script's dir is
            "data = sys.stdin.read()\n"
            "print(len(data), helper.VALUE, open('notes.txt').read(), sys.argv[1:])\n"
            "print(sorted(os.listdir('.')), os.getcwd() == os.environ['HOME'])\n")
    result = sandbox.run_python(code, stdin=big, files={"helper.py": "VALUE = 7\n", "notes.txt": "ünïcode"},
                                args=["--flag", "two words"])
    assert result.status == "ok", result
    assert result.stdout.splitlines() == ["300000 7 ünïcode ['--flag', 'two words']",
                                          "['helper.py', 'main.py', 'notes.txt'] True"]


def test_each_run_gets_a_fresh_dir(sandbox: Sandbox) -> None:
    sandbox.run_python("open('left.txt', 'w').write('x')")
    assert sandbox.run_python("import os; print(os.listdir('.'))").stdout == "['main.py']\n"


@pytest.mark.parametrize("name", ["", ".", "..", "a/b", "../x", "/etc/passwd", "nul\0", "main.py"])
def test_file_names_are_validated(name: str) -> None:
    with pytest.raises(ValueError, match="file name"):
        Sandbox(_config()).run_python("pass", files={name: "x"})


def test_runs_as_the_configured_uid_without_the_service_env(sandbox: Sandbox,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ARLO_TOKEN", "do-not-leak")
    result = sandbox.run_python("import os; print(os.getuid(), os.getgid(), os.getgroups(), sorted(os.environ))")
    expected_uid = UID if os.geteuid() == 0 else os.geteuid()
    assert result.stdout.startswith(f"{expected_uid} ")
    assert "ARLO_TOKEN" not in result.stdout
    assert "['HOME', 'LANG', 'PATH', 'TMPDIR']" in result.stdout


def test_output_is_capped(sandbox: Sandbox) -> None:
    exact = sandbox.run_python("import sys; sys.stdout.write('a' * 2048)")
    assert (exact.status, exact.truncated, len(exact.stdout)) == ("ok", False, 2048)
    over = sandbox.run_python("import sys; sys.stdout.write('a' * 2049)")
    assert (over.status, over.truncated, len(over.stdout)) == ("output_limit", True, 2048)
    bad = sandbox.run_python("import sys; sys.stdout.buffer.write(b'ok \\xff')")
    assert bad.stdout == "ok \ufffd"


@pytest.mark.parametrize("isolation", ["auto", "none"])
def test_config_limits_are_honoured(isolation: str) -> None:
    sandbox = Sandbox(_config(isolation, file_size_mb=1, memory_mb=64, max_processes=4))
    write = "import os\nfd = os.open('f', os.O_WRONLY | os.O_CREAT)\nfor _ in range({}):\n    os.write(fd, b'x' * 1024)\n"
    fits = sandbox.run_python(write.format(1024))
    assert fits.status == "ok", fits
    too_big = sandbox.run_python(write.format(1025))
    assert too_big.status == "error" and "File too large" in too_big.stderr
    memory = sandbox.run_python("x = bytearray(80 << 20)")
    assert memory.status == "memory_limit", memory
    assert sandbox.run_python("x = bytearray(8 << 20)").status == "ok"
    procs = sandbox.run_python("import subprocess, sys\n"
                               "children = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(5)'])"
                               " for _ in range(6)]\n")
    if os.geteuid() == 0:  # RLIMIT_NPROC counts per uid; only a dropped uid is ours alone
        assert procs.status == "error" and "Resource temporarily unavailable" in procs.stderr, procs


def test_wall_limit() -> None:  # cpu_limit: tests/faults/test_sandbox_escape.py
    start = time.monotonic()
    wall = Sandbox(_config(wall_timeout_s=1.0)).run_python("import time; time.sleep(60)")
    assert wall.status == "timeout" and time.monotonic() - start < 10  # cut at 1 s, not the script's 60 s


def test_isolation_probe_matches_this_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    from arlo.sandbox import runner

    sandbox = Sandbox(_config("auto"))
    assert sandbox.isolation in ("bwrap", "unshare", "none")
    if os.geteuid() == 0 and _namespaces_work():
        assert sandbox.isolation != "none"
    probes: list[object] = []  # probed once per process: a second Sandbox runs no probe (was: timed, < 50 ms)
    monkeypatch.setattr(runner, "_probe", lambda *args: probes.append(args))
    again = Sandbox(_config("auto"))
    assert again.isolation == sandbox.isolation and not probes


def test_explicit_isolation_that_is_missing_fails_loudly() -> None:
    if shutil.which("bwrap"):
        pytest.skip("bubblewrap is installed here")
    with pytest.raises(SandboxError, match="bwrap: not installed"):
        Sandbox(_config("bwrap"))


def test_unusable_interpreter_fails_at_start(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o700)  # root may enter, the sandbox uid may not
    (locked / "python3").symlink_to("/usr/bin/python3")
    if os.geteuid() != 0:
        pytest.skip("needs root: the uid drop is what makes the interpreter unreachable")
    with pytest.raises(SandboxError, match=f"executable by uid {UID}"):
        Sandbox(_config("auto"), python=str(locked / "python3"))


def test_concurrent_runs_from_threads(sandbox: Sandbox) -> None:
    results: dict[int, str] = {}

    def run(i: int) -> None:
        results[i] = sandbox.run_python(f"import time; time.sleep(0.2); print({i} * 2)").stdout

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == {i: f"{i * 2}\n" for i in range(4)}


def _tasks_of(uid: int) -> int:
    count = 0
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = Path(f"/proc/{entry}/status").read_text()
        except OSError:
            continue
        count += any(line.split()[:2] == ["Uid:", str(uid)] for line in status.splitlines())
    return count


def test_concurrent_runs_each_get_max_processes() -> None:
    """RLIMIT_NPROC counts every process of the uid; one run's children must not use up another's."""
    if os.geteuid() != 0:
        pytest.skip("needs root: only then is the sandbox uid ours alone")
    sandbox = Sandbox(_config(max_processes=4))
    spawn = ("import subprocess, sys\n"
             "kids = [subprocess.Popen([sys.executable, '-c', 'import time; time.sleep({})']) for _ in range(3)]\n"
             "[k.wait() for k in kids]\n")
    first: list[str] = []
    holder = threading.Thread(target=lambda: first.append(sandbox.run_python(spawn.format(1.5)).status))
    holder.start()
    deadline = time.monotonic() + 10
    while _tasks_of(UID) < 4 and time.monotonic() < deadline:  # the first run holds its 4 processes
        time.sleep(0.05)
    second = sandbox.run_python(spawn.format(0.1))
    holder.join()
    assert (first, second.status) == (["ok"], "ok"), second.stderr


def test_refused_namespaces_fall_back_with_one_warning() -> None:
    """A hardened pod: not root, no capabilities. "auto" warns once and runs with limits only;
    an explicit "unshare" refuses to start."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("needs root, setpriv and /usr/bin/python3 to simulate an unprivileged pod")
    script = (
        "import logging, types\n"
        "logging.basicConfig(level=logging.INFO, format='%(levelname)s %(message)s')\n"
        "from arlo.sandbox import Sandbox, SandboxError\n"
        "cfg = dict(cpu_seconds=1, memory_mb=256, file_size_mb=2, max_processes=64, wall_timeout_s=5.0,\n"
        "           uid=65534, max_output_bytes=4096)\n"
        "first = Sandbox(types.SimpleNamespace(isolation='auto', **cfg))\n"
        "second = Sandbox(types.SimpleNamespace(isolation='auto', **cfg))\n"
        "r = first.run_python('import os; print(os.getuid())')\n"
        "print('RESULT', first.isolation, second.isolation, r.status, r.stdout.strip())\n"
        "try:\n"
        "    Sandbox(types.SimpleNamespace(isolation='unshare', **cfg))\n"
        "except SandboxError as exc:\n"
        "    print('REFUSED', exc)\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)}
    # Stand-in for the pod's user: a uid of our own, so this test's processes are its alone.
    pod_uid = UID + 1
    proc = subprocess.run([setpriv, f"--reuid={pod_uid}", f"--regid={pod_uid}", "--clear-groups",
                           "/usr/bin/python3", "-S", "-c", script], capture_output=True, text=True, env=env,
                          cwd="/", timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert f"RESULT none none ok {pod_uid}" in proc.stdout
    assert "REFUSED" in proc.stdout and "unshare" in proc.stdout
    assert proc.stderr.count("WARNING sandbox: namespaces are refused here") == 1


def test_classify_covers_every_status() -> None:
    def facts(report: dict | None, **kw: object) -> RunFacts:
        base: dict[str, object] = dict(flooded=False, backstop=False, cpu_seconds=1, stderr="")
        base.update(kw)
        return RunFacts(report=report, **base)  # type: ignore[arg-type]

    def rep(**kw: object) -> dict:
        return {"exit_code": None, "signal": None, "cpu_s": 0.1, "timeout": False, "terminated": False,
                "error": None, **kw}

    seen = {
        classify(facts(rep(exit_code=0)))[0], classify(facts(rep(exit_code=2)))[0],
        classify(facts(rep(timeout=True)))[0], classify(facts(None, backstop=True))[0],
        classify(facts(rep(signal=24)))[0], classify(facts(rep(signal=9, cpu_s=1.2)))[0],
        classify(facts(rep(exit_code=1), stderr="Traceback...\nMemoryError\n"))[0],
        classify(facts(rep(exit_code=0), flooded=True))[0], classify(facts(rep(signal=9)))[0],
        classify(facts(None))[0], classify(facts(rep(error="exec failed")))[0],
    }
    assert seen == set(STATUSES)


def test_candidates_and_chains() -> None:
    assert candidates("none") == ("none",)
    assert candidates("auto")[-1] == "none"
    with pytest.raises(ValueError, match="isolation must be one of"):
        candidates("docker")
    plan = tmpfs_plan(4, "/usr/bin/python3")
    assert plan[0] == {"path": "/tmp", "bytes": 16 << 20, "mode": "0700", "owned": True, "readonly": False}
    assert not any(m["path"] == "/home" for m in tmpfs_plan(4, "/home/me/venv/bin/python"))
    bwrap = chain(Isolation(kind="bwrap", tools=("/usr/bin/bwrap", "/usr/bin/setpriv")), uid=1234, plan=plan,
                  python="/usr/bin/python3", trampoline="pass")
    start = bwrap.index("/usr/bin/bwrap")
    assert bwrap[:start] == (["/usr/bin/setpriv", "--reuid=1234", "--regid=1234", "--clear-groups", "--"]
                             if os.geteuid() == 0 else [])
    for flag in ("--unshare-all", "--die-with-parent", "--new-session"):
        assert flag in bwrap
    assert bwrap[bwrap.index("/tmp") - 5:bwrap.index("/tmp") + 1] == ["--perms", "0700", "--size",
                                                                      str(16 << 20), "--tmpfs", "/tmp"]
    assert bwrap[-6:] == ["/usr/bin/python3", "-I", "-S", "-B", "-c", "pass"]
    unshare = chain(Isolation(kind="unshare", tools=("/usr/bin/unshare",)), uid=1234, plan=plan,
                    python="/usr/bin/python3", trampoline="pass")
    assert unshare[:5] == ["/usr/bin/unshare", "--net", "--pid", "--fork", "--kill-child"]
    assert chain(Isolation(kind="none"), uid=1234, plan=plan, python=sys.executable, trampoline="pass")[0] == \
        sys.executable


def test_make_undumpable_clears_the_dumpable_flag() -> None:
    import subprocess
    import sys

    # In a child process: the flag is per process and cannot be set back by an unprivileged caller.
    code = ("import ctypes; from arlo.sandbox.hardening import make_undumpable; libc = ctypes.CDLL(None); "
            "before = libc.prctl(3, 0, 0, 0, 0); assert make_undumpable(); print(before, libc.prctl(3, 0, 0, 0, 0))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["1", "0"]  # PR_GET_DUMPABLE: dumpable before, not after
