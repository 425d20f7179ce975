"""`python -m services.<name>` as a real process: serves health, then exits 0 on SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_serving(port: int, service: str, proc: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"service exited early with {proc.returncode}"
            try:
                if stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise AssertionError(f"not SERVING within {timeout_s}s")


def reflected_services(port: int, token: str) -> set[str]:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        replies = stub.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                            metadata=[("authorization", f"Bearer {token}")], timeout=10)
        return {s.name for reply in replies for s in reply.list_services_response.service}


@pytest.mark.parametrize(("module", "service"), [
    ("reward", "arlo.v1.Reward"), ("env_gateway", "arlo.v1.Environment"), ("inference", "arlo.v1.Inference"),
    ("trainer", "arlo.v1.Trainer"), ("rollout", ""),
])
def test_service_process_serves_and_exits_cleanly_on_sigterm(tmp_path: Path, module: str, service: str,
                                                             redis_url: str, run_id: str) -> None:
    port, metrics_port = free_port(), free_port()
    env = {**os.environ, "ARLO_TOKEN": "process-token", "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_CONFIG", None)
    config = tmp_path / "run.yaml"
    # Rollout's peers are not running: it must still serve health and stop cleanly.
    config.write_text(f"run_id: {run_id}\nredis: {{url: '{redis_url}'}}\n"
                      f"inference: {{server: {{port: {free_port()}}}}}\n")
    stderr = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", f"services.{module}", "-c", str(config), "--port", str(port),
                             "--metrics-port", str(metrics_port)], cwd=ROOT, env=env, stderr=stderr)
    try:
        wait_serving(port, service, proc, timeout_s=120)
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5).read().decode()
        assert "arlo_rpc_requests_total" in metrics
        reflected = reflected_services(port, "process-token")
        assert "grpc.health.v1.Health" in reflected and (not service or service in reflected)
        started = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=15)
        stderr.seek(0)
        assert code == 0, stderr.read()[-3000:]
        assert time.monotonic() - started < 10
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    stderr.seek(0)
    lines = [json.loads(line) for line in stderr.read().splitlines() if line.startswith("{")]
    assert any(f":{port}" in entry["msg"] and entry["service"] == module for entry in lines)
    assert any("signal received" in entry["msg"] for entry in lines)


def test_missing_token_exits_with_a_message(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("ARLO_TOKEN", "ARLO_CONFIG")}
    proc = subprocess.run([sys.executable, "-m", "services.reward", "--port", "0", "--metrics-port", "-1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "ARLO_TOKEN" in proc.stderr and "Traceback" not in proc.stderr
