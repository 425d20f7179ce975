"""Load on an MCP-backed environment: N concurrent episodes through the real env_gateway gRPC server,
each Reset, `--calls` tool-call Steps routed to a real MCP server, then a final answer.

    python -m bench.mcp_load [--episodes 256] [--rounds 3] [--calls 3] [--http] [--json PATH]

The server is tests/support/mcp_servers.py (the mcp SDK's MCPServer), over stdio (the gateway runs
it) or streamable HTTP (--http, started here). Reported: p50/p99 latency and errors per RPC, and
episodes/s. The bar: zero errors at 256 episodes in flight.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import grpc

from arlo.config import load_config
from arlo.proto.v1 import env_pb2, env_pb2_grpc
from arlo.rpc import make_channel
from bench.common import check_json_arg, int_at_least, percentile, print_table, run_main, write_json
from services.env_gateway.__main__ import build_servicer, start_env_gateway

ROOT = Path(__file__).resolve().parent.parent
SERVER = [sys.executable, "-m", "tests.support.mcp_servers"]
TOKEN_ENV = "ARLO_BENCH_MCP_TOKEN"


async def episode(stub: env_pb2_grpc.EnvironmentStub, i: int, calls: int, latency: dict[str, list[float]],
                  errors: Counter[tuple[str, str]]) -> None:
    async def timed(rpc: str, job: Any) -> Any:
        start = time.perf_counter()
        try:
            reply = await job
        except grpc.aio.AioRpcError as e:
            errors[(rpc, e.code().name)] += 1
            raise
        latency[rpc].append(time.perf_counter() - start)
        return reply

    config = json.dumps({"prompt": f"Add {i} and 1.", "reference": str(i + 1)})
    started = await timed("Reset", stub.Reset(env_pb2.ResetRequest(env_name="mcp:tools", config_json=config,
                                                                    seed=i), timeout=30))
    for k in range(calls):
        action = f'<tool_call>{{"name": "add", "arguments": {{"a": {i}, "b": {k}}}}}</tool_call>'
        reply = await timed("Step(tool)", stub.Step(env_pb2.StepRequest(session_id=started.session_id,
                                                                          action=action), timeout=30))
        if reply.observation[0].content != str(i + k):
            errors[("Step(tool)", "wrong result")] += 1
    final = await timed("Step(final)", stub.Step(env_pb2.StepRequest(session_id=started.session_id,
                                                                       action=str(i + 1)), timeout=30))
    if not final.done:
        errors[("Step(final)", "not done")] += 1


@contextmanager
def http_server() -> Iterator[str]:
    """The MCP test server on streamable HTTP, as a subprocess; yields its URL."""
    proc = subprocess.Popen([*SERVER, "--http"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        yield f"http://127.0.0.1:{int(proc.stdout.readline().split()[1])}/mcp"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


async def run(*, episodes: int, rounds: int, calls: int, url: str = "") -> dict[str, Any]:
    """`rounds` of `episodes` concurrent episodes on an in-process gateway serving the MCP server
    (stdio, started by the gateway, or the one at `url`). bench/load.py --mcp runs this too."""
    os.environ.setdefault(TOKEN_ENV, "bench-mcp")
    server = {"name": "tools", "url": url} if url else {"name": "tools", "command": SERVER, "cwd": str(ROOT)}
    server["max_concurrency"] = episodes
    cfg = load_config(None, {"auth": {"token_env": TOKEN_ENV}, "env_gateway": {
        "server": {"port": 0, "metrics_port": -1}, "mcp_servers": [server]}})
    servicer = await build_servicer(cfg)
    running = await start_env_gateway(cfg, servicer)
    latency: dict[str, list[float]] = defaultdict(list)
    errors: Counter[tuple[str, str]] = Counter()
    try:
        async with make_channel(f"127.0.0.1:{running.port}", token=os.environ[TOKEN_ENV]) as channel:
            stub = env_pb2_grpc.EnvironmentStub(channel)
            await episode(stub, 0, 1, defaultdict(list), Counter())  # warm: connect, list tools
            began = time.perf_counter()
            for r in range(rounds):
                results = await asyncio.gather(*(episode(stub, r * episodes + i, calls, latency, errors)
                                                 for i in range(episodes)), return_exceptions=True)
                for e in results:
                    if isinstance(e, Exception) and not isinstance(e, grpc.aio.AioRpcError):
                        errors[("episode", type(e).__name__)] += 1
            elapsed = time.perf_counter() - began
    finally:
        await running.stop(None)
        await servicer.aclose()
    return {"transport": "http" if url else "stdio", "episodes_in_flight": episodes, "rounds": rounds,
            "tool_calls_per_episode": calls, "episodes_per_s": episodes * rounds / elapsed,
            "rpcs": {rpc: {"n": len(v), "p50_ms": 1000 * percentile(v, 50), "p99_ms": 1000 * percentile(v, 99)}
                     for rpc, v in latency.items()},
            "errors": {f"{rpc} {code}": n for (rpc, code), n in errors.items()},
            "passed": not errors}


def report(out: dict[str, Any]) -> None:
    print_table(f"MCP env ({out['transport']}), {out['episodes_in_flight']} episodes in flight, "
                f"{out['episodes_per_s']:.1f} episodes/s", ["rpc", "n", "p50 ms", "p99 ms"],
                [[rpc, r["n"], f"{r['p50_ms']:.1f}", f"{r['p99_ms']:.1f}"] for rpc, r in out["rpcs"].items()])
    print("errors:", out["errors"] or "none")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int_at_least(1), default=256)
    parser.add_argument("--rounds", type=int_at_least(1), default=3)
    parser.add_argument("--calls", type=int_at_least(1), default=3, help="tool calls per episode")
    parser.add_argument("--http", action="store_true", help="the MCP server on streamable HTTP instead of stdio")
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args(argv)
    check_json_arg(parser, args)
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    with http_server() if args.http else nullcontext("") as url:
        out = asyncio.run(run(episodes=args.episodes, rounds=args.rounds, calls=args.calls, url=url))
    report(out)
    if args.json:
        write_json(args.json, out)


if __name__ == "__main__":
    run_main(main)
