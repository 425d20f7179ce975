"""`python -m services.env_gateway [-c CONFIG] [--port P] [--metrics-port M]`."""

from __future__ import annotations

from arlo.config import ConfigError, RunConfig
from arlo.proto.v1 import env_pb2_grpc
from arlo.rpc import RunningServer, ServiceBinding, load_token, run_until_signal, setup_logging, start_server
from arlo.sandbox.hardening import make_undumpable
from arlo.service_args import parse_service_config
from arlo.tracing import Tracing, service_tracing
from services.env_gateway.gateway import Gateway
from services.env_gateway.mcp_envs import McpEnvs
from services.env_gateway.plugins import load_env_plugin
from services.env_gateway.registry import EnvContext, default_registry
from services.env_gateway.remote import RemoteEnvs
from services.env_gateway.server import SERVICE_NAME, EnvironmentServicer
from services.env_gateway.sessions import SessionStore


def build_gateway(cfg: RunConfig, context: EnvContext | None = None) -> Gateway:
    """The in-process core with the built-in environments and the configured plugins; ConfigError
    for a bad retrieval docs dir or dataset root, or a broken plugin (naming it)."""
    gw = cfg.env_gateway
    sessions = SessionStore(idle_timeout_s=gw.session_idle_timeout_s, max_sessions=gw.max_sessions,
                            max_per_client=gw.max_sessions_per_client)
    try:
        registry = default_registry(context if context is not None else EnvContext(gw, tool_format=cfg.model.tool_format))
    except ValueError as e:  # the message names the setting
        raise ConfigError(str(e)) from e
    for i, plugin in enumerate(gw.plugins):
        where = f"env_gateway.plugins[{i}]"
        spec = load_env_plugin(plugin, registry.context, where)
        if registry.get(spec.name) is not None:
            raise ConfigError(f"{where} {plugin.name!r}: the name is taken by a built-in environment")
        registry.register(spec)
    return Gateway(registry, sessions)


async def build_servicer(cfg: RunConfig, gateway: Gateway | None = None) -> EnvironmentServicer:
    """The servicer, with MCP servers and remote backends (if configured) connected and asked for
    their environments.

    Call inside the event loop that serves it; a backend that is down now is asked again later.
    """
    gateway = gateway if gateway is not None else build_gateway(cfg)
    mcp = await McpEnvs.start(cfg.env_gateway.mcp_servers, gateway.registry) if cfg.env_gateway.mcp_servers else None
    remotes = None
    try:
        if cfg.env_gateway.remotes:
            remotes = RemoteEnvs.from_config(cfg.env_gateway.remotes, gateway_token=load_token(cfg.auth),
                                             local_names=gateway.registry.names())
            await remotes.discover()
    except BaseException:
        if mcp is not None:
            await mcp.aclose()  # its stdio processes must not outlive a gateway that did not start
        raise
    gateway.attach(remotes, mcp)
    return EnvironmentServicer(gateway)


async def start_env_gateway(cfg: RunConfig, servicer: EnvironmentServicer | None = None,
                            tracing: Tracing | None = None) -> RunningServer:
    servicer = servicer if servicer is not None else await build_servicer(cfg)
    binding = ServiceBinding(name=SERVICE_NAME, add_to_server=env_pb2_grpc.add_EnvironmentServicer_to_server,
                             servicer=servicer)
    return await start_server("env_gateway", cfg.env_gateway.server, cfg.auth, [binding], tracing=tracing)


def main() -> None:
    cfg = parse_service_config("env_gateway")
    setup_logging("env_gateway")
    make_undumpable()  # sandboxed code must not read our environment (the token) via /proc
    servicers: list[EnvironmentServicer] = []
    with service_tracing(cfg.tracing, service="env_gateway", run_id=cfg.run_id) as tracing:

        async def start() -> RunningServer:
            servicers.append(await build_servicer(cfg))
            return await start_env_gateway(cfg, servicers[-1], tracing)

        async def stop() -> None:
            for servicer in servicers:
                await servicer.aclose()

        run_until_signal(start, on_stop=stop, grace_s=cfg.env_gateway.server.grace_s)


if __name__ == "__main__":
    main()
