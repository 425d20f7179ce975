"""The local cluster's ports: 0 settled to a free port before anything starts, clashes refused.

A service given port 0 binds a free port of its own choosing, which `arlo up` then cannot know:
it health-checked 127.0.0.1:0 for 180 s and `arlo status` listed every service there (issue 33).
So 0 is settled here, to a port free now, and recorded in the resolved config under
$ARLO_HOME that every later command reads. A port already taken (another run's services) is
refused here, naming the setting, rather than after each service has been restarted three times.
"""

from __future__ import annotations

import socket
from collections.abc import Iterable

from arlo.app.redis_server import free_port
from arlo.config import ConfigError, RunConfig, replace_config


def settled_ports(cfg: RunConfig, sections: Iterable[str]) -> dict[str, dict]:
    """Config overrides giving every port 0 (server.port, server.metrics_port) of `sections` a
    port free now; -1 (off) and set ports stay."""
    overrides: dict[str, dict] = {}
    for name in sections:
        server = getattr(cfg, name).server
        chosen = {key: free_port(_bind_host(server.host)) for key in ("port", "metrics_port")
                  if getattr(server, key) == 0}
        if chosen:
            overrides[name] = {"server": chosen}
    return overrides


def zero_ports(cfg: RunConfig, sections: Iterable[str], keys: tuple[str, ...] = ("port", "metrics_port")
               ) -> dict[str, list[str]]:
    """Section -> its server port settings of `keys` that are 0 (a free port, chosen by `arlo up`)."""
    zero = {name: [key for key in keys if getattr(getattr(cfg, name).server, key) == 0] for name in sections}
    return {name: found for name, found in zero.items() if found}


def recorded_ports(cfg: RunConfig, recorded: RunConfig | None, sections: Iterable[str], *, source: str,
                   home: str) -> RunConfig:
    """`cfg` (a -c config of `arlo train`/`status`/`export`) with each port 0 of `sections` read back
    from `recorded`, the run `arlo up -c` recorded under $ARLO_HOME: its 0 was settled there, and
    127.0.0.1:0 reaches nothing (`arlo train -c X` said "not serving" for X's port-0 services).
    Raises ConfigError, naming the settings, when no run of `cfg`'s run_id is recorded and a gRPC
    port is 0 (a metrics port 0 is left: a process started with it picks its own)."""
    zero = zero_ports(cfg, sections)
    if recorded is None or recorded.run_id != cfg.run_id:
        if not (grpc_zero := zero_ports(cfg, sections, ("port",))):
            return cfg
        names = ", ".join(f"{name}.server.port" for name in grpc_zero)
        raise ConfigError(f"{source}: {names} 0 (a free port that `arlo up` chooses and records), but no run "
                          f"{cfg.run_id!r} is recorded under ARLO_HOME {home} (config.yaml): use the ARLO_HOME of "
                          f"its `arlo up`, or set the ports")
    return replace_config(cfg, {name: {"server": {key: getattr(getattr(recorded, name).server, key) for key in keys}}
                                for name, keys in zero.items()})


def check_ports(cfg: RunConfig, sections: Iterable[str]) -> None:
    """Raises ConfigError naming each port setting of `sections` that another setting shares or
    that something on this host already listens on."""
    seen: dict[int, str] = {}
    problems: list[str] = []
    for name in sections:
        server = getattr(cfg, name).server
        ports = [("server.port", server.port), ("server.metrics_port", server.metrics_port)]
        if name == "inference" and cfg.inference.openai_port > 0:
            ports.append(("openai_port", cfg.inference.openai_port))
        for key, port in ports:
            if port <= 0:
                continue
            where = f"{name}.{key}"
            if port in seen:
                problems.append(f"{where} {port} is also {seen[port]}")
            elif not _bindable(_bind_host(server.host), port):
                problems.append(f"{where} {port} is in use on this host (another run's services? `arlo status` with its "
                                f"ARLO_HOME lists them)")
            seen.setdefault(port, where)
    if problems:
        raise ConfigError("; ".join(problems) + ". Pick other ports, or 0 for free ones (recorded in "
                          "$ARLO_HOME/config.yaml)")


def _bind_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "localhost") else host


def _bindable(host: str, port: int) -> bool:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the servers bind: TIME_WAIT is no clash
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
