"""deploy/Dockerfile and the scripts it bakes in. No Docker engine runs here, so:

- the Dockerfile is checked against hadolint's rules that matter for it (pinned base, non-root
  numeric USER, --no-cache-dir, no ADD, exec-form ENTRYPOINT/CMD/HEALTHCHECK, COPY --chown, ...)
  and cross-checked with the code (exposed ports = the config's, the sandbox interpreter path);
- the build context filter (deploy/Dockerfile.dockerignore) is evaluated like BuildKit does;
- the entry point and health check run for real against a real service;
- `test_build_steps_work_in_a_clean_venv` (marked `slow`, ~1-3 minutes) runs the build stage's
  RUN lines in a fresh virtual environment, then smoke-tests every service entry point.
"""

from __future__ import annotations

import importlib.util
import inspect
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from arlo.config import RunConfig

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DOCKERFILE = DEPLOY / "Dockerfile"
IGNORE = DEPLOY / "Dockerfile.dockerignore"
SERVICES = ("inference", "trainer", "env_gateway", "reward", "rollout")


def load_script(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(f"deploy_{name}", DEPLOY / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# --- a Dockerfile reader ----------------------------------------------------------------------

@dataclass(frozen=True)
class Instruction:
    op: str
    args: str
    stage: int
    flags: dict[str, str]
    """--from=..., --chown=..., --interval=... (leading flags only)."""

    @property
    def body(self) -> str:
        """`args` without the leading --flags."""
        rest = self.args
        while rest.startswith("--"):
            rest = rest.split(None, 1)[1] if " " in rest else ""
        return rest


def parse_dockerfile(text: str) -> list[Instruction]:
    logical: list[str] = []
    buf = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if buf and line.startswith("#"):
            continue  # comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1].strip() + " "
            continue
        logical.append(buf + line)
        buf = ""
    out: list[Instruction] = []
    stage = -1
    for line in logical:
        op, _, args = line.partition(" ")
        op = op.upper()
        if op == "FROM":
            stage += 1
        flags = dict(re.findall(r"--([a-z-]+)=(\S+)", args.split(" [", 1)[0] if op != "RUN" else ""))
        out.append(Instruction(op, args.strip(), stage, flags))
    return out


INSTRUCTIONS = parse_dockerfile(DOCKERFILE.read_text())
FINAL = max(i.stage for i in INSTRUCTIONS)


def ops(op: str, stage: int | None = None) -> list[Instruction]:
    return [i for i in INSTRUCTIONS if i.op == op and (stage is None or i.stage == stage)]


# --- hadolint-style rules ---------------------------------------------------------------------

def test_multi_stage_from_one_pinned_slim_base() -> None:
    froms = ops("FROM")
    assert len(froms) >= 2, "multi-stage: build tools stay out of the runtime image"
    images = {f.body.split()[0] for f in froms}
    assert len(images) == 1, f"the runtime's /opt/venv points at the build stage's interpreter: same base ({images})"
    (image,) = images
    name, _, tag = image.partition("@")[0].partition(":")
    assert name == "python" and tag, "DL3006: tag the base image"
    assert tag != "latest", "DL3007: never `latest`"
    assert re.fullmatch(r"3\.11\.\d+-slim(-\w+)?", tag), f"pin a patch release of the slim image, got {tag}"
    assert all(" AS " in f.args.upper() for f in froms), "name every stage"


def test_runtime_stage_runs_as_a_numeric_non_root_user() -> None:
    users = ops("USER", FINAL)
    assert users, "DL3002: set USER in the final stage"
    uid, _, gid = users[-1].body.partition(":")
    assert uid.isdigit() and int(uid) > 0, "Kubernetes runAsNonRoot only accepts a numeric, non-zero USER"
    assert gid.isdigit() and int(gid) > 0
    last_user = INSTRUCTIONS.index(users[-1])
    for op in ("ENTRYPOINT", "CMD", "HEALTHCHECK"):
        assert INSTRUCTIONS.index(ops(op, FINAL)[-1]) > last_user, f"{op} must come after USER"
    # The manifests run the same uid.
    manifests = "\n".join(p.read_text() for p in (DEPLOY / "base").glob("*.yaml"))
    assert f"runAsUser: {uid}" in manifests


def test_run_lines_follow_the_rules() -> None:
    for run in ops("RUN"):
        cmd = run.body
        assert not re.search(r"(^|[;&|]\s*)cd\s", cmd), f"DL3003: use WORKDIR, not cd: {cmd}"
        for pip in re.findall(r"pip3? install[^&;]*", cmd):
            assert "--no-cache-dir" in pip, f"DL3042: pip install without --no-cache-dir: {pip}"
            for arg in shlex.split(pip)[2:]:
                if not arg.startswith("-") and arg not in (".", "requirements.txt"):
                    assert "==" in arg, f"DL3013: pin {arg}"
        if "apt-get install" in cmd:
            assert "--no-install-recommends" in cmd and "rm -rf /var/lib/apt/lists" in cmd, "DL3015/DL3009"
        if re.search(r"[^|]\|[^|]", cmd):
            assert "pipefail" in cmd, f"DL4006: a pipe hides failures without pipefail: {cmd}"
        assert not re.search(r"(curl|wget)[^|]*\|\s*(ba)?sh", cmd), "never pipe a download into a shell"
        assert "sudo" not in cmd, "DL3004"
    assert not ops("RUN", FINAL) or all("pip install" not in r.body for r in ops("RUN", FINAL)), \
        "install in the build stage, copy the venv"


def test_no_add_and_copies_are_owned() -> None:
    assert not ops("ADD"), "DL3020: COPY, not ADD (ADD fetches URLs and unpacks archives)"
    copies = ops("COPY", FINAL)
    assert copies
    for copy in copies:
        assert "chown" in copy.flags, f"COPY --chown in the runtime stage: {copy.args}"
        assert copy.flags["chown"].split(":")[0] in ("root", "0"), \
            "code is owned by root so the service user cannot modify it"
    build_stage = ops("FROM")[0].args.split()[-1]
    assert any(c.flags.get("from") == build_stage for c in copies), "the runtime copies the build stage's venv"


def test_entrypoint_cmd_and_healthcheck_are_exec_form() -> None:
    for op in ("ENTRYPOINT", "CMD"):
        (inst,) = ops(op, FINAL)
        assert inst.body.startswith("["), f"DL3025: {op} in JSON (exec) form, so signals reach the service"
    (health,) = ops("HEALTHCHECK", FINAL)
    assert {"interval", "timeout", "start-period", "retries"} <= set(health.flags)
    cmd = health.body
    assert cmd.startswith("CMD [") and "healthcheck.py" in cmd
    copied = " ".join(c.body for c in ops("COPY", FINAL))
    assert "deploy/healthcheck.py" in copied and "deploy/entrypoint.py" in copied


def test_no_secrets_in_env_or_args() -> None:
    for inst in ops("ENV") + ops("ARG"):
        assert not re.search(r"(TOKEN|SECRET|PASSWORD|KEY)\w*=", inst.body, re.I), inst.args


def test_exposed_ports_are_the_configs() -> None:
    cfg = RunConfig()
    want = {getattr(cfg, s).server.port for s in SERVICES} | {getattr(cfg, s).server.metrics_port for s in SERVICES}
    (expose,) = ops("EXPOSE", FINAL)
    assert {int(p) for p in expose.body.split()} == want


def test_the_sandbox_interpreter_exists_in_the_image() -> None:
    """arlo.sandbox runs untrusted code on its `python` default; the slim image has Python in /usr/local only."""
    from arlo.sandbox.runner import Sandbox

    python = inspect.signature(Sandbox.__init__).parameters["python"].default
    runtime_runs = " ".join(r.body for r in ops("RUN", FINAL))
    assert f"ln -s /usr/local/bin/python3 {python}" in runtime_runs


def test_the_image_sets_the_malloc_tunables_of_arlo_hostmem() -> None:
    """The pods get GLIBC_TUNABLES from the image; the local cluster from arlo.hostmem: one value."""
    from arlo.hostmem import GLIBC_TUNABLES

    found = re.findall(r"GLIBC_TUNABLES=(\S+)", DOCKERFILE.read_text())
    assert found == [GLIBC_TUNABLES]


def test_the_build_stage_compiles_bytecode_for_a_read_only_root() -> None:
    runs = " ".join(r.body for r in ops("RUN", 0))
    assert "compileall" in runs
    env = " ".join(e.body for e in ops("ENV", FINAL))
    assert "PYTHONDONTWRITEBYTECODE=1" in env and "PYTHONUNBUFFERED=1" in env


# --- the build context ------------------------------------------------------------------------

def _pattern_regex(pattern: str) -> re.Pattern[str]:
    out, i = "", 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out, i = out + "(?:.*/)?", i + 3
        elif pattern.startswith("**", i):
            out, i = out + ".*", i + 2
        elif pattern[i] == "*":
            out, i = out + "[^/]*", i + 1
        elif pattern[i] == "?":
            out, i = out + "[^/]", i + 1
        elif pattern[i] == "[":
            j = pattern.index("]", i)
            out, i = out + pattern[i:j + 1], j + 1
        else:
            out, i = out + re.escape(pattern[i]), i + 1
    return re.compile(out)


def excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """BuildKit's rule: the last pattern matching the path or one of its parents decides."""
    parts = path.split("/")
    prefixes = ["/".join(parts[:n]) for n in range(1, len(parts) + 1)]
    result = False
    for negate, regex in rules:
        if any(regex.fullmatch(p) for p in prefixes):
            result = not negate
    return result


def ignore_rules() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for line in IGNORE.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        negate = line.startswith("!")
        rules.append((negate, _pattern_regex(line.lstrip("!").strip("/"))))
    return rules


def test_build_context_has_what_the_dockerfile_copies_and_nothing_else() -> None:
    rules = ignore_rules()
    sources = []
    for copy in ops("COPY"):
        if "from" in copy.flags:
            continue
        sources += copy.body.split()[:-1]
    assert sources
    for src in sources:
        path = ROOT / src
        assert path.exists(), f"COPY {src}: no such file in the repository"
        files = [path] if path.is_file() else [p for p in path.rglob("*.py") if "__pycache__" not in p.parts]
        for f in files:
            rel = f.relative_to(ROOT).as_posix()
            assert not excluded(rel, rules), f"{rel} is copied but left out of the build context"
    for rel in (".git/config", ".venv/bin/python", "tests/unit/test_config.py", ".arlo/token", "docs/deploy.md",
                "deploy/base/run.yaml", "arlo/__pycache__/config.cpython-311.pyc", "arlo.egg-info/PKG-INFO",
                "bench/common.py"):
        assert excluded(rel, rules), f"{rel} must not reach the build context"
    assert not excluded("arlo/proto/v1/common_pb2.py", rules), "the generated protos are baked in"


# --- scripts baked into the image -------------------------------------------------------------

def test_requirements_are_the_pyproject_pins(tmp_path: Path) -> None:
    import tomllib

    req = load_script("requirements")
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert req.requirements(ROOT / "pyproject.toml") == deps
    tpu = req.requirements(ROOT / "pyproject.toml", "tpu")
    jax_pin = next(d for d in deps if d.startswith("jax=="))
    assert f"jax[tpu]{jax_pin[3:]}" in tpu and jax_pin not in tpu and len(tpu) == len(deps)
    result = subprocess.run([sys.executable, str(DEPLOY / "requirements.py"), "--jax-extra", "rocm"],
                            capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and "--jax-extra must be one of" in result.stderr


def test_entrypoint_binds_its_own_service_and_keeps_the_others_client_addresses(tmp_path: Path) -> None:
    from arlo.config import load_config

    entry = load_script("entrypoint")
    env = {"ARLO_CONFIG": str(DEPLOY / "base" / "run.yaml"), "ARLO_BIND_HOST": "0.0.0.0",
           "ARLO_RUNTIME_DIR": str(tmp_path)}
    for name in ("env-gateway", "inference"):
        service = entry.service_name(name)
        cmd = entry.service_command(service, ["--port", "1234"], env)
        assert cmd[1:4] == ["-m", f"services.{service}", "-c"] and cmd[-2:] == ["--port", "1234"]
        cfg = load_config(cmd[4])
        assert getattr(cfg, service).server.host == "0.0.0.0"
        others = [s for s in SERVICES if s != service]
        assert all(getattr(cfg, s).server.host.startswith("dns:///") for s in others)
    # Without ARLO_BIND_HOST the config is used as it is; -c on the command line wins over $ARLO_CONFIG.
    assert entry.service_command("reward", ["-c", "x.yaml"], {"ARLO_CONFIG": "y.yaml"})[3:5] == ["-c", "x.yaml"]
    assert entry.service_name("arlo") is None


def test_entrypoint_rejects_a_bad_config_like_the_services_do(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"reward": {"server": {"port": 70000}}}))
    env = {**os.environ, "ARLO_CONFIG": str(bad), "ARLO_BIND_HOST": "0.0.0.0", "ARLO_RUNTIME_DIR": str(tmp_path),
           "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, str(DEPLOY / "entrypoint.py"), "reward"], capture_output=True,
                            text=True, env=env, timeout=60)
    assert result.returncode == 2 and "reward.server.port" in result.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _healthcheck(pid: int, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), "--pid", str(pid), "--timeout", "2"],
                          capture_output=True, text=True, env=env, timeout=30)


def test_entrypoint_starts_a_service_that_the_healthcheck_finds(tmp_path: Path) -> None:
    """The image's path end to end: entry point -> config copy -> `python -m services.reward`
    (exec'd, same pid) -> the health check reads that process's command line and config."""
    port = _free_port()
    env = {**os.environ, "ARLO_CONFIG": str(DEPLOY / "base" / "run.yaml"), "ARLO_BIND_HOST": "127.0.0.1",
           "ARLO_RUNTIME_DIR": str(tmp_path), "ARLO_TOKEN": "test-token", "PYTHONPATH": str(ROOT)}
    env.pop("ARLO_HEALTH_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, str(DEPLOY / "entrypoint.py"), "reward", "--port", str(port),
                             "--metrics-port", "-1"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        deadline = time.monotonic() + 60
        result = _healthcheck(proc.pid, env)
        while result.returncode != 0 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.3)
            result = _healthcheck(proc.pid, env)
        assert result.returncode == 0, (result.stderr, proc.poll())
        assert result.stdout.strip() == f"127.0.0.1:{port}: SERVING"
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().split(b"\0")
        assert b"services.reward" in cmdline and str(tmp_path / "reward.yaml").encode() in cmdline
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    # Stopped: unhealthy, in one line.
    result = subprocess.run([sys.executable, str(DEPLOY / "healthcheck.py"), "--timeout", "1"],
                            capture_output=True, text=True, env={**env, "ARLO_HEALTH_ADDRESS": f"127.0.0.1:{port}"},
                            timeout=30)
    assert result.returncode == 1 and result.stderr.startswith("unhealthy:") and len(result.stderr.splitlines()) == 1


def test_healthcheck_reads_port_overrides_and_refuses_non_services(tmp_path: Path) -> None:
    health = load_script("healthcheck")
    cfg = tmp_path / "run.yaml"
    cfg.write_text(yaml.safe_dump({"trainer": {"server": {"port": 6000}}}))
    assert health.target_from_cmdline(["python", "-m", "services.trainer", "-c", str(cfg)], {}) == "127.0.0.1:6000"
    assert health.target_from_cmdline(["python", "-m", "services.trainer", "-c", str(cfg), "--port", "7"], {}) == "127.0.0.1:7"
    assert health.target_from_cmdline(["python", "-m", "services.reward"], {"ARLO_CONFIG": str(cfg)}) == "127.0.0.1:50054"
    with pytest.raises(ValueError, match="not an arlo service"):
        health.target_from_cmdline(["sleep", "infinity"], {})


# --- the build, for real, in a clean virtual environment --------------------------------------

@pytest.mark.slow
@pytest.mark.timeout(900)
def test_build_steps_work_in_a_clean_venv(tmp_path: Path) -> None:
    """Runs the build stage's RUN lines (paths mapped into tmp_path) in a new venv, then starts
    `--help` of every service through the entry point with that venv's interpreter.

    The liberties taken, both about downloads only: `--no-cache-dir` / PIP_NO_CACHE_DIR are
    dropped, and the pinned wheels are fetched once into a wheelhouse ($ARLO_WHEELHOUSE, default
    ~/.cache/arlo-wheelhouse) that pip also looks in, so a rerun on the same machine does not
    download ~600 MB again. Everything else runs verbatim.
    """
    src, venv = tmp_path / "src", tmp_path / "venv"
    src.mkdir()
    rules = ignore_rules()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_NO_CACHE"))}
    wheelhouse = Path(os.environ.get("ARLO_WHEELHOUSE") or Path.home() / ".cache" / "arlo-wheelhouse")
    wheelhouse.mkdir(parents=True, exist_ok=True)
    reqs = tmp_path / "requirements.txt"
    reqs.write_text("\n".join([*load_script("requirements").requirements(ROOT / "pyproject.toml"), "setuptools>=68", "wheel"]))
    fetch = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "-r", str(reqs), "-d", str(wheelhouse)],
                           capture_output=True, text=True, timeout=840)
    assert fetch.returncode == 0, fetch.stderr[-3000:]
    env["PIP_FIND_LINKS"] = " ".join(filter(None, [str(wheelhouse), env.get("PIP_FIND_LINKS", "")]))
    workdir = src
    base_python = shutil.which("python3.11") or sys._base_executable  # type: ignore[attr-defined]

    def mapped(text: str) -> str:
        return text.replace("/opt/venv", str(venv)).replace("/src", str(src))

    for inst in [i for i in INSTRUCTIONS if i.stage == 0]:
        if inst.op == "ENV":
            for key, value in re.findall(r"(\w+)=(\S+)", inst.body):
                value = mapped(value).replace("$PATH", env.get("PATH", ""))
                if key != "PIP_NO_CACHE_DIR":
                    env[key] = value
        elif inst.op == "ARG":
            key, _, value = inst.body.partition("=")
            env[key] = value.strip('"')
        elif inst.op == "WORKDIR":
            workdir = Path(mapped(inst.body))
        elif inst.op == "COPY":
            *sources, dest = inst.body.split()
            target = workdir / dest if not dest.startswith("/") else Path(mapped(dest))
            for s in sources:
                path = ROOT / s
                if path.is_dir():
                    shutil.copytree(path, target / path.name if dest.endswith("/") else target,
                                    ignore=lambda d, names: [n for n in names if excluded(
                                        (Path(d) / n).relative_to(ROOT).as_posix(), rules)], dirs_exist_ok=True)
                else:
                    shutil.copy2(path, target / path.name if dest.endswith("/") or dest == "./" else target)
        elif inst.op == "RUN":
            cmd = mapped(inst.body).replace(" --no-cache-dir", "")
            if cmd.startswith("python -m venv"):
                cmd = cmd.replace("python", base_python, 1)
            result = subprocess.run(["bash", "-euo", "pipefail", "-c", cmd], cwd=workdir, env=env,
                                    capture_output=True, text=True, timeout=840)
            assert result.returncode == 0, f"RUN {inst.body}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"

    python = venv / "bin" / "python"
    assert python.exists()
    run_env = {**env, "PATH": f"{venv / 'bin'}:{env.get('PATH', '')}", "JAX_PLATFORMS": "cpu"}
    for service in SERVICES:
        result = subprocess.run([str(python), str(DEPLOY / "entrypoint.py"), service.replace("_", "-"), "--help"],
                                capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=120)
        assert result.returncode == 0 and f"services.{service}" in result.stdout, result.stderr[-2000:]
    for cmd in (["arlo", "--help"], [str(python), str(DEPLOY / "healthcheck.py"), "--help"]):
        result = subprocess.run(cmd, capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=120)
        assert result.returncode == 0, result.stderr[-2000:]
    # Installed, not imported from the checkout: the generated protos came along.
    result = subprocess.run([str(python), "-c", "import arlo.proto.v1.common_pb2 as m; print(m.__file__)"],
                            capture_output=True, text=True, env=run_env, cwd=tmp_path, timeout=60)
    assert result.returncode == 0 and str(venv) in result.stdout, result.stderr
