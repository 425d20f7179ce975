"""Command line shared by every `python -m services.<name>`: a config file plus port overrides."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from arlo.config import ConfigError, RunConfig, load_config
from arlo.config.base import SERVICE_NAMES as SECTIONS


def parse_service_config(service: str, argv: Sequence[str] | None = None) -> RunConfig:
    """Parses `-c CONFIG [--port P] [--metrics-port M]` and returns the validated run config.

    The config file also comes from $ARLO_CONFIG, so one manifest can point every service at it.
    A bad config exits with status 2 and a message naming the field.
    """
    if service not in SECTIONS:
        raise ValueError(f"unknown service {service!r}; known: {SECTIONS}")
    parser = argparse.ArgumentParser(prog=f"python -m services.{service}", description=f"Run the arlo {service} service.")
    parser.add_argument("-c", "--config", default=os.environ.get("ARLO_CONFIG"), help="run config YAML (default: built-in)")
    parser.add_argument("--port", type=int, help=f"override {service}.server.port (0 = any free port)")
    parser.add_argument("--metrics-port", type=int, help=f"override {service}.server.metrics_port (-1 = off)")
    args = parser.parse_args(argv)
    apply_cpu_share()
    apply_niceness()
    server: dict[str, int] = {}
    if args.port is not None:
        server["port"] = args.port
    if args.metrics_port is not None:
        server["metrics_port"] = args.metrics_port
    try:
        return load_config(args.config, {service: {"server": server}} if server else None)
    except ConfigError as e:
        print(f"arlo {service}: bad config: {e}", file=sys.stderr)
        raise SystemExit(2) from e


def apply_cpu_share() -> None:
    """Pins this process to $ARLO_CPUS (e.g. "0" or "0,1") when set: `arlo`'s local cluster gives
    each service an explicit share of a small host (bench/pipeline.py reports the setting)."""
    cpus = os.environ.get("ARLO_CPUS", "").strip()
    if cpus and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})


def apply_niceness() -> None:
    """Lowers this process's priority by $ARLO_NICE when set (`local.compute_nice`: the local
    cluster sets it for inference and the trainer). Called before the service starts its threads:
    on Linux niceness is per thread and inherited, so XLA's and gRPC's pools take it. With
    autogroup scheduling the kernel weighs sessions against each other by the session's own nice
    value (/proc/self/autogroup), so a session leader (the cluster starts each service in a
    session of its own) sets that too; a process in someone else's session (a shell's) does not."""
    nice = int(os.environ.get("ARLO_NICE", "0") or 0)
    if nice <= 0 or not hasattr(os, "nice"):
        return
    os.nice(nice)
    if os.getsid(0) != os.getpid():
        return
    try:
        with open("/proc/self/autogroup", "w") as f:
            f.write(str(nice))
    except OSError:  # no autogroup (another OS, or CONFIG_SCHED_AUTOGROUP off): the thread nice is all there is
        pass
