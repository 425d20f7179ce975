"""Multi-host JAX: join the processes of a slice, and lay devices out as a named mesh.

`initialize_from_env()` is the first thing a trainer or inference process calls: when the
environment says this process is one of several (a JobSet across the hosts of a TPU slice,
or across GPU nodes) it calls `jax.distributed.initialize()` with the coordinator address,
process count and process id it found; on one host it does nothing, so the same code runs
on a laptop, in a single-pod Deployment and in a JobSet.

Where the values come from, first match wins (`detect(env)`; every variable is documented
in docs/deploy.md):

1. Explicit: `JAX_COORDINATOR_ADDRESS` ("host:port" of process 0), `JAX_NUM_PROCESSES`, and
   `JAX_PROCESS_ID` (or, in an Indexed Job / JobSet pod, `JOB_COMPLETION_INDEX`, which the
   Job controller sets). With several Jobs in the JobSet (multislice), each Job's indexes
   restart at 0: the id is `JOBSET_JOB_INDEX` x `JAX_PROCESSES_PER_JOB` + the completion index.
   deploy/overlays/gke-tpu/trainer-jobset.yaml sets these.
2. GKE TPU slices: GKE's TPU webhook injects `TPU_WORKER_HOSTNAMES` (comma-separated, in
   worker order) and `TPU_WORKER_ID` into pods of a JobSet / Indexed Job that request
   `google.com/tpu`; multislice adds `MEGASCALE_NUM_SLICES`, `MEGASCALE_SLICE_ID` and
   `MEGASCALE_COORDINATOR_ADDRESS`. The coordinator is worker 0 on port 8476 (JAX's default
   for TPU; `JAX_COORDINATOR_PORT` overrides).

`MeshConfig` (the axes) is declared in arlo.config with every other setting; this module lays
it out over devices. Importing it imports no JAX.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from arlo.config import ConfigError, MeshConfig

log = logging.getLogger(__name__)

DEFAULT_COORDINATOR_PORT = 8476
"""JAX's coordinator port for Cloud TPU; the JobSet manifests use it for GPUs too."""


@dataclass(frozen=True, kw_only=True, slots=True)
class DistributedEnv:
    """What `jax.distributed.initialize()` needs, as found in the environment."""

    coordinator_address: str
    num_processes: int
    process_id: int
    source: str
    """Which convention supplied the values ("explicit" or "gke-tpu"), for logs."""


def _int(env: Mapping[str, str], name: str) -> int | None:
    raw = env.get(name, "").strip()
    if not raw:
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"${name} must be an integer, got {raw!r}") from None


def _with_port(host: str, env: Mapping[str, str]) -> str:
    host = host.strip()
    if ":" in host.rsplit("]", 1)[-1]:  # already host:port (or [v6]:port)
        return host
    port = _int(env, "JAX_COORDINATOR_PORT") or DEFAULT_COORDINATOR_PORT
    return f"{host}:{port}"


def _job_process_id(env: Mapping[str, str], num_processes: int) -> int:
    index = _int(env, "JOB_COMPLETION_INDEX")
    if index is None:
        raise ValueError("$JAX_NUM_PROCESSES is set but neither $JAX_PROCESS_ID nor $JOB_COMPLETION_INDEX is")
    job = _int(env, "JOBSET_JOB_INDEX") or 0
    per_job = _int(env, "JAX_PROCESSES_PER_JOB") or num_processes
    if not 0 <= index < per_job:
        raise ValueError(f"$JOB_COMPLETION_INDEX={index} is outside the {per_job} processes of a Job "
                         "($JAX_PROCESSES_PER_JOB, default $JAX_NUM_PROCESSES)")
    return job * per_job + index


def detect(env: Mapping[str, str] | None = None) -> DistributedEnv | None:
    """The multi-process setup the environment describes; None for a single process.

    Raises ValueError when the variables are there but contradict each other (a process id
    out of range, a count that is not a number), rather than starting a job that hangs.
    """
    env = os.environ if env is None else env
    found: DistributedEnv | None = None
    if env.get("JAX_COORDINATOR_ADDRESS", "").strip() and _int(env, "JAX_NUM_PROCESSES") is not None:
        num = _int(env, "JAX_NUM_PROCESSES")
        assert num is not None
        pid = _int(env, "JAX_PROCESS_ID")
        if pid is None:
            pid = _job_process_id(env, num)
        found = DistributedEnv(coordinator_address=_with_port(env["JAX_COORDINATOR_ADDRESS"], env),
                               num_processes=num, process_id=pid, source="explicit")
    else:
        hosts_raw = env.get("TPU_PROCESS_ADDRESSES") or env.get("TPU_WORKER_HOSTNAMES") or ""
        hosts = [h.strip() for h in hosts_raw.split(",") if h.strip()]
        if hosts:
            worker = _int(env, "TPU_WORKER_ID")
            if worker is None:
                raise ValueError("$TPU_WORKER_HOSTNAMES is set but $TPU_WORKER_ID is not")
            slices = _int(env, "MEGASCALE_NUM_SLICES") or 1
            slice_id = _int(env, "MEGASCALE_SLICE_ID") or 0
            if not 0 <= worker < len(hosts):
                raise ValueError(f"$TPU_WORKER_ID={worker} is outside the {len(hosts)} workers of $TPU_WORKER_HOSTNAMES")
            if not 0 <= slice_id < slices:
                raise ValueError(f"$MEGASCALE_SLICE_ID={slice_id} is outside [0, $MEGASCALE_NUM_SLICES={slices})")
            # Multislice: process 0 is worker 0 of slice 0, which MEGASCALE_COORDINATOR_ADDRESS names.
            coordinator = (env.get("MEGASCALE_COORDINATOR_ADDRESS", "").strip() or hosts[0]).split(":")[0]
            found = DistributedEnv(coordinator_address=_with_port(coordinator, env),
                                   num_processes=len(hosts) * slices,
                                   process_id=slice_id * len(hosts) + worker, source="gke-tpu")
    if found is None:
        return None
    if found.num_processes < 1 or not 0 <= found.process_id < found.num_processes:
        raise ValueError(f"process id {found.process_id} is outside [0, {found.num_processes}) "
                         f"(from the {found.source} environment)")
    return found if found.num_processes > 1 else None


def initialize_from_env(env: Mapping[str, str] | None = None, *, timeout_s: int = 300) -> DistributedEnv | None:
    """Calls `jax.distributed.initialize()` when `detect(env)` finds several processes.

    Returns what it used, or None (one process: nothing to do, nothing called). Call it
    before any other JAX work in the process; calling it again after a successful start is
    a no-op. `timeout_s` bounds the wait for every process to join (a missing host fails
    the pod instead of hanging it).
    """
    found = detect(env)
    if found is None:
        return None
    import jax

    if jax.distributed.is_initialized():
        return found
    log.info("jax.distributed: process %d of %d, coordinator %s (%s)", found.process_id, found.num_processes,
             found.coordinator_address, found.source)
    # Every value is given, so JAX's own cluster detection (which on a Kubernetes pod wants the
    # `kubernetes` package and API access) is skipped.
    jax.distributed.initialize(coordinator_address=found.coordinator_address, num_processes=found.num_processes,
                               process_id=found.process_id, cluster_detection_method="deactivate",
                               initialization_timeout=timeout_s)
    return found


def hybrid_shapes(cfg: MeshConfig, num_devices: int, num_slices: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(per-slice ICI shape, across-slice DCN shape) for a multislice mesh of `num_devices`."""
    full = cfg.shape(num_devices)
    axis = cfg.axis_names.index(cfg.dcn_axis)
    if full[axis] % num_slices:
        raise ValueError(f"mesh axis {cfg.dcn_axis}={full[axis]} must be a multiple of the {num_slices} slices")
    ici = tuple(s // num_slices if i == axis else s for i, s in enumerate(full))
    dcn = tuple(num_slices if i == axis else 1 for i in range(len(full)))
    return ici, dcn


def make_mesh(cfg: MeshConfig, devices: Sequence[Any] | None = None, *, path: str = "mesh") -> Any:
    """A `jax.sharding.Mesh` over `devices` (default: every device of every process).

    Device order follows the hardware topology (`jax.make_mesh`): on TPU, neighbouring mesh
    positions are neighbouring chips. Axes are `Auto` (GSPMD propagates shardings), so code
    written for one device runs unchanged under the mesh. Axis sizes that cannot lay out these
    devices are a ConfigError naming `path` (the config section, e.g. "trainer.mesh"): a
    service exits at start with it, rather than crash and be restarted into the same error.
    """
    import jax
    from jax.experimental import mesh_utils
    from jax.sharding import AxisType, Mesh

    devices = list(jax.devices() if devices is None else devices)
    auto = (AxisType.Auto,) * len(cfg.axis_names)
    slices = {getattr(d, "slice_index", 0) for d in devices}
    try:
        shape = cfg.shape(len(devices))
        if len(slices) > 1:
            ici, dcn = hybrid_shapes(cfg, len(devices), len(slices))
    except ValueError as e:
        raise ConfigError(f"{path}.axis_sizes: {e}") from None
    if len(slices) > 1:
        grid = mesh_utils.create_hybrid_device_mesh(ici, dcn, devices)
        return Mesh(grid, cfg.axis_names, axis_types=auto)
    return jax.make_mesh(shape, cfg.axis_names, axis_types=auto, devices=devices)
