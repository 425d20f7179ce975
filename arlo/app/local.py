"""The embedded default: every service as a local process beside a local Redis.

State lives in $ARLO_HOME (default ./.arlo): the resolved config the services run with,
the bearer token (mode 0600), one log file and one span file (traces/) per service, so `arlo train` and
`arlo status` in another terminal find what `arlo up` started.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path

from arlo.app.accelerator_layout import (
    COMPUTE_SERVICES,
    accelerator_env,
    gpu_shares,
    halves,
    mesh_misfit,
    on_gpus,
    visible_gpus,
)
from arlo.app.cpu_layout import Shares, cpu_shares
from arlo.app.ports import check_ports, recorded_ports, settled_ports, zero_ports
from arlo.app.redis_server import free_port, local_redis_url, redis_answers, redis_spec
from arlo.app.supervisor import ProcessSpec, Supervisor, service_spec
from arlo.compile_cache import ENV as COMPILE_CACHE_ENV
from arlo.config import RunConfig, dump_config, load_config, replace_config
from arlo.hostmem import merged_tunables
from arlo.private_files import arlo_home, private_dir, write_private

log = logging.getLogger(__name__)

# Dependencies first: inference and the trainer need nothing else; rollout needs all four.
INFRA_SERVICES = ("env_gateway", "reward", "inference", "trainer")
SERVICE_SECTIONS = (*INFRA_SERVICES, "rollout")


def resolved_config_path(home: Path | None = None) -> Path:
    return (home or arlo_home()) / "config.yaml"


def load_cli_config(path: str | None) -> RunConfig:
    """-c when given (its ports 0 as `arlo up -c` settled them); else the config a running `arlo up`
    wrote; else the built-in one."""
    resolved = resolved_config_path()
    if path:
        cfg = load_config(path)
        if not zero_ports(cfg, SERVICE_SECTIONS):
            return cfg
        recorded = load_config(resolved) if resolved.is_file() else None
        return recorded_ports(cfg, recorded, SERVICE_SECTIONS, source=path, home=str(arlo_home()))
    return load_config(resolved if resolved.is_file() else None)


def resolve_token(cfg: RunConfig, home: Path | None = None) -> str | None:
    """Token from the config's env var/file, else the one `arlo up` wrote; None when auth is off."""
    if cfg.auth.disabled:
        return None
    token = os.environ.get(cfg.auth.token_env)
    if token:
        return token.strip()
    for path in (cfg.auth.token_file, str((home or arlo_home()) / "token")):
        if path and Path(path).is_file():
            return Path(path).read_text().strip()
    return None


@dataclass
class LocalCluster:
    cfg: RunConfig
    config_path: Path
    home: Path
    token: str | None
    redis: ProcessSpec | None
    """The redis-server this cluster started (a supervised child, stopped last), else None."""
    supervisor: Supervisor
    cpu_shares: Shares | None = None
    """Service name -> the CPUs it may use ("0", "1", "0,1"), applied by the service at start
    (ARLO_CPUS) with one XLA/Eigen thread per CPU, so processes on a small host do not fight over
    cores (`local.cpus`, arlo/app/cpu_layout.py). None: the OS schedules everything."""
    gpu_shares: Shares | None = None
    """Inference / trainer -> the GPUs it sees (CUDA_VISIBLE_DEVICES; `local.accelerators`,
    arlo/app/accelerator_layout.py). None: each sees every accelerator JAX finds."""

    def service_env(self, name: str = "") -> dict[str, str]:
        env = {"JAX_PLATFORMS": services_platform(), "PYTHONUNBUFFERED": "1",
               "GLIBC_TUNABLES": merged_tunables(os.environ.get("GLIBC_TUNABLES"))}
        if self.token:
            env[self.cfg.auth.token_env] = self.token
        # Compiled programs persist under the home, so a second start reads them back (arlo.compile_cache).
        env[COMPILE_CACHE_ENV] = os.environ.get(COMPILE_CACHE_ENV) or str(self.home / "jax-cache")
        # arlo.service_args.apply_niceness; always set, so a value exported in the shell does not leak in.
        env["ARLO_NICE"] = str(self.cfg.local.compute_nice if name in COMPUTE_SERVICES else 0)
        env.update(accelerator_env(name, env["JAX_PLATFORMS"], memory_share=self.cfg.local.accelerator_memory,
                                   shares=self.gpu_shares, environ=os.environ))
        cpus = (self.cpu_shares or {}).get(name)
        if cpus:
            threads = len(cpus.split(","))
            env["ARLO_CPUS"] = cpus
            # Appended, so flags the user set for the services still apply.
            env["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} "
                                f"--xla_cpu_multi_thread_eigen={'true' if threads > 1 else 'false'}").strip()
            env["OMP_NUM_THREADS"] = env["OPENBLAS_NUM_THREADS"] = str(threads)
        return env

    def start(self, names: tuple[str, ...], timeout_s: float = 180.0) -> None:
        """Starts `names` together (they come up in parallel: imports, model load and warm-up
        overlap) and returns once every one is healthy; callers start dependents afterwards."""
        specs = [service_spec(name, self.config_path, getattr(self.cfg, name).server.address, self.home / "logs",
                              self.service_env(name)) for name in names]
        self.supervisor.specs += specs
        self.supervisor.start_many(specs, timeout_s)

    def stop(self, grace_s: float = 15.0) -> dict[str, int | None]:
        return self.supervisor.stop_all(grace_s)


def services_platform() -> str:
    """The JAX platform the local services run on (they default to the CPU)."""
    return os.environ.get("JAX_PLATFORMS", "cpu")


def local_cpu_shares(cfg: RunConfig) -> Shares | None:
    """The CPU shares `local.cpus` gives this run's services on this host (None: unpinned)."""
    if not hasattr(os, "sched_getaffinity"):  # no pinning on this OS: the services could not apply it
        if cfg.local.cpus not in ("auto", "off"):
            log.warning("local.cpus %r ignored: this OS cannot pin processes to CPUs", cfg.local.cpus)
        return None
    shares = cpu_shares(cfg.local.cpus, cpus=sorted(os.sched_getaffinity(0)),
                        synchronous=cfg.trainer.max_staleness == 0, platform=services_platform())
    if shares:
        log.info("CPU layout (local.cpus %s): %s", cfg.local.cpus, ", ".join(f"{k} {v}" for k, v in shares.items()))
    return shares


def local_gpu_shares(cfg: RunConfig) -> Shares | None:
    """The GPUs `local.accelerators` gives inference and the trainer on this host (None: shared)."""
    setting, platform = cfg.local.accelerators, services_platform()
    if not on_gpus(platform):  # no look for GPUs (nvidia-smi) on the way
        if setting not in ("auto", "shared"):
            log.warning("local.accelerators %r ignored: the services run on JAX platform %r, not CUDA GPUs",
                        setting, platform)
        return None
    if setting == "shared":
        return None
    gpus = visible_gpus(os.environ)
    meshes = {"inference": cfg.inference.mesh, "trainer": cfg.trainer.mesh}
    shares = gpu_shares(setting, gpus=gpus, platform=platform, meshes=meshes)
    if shares:
        log.info("GPU layout (local.accelerators %s): %s", setting, ", ".join(f"{k} {v}" for k, v in shares.items()))
    elif len(gpus) >= 2:  # auto, and a mesh does not fit the halves
        log.warning("inference and the trainer share GPUs %s: %s", ",".join(gpus),
                    mesh_misfit(halves(gpus), gpus=gpus, meshes=meshes))
    return shares


def wipe_run(cfg: RunConfig) -> int:
    """Deletes every key of the run's namespace (the demo starts from nothing each time)."""
    from arlo.coord import connect, delete_run

    async def _wipe() -> int:
        redis = await connect(cfg.redis)
        try:
            return await delete_run(redis, cfg.run_id)
        finally:
            await redis.aclose()

    return asyncio.run(_wipe())


DEFAULT_CHECKPOINT_EVERY = 10


def default_checkpoints(cfg: RunConfig, home: Path) -> dict[str, object]:
    """Local runs checkpoint by default, under $ARLO_HOME/checkpoints/<run_id>: without them a
    restarted trainer would begin again from the initial weights while what it learned stays
    acknowledged (docs/reliability.md). A configured directory or interval is kept."""
    tc = cfg.trainer
    out: dict[str, object] = {}
    if not tc.checkpoint_dir:
        out["checkpoint_dir"] = str(home / "checkpoints" / cfg.run_id)
    if not tc.checkpoint_every:
        out["checkpoint_every"] = DEFAULT_CHECKPOINT_EVERY
    return out


def default_tracing(cfg: RunConfig, home: Path) -> dict[str, object]:
    """A local run with `tracing.enabled` writes one span file per service under $ARLO_HOME/traces
    (docs/architecture.md, Traces) unless the config names a directory or a collector."""
    if not cfg.tracing.enabled:
        return {}
    return {"enabled": True, **({} if cfg.tracing.dir else {"dir": str(home / "traces")})}


def prepare_cluster(cfg: RunConfig, *, home: Path, free_ports: bool, fresh_run: bool = False) -> LocalCluster:
    """Starts Redis if none answers, settles ports and the token, writes the resolved config.

    `fresh_run` wipes the run's Redis namespace first: only for runs arlo owns (the demo's).
    """
    private_dir(home)  # holds the token and a config that may carry a Redis password
    shares = local_cpu_shares(cfg)  # refused before anything starts (a CPU this host lacks)
    gpus = local_gpu_shares(cfg)  # likewise a GPU
    overrides: dict = {}
    redis = None
    supervisor = Supervisor([])
    if not redis_answers(cfg.redis.url):
        url = local_redis_url(cfg.redis.url, free_ports=free_ports)
        log.info("no Redis answers at %s; starting a local redis-server at %s", cfg.redis.url, url)
        redis = redis_spec(url, home / "redis", home / "logs")
        overrides["redis"] = {"url": url}
    if free_ports:
        for name in SERVICE_SECTIONS:
            overrides[name] = {"server": {"port": free_port(), "metrics_port": free_port()}}
    else:  # a port 0 is chosen here and recorded, so health checks and `arlo status` know it
        overrides.update(settled_ports(cfg, SERVICE_SECTIONS))
    # The driver (`arlo train`/`demo`) resumes the trainer phase by phase; until then it waits.
    overrides.setdefault("trainer", {})["start_paused"] = True
    overrides["trainer"].update(default_checkpoints(cfg, home))
    overrides["tracing"] = default_tracing(cfg, home)
    token = None
    if not cfg.auth.disabled:
        token = resolve_token(cfg, home) or secrets.token_urlsafe(32)
        token_path = home / "token"
        write_private(token_path, token)
        overrides["auth"] = {"token_file": str(token_path)}
    resolved = replace_config(cfg, overrides)
    check_ports(resolved, SERVICE_SECTIONS)  # before anything starts: a clash is one line, not restart loops
    config_path = resolved_config_path(home)
    if redis is not None:  # supervised like the services (restarted after a crash), stopped last
        supervisor.specs.append(redis)
        supervisor.start(redis, timeout_s=30.0)
    try:
        if fresh_run:
            wipe_run(resolved)
            if "checkpoint_dir" in overrides["trainer"]:
                # A fresh run must not resume a previous demo's weights: its default checkpoints go too.
                shutil.rmtree(overrides["trainer"]["checkpoint_dir"], ignore_errors=True)
        dump_config(resolved, config_path)
    except BaseException:
        supervisor.stop_all()
        raise
    return LocalCluster(cfg=resolved, config_path=config_path, home=home, token=token, redis=redis,
                        supervisor=supervisor, cpu_shares=shares, gpu_shares=gpus)


def attach_cluster(cfg: RunConfig, token: str | None, *, config_path: str | None) -> LocalCluster:
    """A cluster handle for services that are already running (`arlo train` adds rollout workers)."""
    home = arlo_home()
    if config_path and zero_ports(load_config(config_path), SERVICE_SECTIONS, ("port",)):
        # Its ports 0 were read back from the run `arlo up` recorded (`load_cli_config`): the rollout
        # worker gets them in a config of its own.
        path = home / "train-config.yaml"
        private_dir(home)
        dump_config(cfg, path)
    elif config_path:
        path = Path(config_path).resolve()
    else:
        path = resolved_config_path(home)
        if not path.is_file():
            private_dir(home)
            dump_config(cfg, path)
    return LocalCluster(cfg=cfg, config_path=path, home=home, token=token, redis=None, supervisor=Supervisor([]),
                        cpu_shares=local_cpu_shares(cfg))
