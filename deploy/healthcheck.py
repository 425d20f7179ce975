"""Container health check: asks the arlo service in this container `grpc.health.v1.Health/Check`.

Exit 0 when the server answers SERVING, 1 otherwise (Docker's HEALTHCHECK contract).
Kubernetes does not run this: its probes use kubelet's native `grpc:` check on the same port.

Which port: $ARLO_HEALTH_ADDRESS ("host:port") when set; otherwise the port of the service
that PID 1 (or --pid) runs (`python -m services.<name> [-c CONFIG] [--port P]`, as deploy/entrypoint.py
execs it), read from that service's config the same way the service reads it.

    python healthcheck.py [--timeout SECONDS] [--pid PID]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path


def target_from_cmdline(cmdline: Sequence[str], env: dict[str, str] | None = None) -> str:
    """"127.0.0.1:PORT" of the service `cmdline` runs; ValueError when it runs none."""
    env = dict(os.environ) if env is None else env
    args = list(cmdline)
    if "-m" not in args or args.index("-m") + 1 >= len(args) or not args[args.index("-m") + 1].startswith("services."):
        raise ValueError(f"not an arlo service: {' '.join(args)!r}")
    service = args[args.index("-m") + 1].removeprefix("services.")
    rest = args[args.index("-m") + 2:]
    config = env.get("ARLO_CONFIG") or None
    port: int | None = None
    for i, arg in enumerate(rest):
        value = rest[i + 1] if i + 1 < len(rest) else None
        if arg in ("-c", "--config") and value:
            config = value
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg == "--port" and value:
            port = int(value)
        elif arg.startswith("--port="):
            port = int(arg.split("=", 1)[1])
    if port is None:
        from arlo.config import load_config

        port = getattr(load_config(config), service).server.port
    if not port:
        raise ValueError(f"{service} listens on an ephemeral port (0); set ARLO_HEALTH_ADDRESS")
    return f"127.0.0.1:{port}"


def check(target: str, timeout_s: float) -> str:
    """The serving status name, e.g. "SERVING"; raises grpc.RpcError when nothing answers."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target) as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=timeout_s)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="gRPC health check of the arlo service in this container")
    parser.add_argument("--timeout", type=float, default=3.0, help="seconds to wait for the answer")
    parser.add_argument("--pid", type=int, default=1, help="process running the service (default: 1)")
    args = parser.parse_args(argv)
    try:
        target = os.environ.get("ARLO_HEALTH_ADDRESS") or target_from_cmdline(
            Path(f"/proc/{args.pid}/cmdline").read_bytes().decode().split("\0")[:-1])
        status = check(target, args.timeout)
    except Exception as e:  # any failure is "unhealthy", said in one line
        print(f"unhealthy: {type(e).__name__}: {e}".splitlines()[0], file=sys.stderr)
        return 1
    print(f"{target}: {status}")
    return 0 if status == "SERVING" else 1


if __name__ == "__main__":
    raise SystemExit(main())
