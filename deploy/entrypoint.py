"""The image's entry point: `SERVICE [ARGS...]` starts that arlo service, anything else is exec'd.

    docker run IMAGE inference            ->  python -m services.inference
    docker run IMAGE env-gateway --port 1 ->  python -m services.env_gateway --port 1
    docker run IMAGE arlo status          ->  arlo status

Why the config is rewritten: one run config is shared by every service, and in it
`<service>.server.host` is what *clients* dial (`dns:///inference`, a headless Service),
which a server cannot bind. With $ARLO_BIND_HOST set (the manifests set 0.0.0.0), the
service's own `server.host` becomes that bind address in a copy of the config under
$ARLO_RUNTIME_DIR (default /tmp/arlo, an emptyDir in the pods); every other section keeps
its client addresses. Without $ARLO_BIND_HOST the config is used as it is.

A bad config exits with status 2 and a message naming the field, as the services do.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

SERVICES = ("inference", "trainer", "env_gateway", "reward", "rollout")


def service_name(arg: str) -> str | None:
    """The service `arg` names ("env-gateway", the Kubernetes spelling, works too), else None."""
    name = arg.replace("-", "_")
    return name if name in SERVICES else None


def split_config_arg(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """(the -c/--config value or None, the other arguments)."""
    rest: list[str] = []
    config = None
    it = iter(args)
    for arg in it:
        if arg in ("-c", "--config"):
            config = next(it, None)
        elif arg.startswith("--config="):
            config = arg.split("=", 1)[1]
        elif arg.startswith("-c") and len(arg) > 2:
            config = arg[2:]
        else:
            rest.append(arg)
    return config, rest


def service_command(service: str, args: Sequence[str], env: Mapping[str, str]) -> list[str]:
    """argv that runs `service`, writing the bind-host copy of the config first when asked to."""
    config, rest = split_config_arg(args)
    config = config or env.get("ARLO_CONFIG") or None
    bind = env.get("ARLO_BIND_HOST", "").strip()
    if bind:
        from arlo.config import dump_config, load_config

        cfg = load_config(config, {service: {"server": {"host": bind}}})
        out_dir = Path(env.get("ARLO_RUNTIME_DIR") or "/tmp/arlo")
        out_dir.mkdir(parents=True, exist_ok=True)
        config = str(out_dir / f"{service}.yaml")
        dump_config(cfg, config)
    return [sys.executable, "-m", f"services.{service}", *(["-c", config] if config else []), *rest]


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip(), file=sys.stderr)
        return 0 if argv else 2
    service = service_name(argv[0])
    if service is None:
        os.execvp(argv[0], argv)
    from arlo.config import ConfigError

    try:
        cmd = service_command(service, argv[1:], os.environ)
    except ConfigError as e:
        print(f"arlo {service}: bad config: {e}", file=sys.stderr)
        return 2
    os.execv(cmd[0], cmd)
    return 0  # not reached


if __name__ == "__main__":
    raise SystemExit(main())
