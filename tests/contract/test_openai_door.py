"""The OpenAI endpoint's door under abuse (issue 33 items 11 and 15): a flood of idle or garbage
connections, a dripping request head (slowloris), a body that never ends, JSON nested a hundred
thousand deep. A second endpoint with small bounds (serve_openai, the real uvicorn server) runs
beside a real inference service in this process, so its descriptors are the service's."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx2 as httpx
import pytest
import pytest_asyncio

from arlo.proto.v1 import inference_pb2
from services.inference.episodes import EpisodeRecorder
from services.inference.http_guard import LOG_LINES, DoorStats, Listener
from services.inference.openai_http import OpenAIEndpoint, bind, serve_openai
from tests.support.openai_server import TOKEN, Served

CAP = 16
READ_TIMEOUT_S = 1.0
FLOOD = 200
pytestmark = [pytest.mark.timeout(120), pytest.mark.asyncio(loop_scope="session")]


@dataclass
class Door:
    port: int
    stats: DoorStats
    served: Served
    listener: Listener

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"


@pytest_asyncio.fixture(loop_scope="session")
async def door(openai_served: Served) -> AsyncIterator[Door]:
    recorder = EpisodeRecorder(max_episodes=8, max_calls=8, ttl_s=60)
    endpoint = OpenAIEndpoint(openai_served.engine, recorder, token=TOKEN, read_timeout_s=READ_TIMEOUT_S)
    sock = bind("127.0.0.1", 0)
    stats = DoorStats()
    task = asyncio.create_task(serve_openai(endpoint, sock, grace_s=0.1, max_connections=CAP,
                                            read_timeout_s=READ_TIMEOUT_S, stats=stats))
    await asyncio.sleep(0.2)
    try:
        yield Door(port=sock.getsockname()[1], stats=stats, served=openai_served, listener=sock)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def connect_all(port: int, n: int, payload: bytes) -> list[socket.socket]:
    out = []
    for _ in range(n):
        s = socket.create_connection(("127.0.0.1", port), timeout=5)
        if payload:
            with contextlib.suppress(OSError):
                s.sendall(payload)
        out.append(s)
    return out


class Count(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.lines += 1


async def legit_models(url: str) -> int:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=5) as http:
        return (await http.get(f"{url}/models")).status_code


async def test_a_flood_of_connections_is_capped_logged_in_bounds_and_grpc_still_answers(door: Door) -> None:
    counted = Count()
    for name in ("uvicorn.error", "asyncio"):
        logging.getLogger(name).addHandler(counted)
    before = open_fds()
    idle: list[socket.socket] = []
    junk: list[socket.socket] = []
    try:
        # Half idle, half sending garbage (each of which uvicorn answers 400 and logs a warning).
        idle = await asyncio.to_thread(connect_all, door.port, FLOOD // 2, b"")
        junk = await asyncio.to_thread(connect_all, door.port, FLOOD // 2, b"GARBAGE\x00\r\n\r\n")
        await asyncio.sleep(0.5)  # the server accepts what is queued
        server_side = open_fds() - before - FLOOD
        # Without the cap every one of them is an open descriptor of the service (FLOOD of them).
        assert server_side <= CAP + 8, (server_side, door.stats)
        assert door.stats.refused >= FLOOD - CAP - 8
        info = await door.served.stub.GetModelInfo(inference_pb2.GetModelInfoRequest(), timeout=5)
        assert info.model_name
        # The admitted idle ones are closed at the read timeout; then a real request gets through.
        await asyncio.sleep(READ_TIMEOUT_S + 0.5)
        assert await legit_models(door.url) == 200
        assert counted.lines <= 2 * LOG_LINES, counted.lines
    finally:
        for name in ("uvicorn.error", "asyncio"):
            logging.getLogger(name).removeHandler(counted)
        for s in (*idle, *junk):
            s.close()
    await asyncio.sleep(0.5)
    assert door.listener.open == 0  # every accepted socket was counted back: the cap does not leak


async def test_a_dripping_request_head_is_closed_within_the_read_timeout(door: Door) -> None:
    def drip() -> float:
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", door.port), timeout=5) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\n")
            try:
                for i in range(100):  # 10 s of drip unless the server hangs up
                    s.sendall(f"X-Drip-{i}: a\r\n".encode())
                    s.settimeout(0.1)
                    with contextlib.suppress(TimeoutError):
                        if s.recv(1024) == b"":
                            break
            except OSError:  # reset by the server
                pass
        return time.monotonic() - started

    held = await asyncio.to_thread(drip)
    assert held < READ_TIMEOUT_S + 1.0, held
    assert door.stats.timed_out >= 1


async def test_a_body_that_never_ends_is_a_408(door: Door) -> None:
    def slow_body() -> bytes:
        with socket.create_connection(("127.0.0.1", door.port), timeout=READ_TIMEOUT_S + 3) as s:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                      + f"Authorization: Bearer {TOKEN}\r\nContent-Type: application/json\r\n\r\n".encode() + b"{")
            return s.recv(4096)

    reply = await asyncio.to_thread(slow_body)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]


@pytest.mark.parametrize("route", ["chat/completions", "completions"])
async def test_json_nested_100k_deep_is_a_400_not_a_retryable_503(openai_served: Served, route: str) -> None:
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        for body in (b"[" * 100_000 + b"]" * 100_000, b'{"messages": ' + b"[" * 100_000):
            reply = await http.post(f"{openai_served.openai_url}/{route}", content=body)
            assert reply.status_code == 400, reply.text[:300]
            assert "nesting deeper than" in reply.json()["error"]["message"]


async def test_tool_call_arguments_nested_100k_deep_are_not_a_5xx(openai_served: Served) -> None:
    """The arguments of an assistant message's tool call are a JSON string inside the JSON body:
    parsed with the same bound, a deep one stays a string (here too long for the context: 400)."""
    call = {"id": "c1", "type": "function", "function": {"name": "calc", "arguments": "[" * 100_000}}
    body = {"model": "tiny", "max_tokens": 2, "messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "1"}]}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as http:
        reply = await http.post(f"{openai_served.openai_url}/chat/completions", json=body)
    assert reply.status_code in (200, 400), reply.text[:300]


async def test_a_tls_handshake_that_never_comes_is_dropped_and_real_tls_clients_are_served(
        openai_served: Served, tmp_path) -> None:
    from tests.support.certs import CertAuthority

    ca = CertAuthority(tmp_path)
    leaf = ca.issue("server")
    endpoint = OpenAIEndpoint(openai_served.engine, EpisodeRecorder(max_episodes=8, max_calls=8, ttl_s=60),
                              token=TOKEN, read_timeout_s=READ_TIMEOUT_S)
    sock = bind("127.0.0.1", 0)
    port = sock.getsockname()[1]
    task = asyncio.create_task(serve_openai(endpoint, sock, cert_file=str(leaf.cert), key_file=str(leaf.key),
                                            grace_s=0.1, read_timeout_s=READ_TIMEOUT_S))
    await asyncio.sleep(0.2)

    def silent() -> float:  # connects, never starts the handshake
        started = time.monotonic()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            with contextlib.suppress(OSError):
                s.recv(1)
        return time.monotonic() - started

    try:
        held = await asyncio.to_thread(silent)
        assert held < READ_TIMEOUT_S + 1.5, held  # asyncio's default would hold it 60 s
        async with httpx.AsyncClient(headers={"Authorization": f"Bearer {TOKEN}"}, verify=ssl.create_default_context(cafile=str(ca.ca)),
                                     timeout=10) as h:
            assert (await h.get(f"https://127.0.0.1:{port}/v1/models")).status_code == 200
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
