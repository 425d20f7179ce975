"""`arlo train` started while part of the run restarts rides it out (issue 33, item 17).

It exited at once ("not serving: trainer") when started while `arlo up` restarted a killed
trainer, where the run's own calls would have retried through the restart within `--outage-s`.
Real gRPC health servers on ephemeral ports stand for the services; the CLI runs as a subprocess.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest
import yaml
from grpc_health.v1 import health, health_pb2_grpc

from arlo.app.local import INFRA_SERVICES
from arlo.app.redis_server import free_port
from arlo.app.serving import NotRunning, require_serving
from arlo.config import load_config


def serve_health(port: int) -> grpc.Server:
    server = grpc.server(futures.ThreadPoolExecutor(2))
    health_pb2_grpc.add_HealthServicer_to_server(health.HealthServicer(), server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    server.start()
    return server


@pytest.fixture
def ports() -> dict[str, int]:
    return {name: free_port() for name in INFRA_SERVICES}


@pytest.fixture
def all_but_trainer(ports: dict[str, int]) -> Iterator[list[grpc.Server]]:
    servers = [serve_health(port) for name, port in ports.items() if name != "trainer"]
    try:
        yield servers
    finally:
        for server in servers:
            server.stop(None)


def config(ports: dict[str, int]):
    return load_config(None, {name: {"server": {"port": port, "metrics_port": -1}} for name, port in ports.items()})


def test_nothing_serving_is_said_at_once(ports: dict[str, int]) -> None:
    started = time.monotonic()
    with pytest.raises(NotRunning, match="Start the services with `arlo up`"):
        require_serving(config(ports), INFRA_SERVICES, outage_s=60)
    assert time.monotonic() - started < 10  # not the outage: no run is there to wait for


@pytest.mark.timeout(60)
def test_a_service_that_comes_back_within_the_outage_is_waited_for(
        ports: dict[str, int], all_but_trainer: list[grpc.Server]) -> None:
    waited: list[list[str]] = []
    back: list[grpc.Server] = []
    timer = threading.Timer(2.0, lambda: back.append(serve_health(ports["trainer"])))
    timer.start()
    try:
        started = time.monotonic()
        require_serving(config(ports), INFRA_SERVICES, outage_s=30, poll_s=0.2, on_wait=waited.append)
        assert 1.5 < time.monotonic() - started < 30
        assert waited == [["trainer"]]
    finally:
        timer.join()
        for server in back:
            server.stop(None)


@pytest.mark.timeout(60)
def test_arlo_train_waits_out_the_outage_then_names_what_stayed_down(
        tmp_path: Path, ports: dict[str, int], all_but_trainer: list[grpc.Server]) -> None:
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump({name: {"server": {"port": port, "metrics_port": -1}}
                                    for name, port in ports.items()}))
    env = {**os.environ, "ARLO_HOME": str(tmp_path / "home"), "JAX_PLATFORMS": "cpu"}
    started = time.monotonic()
    result = subprocess.run([sys.executable, "-m", "arlo.app.cli", "train", "-c", str(path), "--outage-s", "3"],
                            env=env, capture_output=True, text=True, timeout=50)
    said = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 1, said
    assert "waiting up to 3s (--outage-s) for trainer" in said
    assert f"not serving after 3s (--outage-s) while the rest of the run serves: trainer (127.0.0.1:{ports['trainer']})" \
        in said
    assert time.monotonic() - started >= 3
