"""The red team's flood (issue 33 item 11) against `python -m services.inference` as a real
process with a small open-file limit (1,024): idle and garbage connections past that limit and
dripping request heads on its OpenAI port. The process keeps its descriptors under the limit,
gRPC health answers all along, its log stays a few lines long, and once the read timeout has
closed the idle ones a real request is served. (Before: every descriptor taken, gRPC silent, an
error line per failed accept.)"""

from __future__ import annotations

import contextlib
import os
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.contract.test_service_process import ROOT, free_port, wait_serving

NOFILE = 1024
FLOOD = 1500
DRIPS = 100
READ_TIMEOUT_S = 2.0
TOKEN = "flood-token"
pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]  # ~30 s: a real service process


def _limit_fds() -> None:
    resource.setrlimit(resource.RLIMIT_NOFILE, (NOFILE, NOFILE))


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _open(s: socket.socket) -> bool:
    try:
        return s.recv(1) != b""
    except BlockingIOError:
        return True
    except OSError:
        return False


def _healthy(port: int) -> bool:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service="arlo.v1.Inference"),
                                                          timeout=5)
        return reply.status == health_pb2.HealthCheckResponse.SERVING


def test_an_openai_port_flood_past_the_fd_limit_leaves_grpc_and_the_log_alone(tmp_path: Path, redis_url: str,
                                                                               run_id: str) -> None:
    port, http_port = free_port(), free_port()
    config = tmp_path / "run.yaml"
    config.write_text(f"run_id: {run_id}\nredis: {{url: '{redis_url}'}}\n"
                      f"inference: {{openai_port: {http_port}, openai_read_timeout_s: {READ_TIMEOUT_S}}}\n")
    env = {**os.environ, "ARLO_TOKEN": TOKEN, "JAX_PLATFORMS": "cpu"}
    env.pop("ARLO_CONFIG", None)
    log = (tmp_path / "stderr").open("w+")
    proc = subprocess.Popen([sys.executable, "-m", "services.inference", "-c", str(config), "--port", str(port),
                             "--metrics-port", "-1"], cwd=ROOT, env=env, stderr=log, preexec_fn=_limit_fds)
    clients: list[socket.socket] = []
    try:
        wait_serving(port, "arlo.v1.Inference", proc, timeout_s=120)
        lines_before, fds_before = len(Path(log.name).read_text().splitlines()), _fds(proc.pid)
        for i in range(FLOOD + DRIPS):
            s = socket.socket()
            s.setblocking(False)
            s.connect_ex(("127.0.0.1", http_port))
            clients.append(s)
            if i % 100 == 0:
                assert _healthy(port)
        time.sleep(0.5)
        for s in clients[:FLOOD // 2]:  # garbage on half: uvicorn answers 400 and logs a warning each
            with contextlib.suppress(OSError):
                s.send(b"NOT HTTP\r\n\r\n")
        for s in clients[FLOOD:]:
            with contextlib.suppress(OSError):
                s.send(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
        peak = 0
        for _ in range(int(READ_TIMEOUT_S * 4) + 4):  # drip heads past the read timeout, watching fds
            for s in clients[FLOOD:]:
                with contextlib.suppress(OSError):
                    s.send(b"X-Drip: 1\r\n")
            peak = max(peak, _fds(proc.pid))
            assert _healthy(port)
            time.sleep(0.25)
        assert peak < NOFILE - 64, (peak, fds_before)  # at most half the limit goes to HTTP
        assert not [s for s in clients[FLOOD:] if _open(s)]  # every drip was hung up on
        for s in clients:
            s.close()
        request = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/models",
                                         headers={"Authorization": f"Bearer {TOKEN}"})
        assert urllib.request.urlopen(request, timeout=10).status == 200
        assert proc.poll() is None
        new_lines = len(Path(log.name).read_text().splitlines()) - lines_before
        assert new_lines < 100, Path(log.name).read_text()[-3000:]
    finally:
        for s in clients:
            s.close()
        proc.kill()
        proc.wait()
