"""Nothing waits forever on the network: every RPC call in the code passes `timeout=`, and every
Redis client gets a socket timeout (the only constructors are arlo.coord.connect and the
short-lived PING in arlo.app.redis_server, both with timeouts)."""

from __future__ import annotations

import ast
from pathlib import Path

from google.protobuf import descriptor_pool
from grpc_health.v1 import health_pb2  # noqa: F401  (registers grpc.health.v1 in the pool)

import arlo.proto.v1  # noqa: F401
from arlo.proto.v1 import env_pb2, inference_pb2, reward_pb2, trainer_pb2  # noqa: F401

ROOT = Path(__file__).resolve().parents[2]
SERVICES = ("arlo.v1.Inference", "arlo.v1.Trainer", "arlo.v1.Environment", "arlo.v1.Reward", "grpc.health.v1.Health")
REDIS_CONSTRUCTORS = {"from_url", "Redis", "StrictRedis", "ConnectionPool"}


def rpc_names() -> set[str]:
    pool = descriptor_pool.Default()
    # Health's `List` would also match typing.List-style names; our code only ever calls Check.
    return {m.name for s in SERVICES for m in pool.FindServiceByName(s).methods} - {"List"}


def sources() -> list[Path]:
    return [p for d in ("arlo", "services", "bench") for p in (ROOT / d).rglob("*.py") if "proto" not in p.parts]


def calls(path: Path) -> list[ast.Call]:
    return [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Call)
            and isinstance(n.func, ast.Attribute)]


def test_the_rpc_names_are_found() -> None:
    assert {"Generate", "PullWeights", "Step", "Score", "Check"} <= rpc_names()


def test_every_rpc_call_has_a_deadline() -> None:
    names = rpc_names()
    missing = [f"{p.relative_to(ROOT)}:{c.lineno} {c.func.attr}" for p in sources() for c in calls(p)  # type: ignore[attr-defined]
               if c.func.attr in names and not any(k.arg == "timeout" for k in c.keywords)]  # type: ignore[attr-defined]
    assert missing == [], f"RPC calls without timeout=: {missing}"


def test_redis_clients_are_made_with_socket_timeouts() -> None:
    made = {}
    for p in sources():
        for c in calls(p):
            if c.func.attr in REDIS_CONSTRUCTORS:  # type: ignore[attr-defined]
                made[f"{p.relative_to(ROOT)}:{c.lineno}"] = {k.arg for k in c.keywords}
    assert made, "no Redis constructors found: the scan is broken"
    assert {where: kw for where, kw in made.items() if "socket_timeout" not in kw} == {}
