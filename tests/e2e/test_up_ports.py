"""`arlo up` and its ports (issue 33): port 0 (documented: a free port) is chosen before the start
and recorded, so the health checks and `arlo status` use it (they used 127.0.0.1:0 for 180 s); a
port another process holds is refused before any service starts, naming the setting (each service
was restarted three times first, ~200 log lines)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from arlo.app.redis_server import free_port
from tests.e2e.test_cli import SERVICES, arlo, wait_until_up

pytestmark = pytest.mark.e2e


def config(path: Path, run_id: str, redis_url: str, **servers: dict) -> Path:
    cfg: dict = {"run_id": run_id, "redis": {"url": redis_url}}
    for name in SERVICES:
        cfg[name] = {"server": {"port": 0, "metrics_port": 0, **servers.get(name, {})}}
    path.write_text(yaml.safe_dump(cfg))
    return path


@pytest.mark.timeout(480)  # 300 s for the services' health, 90 s for the stop
def test_port_0_is_chosen_recorded_and_health_checked(tmp_path: Path, redis_url: str, run_id: str) -> None:
    home = tmp_path / "home"
    env = {**os.environ, "ARLO_HOME": str(home), "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_TOKEN", None)
    up = subprocess.Popen([sys.executable, "-m", "arlo.app.cli", "up", "-c",
                           str(config(tmp_path / "run.yaml", run_id, redis_url))], env=env,
                          stdout=open(tmp_path / "up.out", "w"), stderr=subprocess.STDOUT)  # noqa: SIM115
    try:
        status = wait_until_up(up, home, tmp_path / "up.out")
        infra = [s for s in status["services"] if s["name"] != "rollout"]
        assert infra and all(s["healthy"] for s in infra), status
        assert all(not s["address"].endswith(":0") for s in status["services"]), status
        recorded = yaml.safe_load((home / "config.yaml").read_text())
        assert all(recorded[name]["server"]["port"] > 0 and recorded[name]["server"]["metrics_port"] > 0
                   for name in SERVICES)
        # -c with the port-0 config reads the recorded ports back (it health-checked 127.0.0.1:0).
        result = arlo("status", "-c", str(tmp_path / "run.yaml"), "--json", home=home, timeout=60)
        assert result.returncode == 0, result.stderr[-3000:]
        by_name = {s["name"]: s for s in json.loads(result.stdout)["services"]}
        assert all(by_name[name]["healthy"] and by_name[name]["address"].endswith(f":{recorded[name]['server']['port']}")
                   for name in SERVICES if name != "rollout"), by_name
    finally:
        up.send_signal(signal.SIGINT)
        try:
            code = up.wait(timeout=90)
        except subprocess.TimeoutExpired:
            up.kill()
            raise
    assert code == 0


def test_a_port_in_use_is_refused_before_any_service_starts(tmp_path: Path, redis_url: str, run_id: str) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        path = config(tmp_path / "run.yaml", run_id, redis_url, inference={"port": port},
                      trainer={"metrics_port": 0, "port": 0}, reward={"port": 0})
        started = time.monotonic()
        result = arlo("up", "-c", str(path), home=tmp_path / "home", timeout=120)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 2, said[-3000:]
    assert f"inference.server.port {port} is in use on this host" in said
    assert time.monotonic() - started < 60
    assert not list((tmp_path / "home" / "logs").glob("*.log"))  # no service was started


@pytest.mark.parametrize("command", [("status", "--json"), ("train", "--steps", "1"), ("export", "--out", "x")])
def test_a_command_without_a_run_of_its_own_claims_none(tmp_path: Path, command: tuple[str, ...]) -> None:
    # With no state under its ARLO_HOME, `arlo status` read the built-in config and reported the
    # services of another run (on the default ports) as its own, healthy; `arlo train` would have
    # driven them (issue 33, item 4).
    home = tmp_path / "elsewhere"
    result = arlo(*command, home=home, timeout=60)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, said
    assert f"arlo {command[0]}: no run under ARLO_HOME {home}" in said and not result.stdout.strip()
    assert not (home / "config.yaml").exists()


def test_status_says_whose_run_it_shows(tmp_path: Path, redis_url: str, run_id: str) -> None:
    home = tmp_path / "home"
    home.mkdir()
    # What `arlo up` records (its ports settled); nothing serves them.
    config(home / "config.yaml", run_id, redis_url, **{n: {"port": free_port(), "metrics_port": -1} for n in SERVICES})
    result = arlo("status", "--json", home=home, timeout=60)
    assert result.returncode == 0, result.stderr[-3000:]
    status = json.loads(result.stdout)
    assert (status["run_id"], status["arlo_home"], status["config"]) == (run_id, str(home), str(home / "config.yaml"))
    assert not any(s["healthy"] for s in status["services"])
