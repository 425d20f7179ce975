"""`python -m services.reward [-c CONFIG] [--port P] [--metrics-port M]`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry

from arlo.config import RunConfig
from arlo.proto.v1 import reward_pb2_grpc
from arlo.rpc import RunningServer, ServiceBinding, run_until_signal, setup_logging, start_server
from arlo.sandbox.hardening import make_undumpable
from arlo.service_args import parse_service_config
from arlo.tracing import Tracing, service_tracing
from services.reward.registry import build_registry
from services.reward.scoring import Scorer
from services.reward.server import SERVICE_NAME, RewardServicer


async def start_reward(cfg: RunConfig, tracing: Tracing | None = None) -> RunningServer:
    """Raises ConfigError (exit 2 under run_until_signal) when a plugin or the sandbox is broken."""
    rewards = build_registry(cfg.reward)
    registry = CollectorRegistry()
    servicer = RewardServicer(rewards, Scorer(timeout_s=cfg.reward.timeout_s), metrics_registry=registry)
    binding = ServiceBinding(name=SERVICE_NAME, add_to_server=reward_pb2_grpc.add_RewardServicer_to_server,
                             servicer=servicer)
    return await start_server("reward", cfg.reward.server, cfg.auth, [binding], registry=registry,
                              tracing=tracing)


def main() -> None:
    cfg = parse_service_config("reward")
    setup_logging("reward")
    make_undumpable()  # sandboxed code must not read our environment (the token) via /proc
    with service_tracing(cfg.tracing, service="reward", run_id=cfg.run_id) as tracing:
        run_until_signal(lambda: start_reward(cfg, tracing), grace_s=cfg.reward.server.grace_s)


if __name__ == "__main__":
    main()
