"""`python -m services.env_gateway [-c CONFIG] [--port P] [--metrics-port M]`."""

from __future__ import annotations

from arlo.config import RunConfig
from arlo.proto.v1 import env_pb2_grpc
from arlo.rpc import RunningServer, ServiceBinding, run_until_signal, setup_logging, start_server
from arlo.service_args import parse_service_config
from services.env_gateway.gateway import Gateway
from services.env_gateway.registry import default_registry
from services.env_gateway.server import SERVICE_NAME, EnvironmentServicer
from services.env_gateway.sessions import SessionStore


def build_gateway(cfg: RunConfig) -> Gateway:
    sessions = SessionStore(idle_timeout_s=cfg.env_gateway.session_idle_timeout_s,
                            max_sessions=cfg.env_gateway.max_sessions)
    return Gateway(default_registry(), sessions)


async def start_env_gateway(cfg: RunConfig) -> RunningServer:
    binding = ServiceBinding(name=SERVICE_NAME, add_to_server=env_pb2_grpc.add_EnvironmentServicer_to_server,
                             servicer=EnvironmentServicer(build_gateway(cfg)))
    return await start_server("env_gateway", cfg.env_gateway.server, cfg.auth, [binding])


def main() -> None:
    cfg = parse_service_config("env_gateway")
    setup_logging("env_gateway")
    run_until_signal(lambda: start_env_gateway(cfg), grace_s=cfg.env_gateway.server.grace_s)


if __name__ == "__main__":
    main()
